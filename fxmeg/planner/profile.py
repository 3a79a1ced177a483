"""What one rank holds, computes and sends for each part of a model, read off transformed
graphs: the planner's per-layer numbers.

A search visits thousands of layouts; transforming the whole model for each would take
hours. The layers of a decoder repeat, so the planner transforms a **twin**: the model with
one block of each kind kept (``twin``; a dense Llama keeps one, DeepSeek-V3 a dense block and
a MoE block), captured once and transformed once per intra-layer layout (``Key``: tp, sp,
cp, ep, expert tp, recompute) at pp = 1, on one sample. Each transform gives ``Part``\\ s:
before the blocks, one per kind of block, after the blocks. The pipeline axes, data
parallelism, ZeRO and the micro-batch size are then arithmetic on parts
(fxmeg/planner/estimate.py).

Requires: the model's blocks in one module list (the partition pass's blocks) and an
example of one micro-batch. Ensures: every number is what the passes produce for the twin:
the same shards, collectives, saved tensors and FLOPs ``fxmeg plan`` reads.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from fxmeg.config import EngineConfig, Example
from fxmeg.diagnostics.saved_activations import attention_working, region_bytes, saved_tensors
from fxmeg.diagnostics.split_activations import RECEIVED, SENT_GRADIENT, split_held, split_nodes
from fxmeg.errors import FxmegError
from fxmeg.frontend.capture import owning_module
from fxmeg.frontend.model_checks import model_config, module_blocks
from fxmeg.frontend.pass_driver import transform
from fxmeg.frontend.variable_shapes import meta_twin
from fxmeg.ir import ops
from fxmeg.passes.graph_utils import attr, is_hop, val
from fxmeg.passes.partition import node_bytes, node_cost, node_flops

PRE, POST = "pre", "post"


@dataclass(frozen=True)
class Key:
    """The options that change a layer's graph (the rest compose: estimate.py)."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    expert_tp: int | None = None
    recompute: str = "none"

    def __str__(self) -> str:
        return (f"tp={self.tp}{' sp' if self.sp else ''} cp={self.cp} ep={self.ep} "
                f"recompute={self.recompute}")

    def options(self) -> dict:
        return {"tp": self.tp, "sequence_parallel": self.sp, "cp": self.cp, "ep": self.ep,
                "expert_tensor_parallel_size": self.expert_tp, "recompute": self.recompute}


# fwd, bwd collective of each fxmeg op ('' none); the bytes are the whole tensor's
COLLECTIVES = {
    "tp_copy": ("", "all_reduce"), "tp_reduce": ("all_reduce", ""),
    "sp_gather": ("all_gather", "reduce_scatter"), "sp_scatter": ("reduce_scatter", "all_gather"),
    "sp_whole": ("all_gather", ""), "sp_split": ("", "all_gather"),
    "tp_max": ("all_reduce", ""), "tp_slice": ("", "all_gather"),
    "vocab_parallel_cross_entropy": ("all_reduce", ""),
    "cp_gather": ("all_gather", "reduce_scatter"),
    "cp_reduce_scatter": ("reduce_scatter", "all_gather"),
    "cp_all_reduce": ("all_reduce", ""),
    "cp_attention": ("all_gather", "reduce_scatter"),
    # cp_comm_type a2a: q, k, v to heads and the output back, and the reverse in backward
    "cp_to_heads": ("all_to_all", "all_to_all"), "cp_from_heads": ("all_to_all", "all_to_all"),
    # p2p: the ring passes k and v around (an all-gather's volume, beside its blocks'
    # compute), and in backward k, v and their fp32 gradients
    "cp_ring_attention": ("all_gather", "all_gather"),
    "routed_experts": ("all_to_all", "all_to_all"),
}
"""The communication of each collective op, forward and backward (docs/planner.md)."""


@dataclass(frozen=True)
class Comm:
    """One collective one micro-batch of one sample runs, forward or backward."""

    group: str
    """'tp', 'cp' or 'ep'."""
    kind: str
    """'all_reduce', 'all_gather', 'reduce_scatter' or 'all_to_all'."""
    nbytes: int
    """The whole tensor (gathered / reduced); for all_to_all, what one rank sends."""
    backward: bool
    hidden_by: float = 0.0
    """FLOPs of the op's own compute that the transfer runs beside (the ring's blocks):
    only the time past them is exposed."""


@dataclass(frozen=True)
class Part:
    """One part of the model on one rank, for one micro-batch of one sample."""

    name: str
    """'pre', 'post', or the twin's block ('layers.0')."""
    params: Mapping[str, tuple[int, int, bool]]
    """Trainable parameter -> (local bytes, local elements, is a routed-experts bank)."""
    activations: int
    """Bytes autograd keeps for backward (``saved_tensors``)."""
    recompute_working: int
    """Bytes held once while backward runs this part's largest recompute region again."""
    flops: float
    """Forward FLOPs (matmuls and attention) on this rank."""
    cost: float
    """The partition's cost (``node_cost``): what the balanced cut weighs."""
    ops: tuple[tuple[float, int], ...]
    """(FLOPs, bytes moved) of every forward op (the time model's roofline)."""
    recomputed: tuple[tuple[float, int], ...]
    """The same for the ops that backward runs again (inside recompute regions)."""
    comms: tuple[Comm, ...]
    boundary: int = 0
    """Bytes of the value that leaves this part (a pipeline message after it)."""
    largest: int = 0
    """Bytes of the largest value an op makes (backward holds its gradient beside the
    gradient it makes from it: the transient working set)."""
    working: int = 0
    """The most an exchanged attention holds for itself in backward (``attention_working``)."""

    @property
    def param_elements(self) -> int:
        return sum(e for _, e, _ in self.params.values())

    @property
    def expert_elements(self) -> int:
        return sum(e for _, e, x in self.params.values() if x)


@dataclass(frozen=True)
class Profile:
    """The parts of the twin under one ``Key``."""

    key: Key
    pre: Part
    blocks: tuple[Part, ...]
    """One per kind of block, in the twin's order."""
    post: Part
    grad_itemsize: int
    """Bytes per element of the gradient buffers."""
    model_flops: float
    """Forward FLOPs of the twin, whole (all ranks), one sample."""


@dataclass
class Twin:
    """The model with one block of each kind, and which kind each real block is."""

    model: nn.Module
    kinds: tuple[int, ...]
    """Per real block, in order: the index of its kind (the twin's first block of it)."""
    blocks: tuple[str, ...]
    """The real model's block names."""
    own: tuple[int, ...] = ()
    """Per block of the twin itself, the index of its kind."""
    profiles: dict[Key, Profile] = field(default_factory=dict)
    split_checked: dict[Key, Exception | dict[str, tuple[int, int, int]]] = field(
        default_factory=dict)
    """Per key, its zero-bubble split's refusal or what each part holds (``check_split``)."""


def signature(module: nn.Module) -> tuple:
    """What tells kinds of block apart: the class and every parameter's and buffer's
    relative name, shape and dtype."""
    return (type(module).__name__,) + tuple(
        (n, tuple(t.shape), t.dtype)
        for n, t in (*module.named_parameters(), *module.named_buffers()))


def twin(model: nn.Module) -> Twin:
    """``model`` on the meta device with the first block of each kind kept, in order (a
    Hugging Face config's ``num_hidden_layers`` and ``layer_types`` follow)."""
    names = module_blocks(model)
    if not names:
        copy_ = meta_twin(model)
        return Twin(copy_, (), ())
    sigs: dict[tuple, int] = {}
    kinds, keep = [], []
    for i, block in enumerate(model.get_submodule(names[0].rpartition(".")[0])):
        s = signature(block)
        if s not in sigs:
            sigs[s] = len(keep)
            keep.append(i)
        kinds.append(sigs[s])
    if len(keep) == 1 and len(names) > 1:  # two blocks: a pipeline of two for zero bubble
        keep.append(1)
    return Twin(_kept(model, names, keep), tuple(kinds), tuple(names),
                tuple(kinds[i] for i in keep))


def deeper(tw: Twin) -> nn.Module:
    """The twin with each of its blocks twice (a copy after each, on meta): timed beside
    the twin, it tells a block's seconds from the rest's (fxmeg/planner/calibrate.py)."""
    names = module_blocks(tw.model)
    if not names:
        return meta_twin(tw.model)
    return _kept(tw.model, names, [i for i in range(len(names)) for _ in range(2)])


def _kept(model: nn.Module, names: list[str], keep: list[int]) -> nn.Module:
    """A meta copy of ``model`` whose blocks are ``keep`` (indices; one repeated is a copy
    of it), its config's ``num_hidden_layers`` and ``layer_types`` following."""
    container = names[0].rpartition(".")[0]
    owner_name, _, attr_name = container.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    whole = getattr(owner, attr_name)
    blocks = [copy.deepcopy(whole[i]) if i in keep[:n] else whole[i]
              for n, i in enumerate(keep)]
    setattr(owner, attr_name, nn.ModuleList(blocks))
    try:
        copy_ = meta_twin(model)
    finally:
        setattr(owner, attr_name, whole)
    cfg = model_config(copy_)
    if cfg is not None and hasattr(cfg, "num_hidden_layers"):
        cfg = copy.deepcopy(cfg)
        types = getattr(cfg, "layer_types", None)
        if isinstance(types, list) and len(types) == len(whole):
            cfg.layer_types = [types[i] for i in keep]
        cfg.num_hidden_layers = len(keep)
        _set_config(copy_, cfg)
    return copy_


def _set_config(model: nn.Module, cfg) -> None:
    """Point every module that holds the text config at ``cfg``."""
    old = model_config(model)
    for m in model.modules():
        for name in ("config", "cfg"):
            if getattr(m, name, None) is old:
                setattr(m, name, cfg)


def one_sample(example: Example) -> Example:
    """The example cut to one sample, on meta."""
    if isinstance(example, Mapping):
        return {k: t[:1].to("meta") for k, t in example.items()}
    return tuple(t[:1].to("meta") for t in example)


def profile(tw: Twin, example: Example, key: Key, base: EngineConfig, loss_fn=None) -> Profile:
    """The twin's parts under ``key`` (cached on ``tw``). ``base`` gives the precision
    and every option the search does not vary. Raises what the passes raise for a layout
    they refuse."""
    if key in tw.profiles:
        return tw.profiles[key]
    config = base.replace(
        micro_batch_size=1, global_batch_size=key.ep, tp=key.tp, cp=key.cp, pp=1, vpp=1,
        dp=key.ep, schedule="auto", sequence_parallel=key.sp, ep=key.ep,
        expert_tensor_parallel_size=key.expert_tp, recompute=key.recompute,
        recompute_num_layers=None, split_points=None, zero=0, distributed_optimizer=False)
    program = transform(meta_twin(tw.model), one_sample(example), config, loss_fn=loss_fn)
    found = _parts(program, len(set(tw.kinds)))
    tw.profiles[key] = found
    return found


def check_split(tw: Twin, example: Example, key: Key, base: EngineConfig,
                loss_fn=None) -> dict[str, tuple[int, int, int]]:
    """Raise what the passes raise for ``key`` under a zero-bubble schedule (the
    split_backward pass, which the pp = 1 profile does not run). Returns, per part, what
    one sample holds under that split (``split_held``: bytes from F until I, from I until
    W, and its nodes in the split graphs) in a chunk that receives: every chunk but the
    first, whose I is nearly empty (its parts hold their saved activations until W).
    Besides the parts, the pipeline boundary: ``RECEIVED`` (what a receiving chunk keeps of
    its input) and ``SENT_GRADIENT`` (the gradient of what a sending chunk sent, kept until
    W). Both come from the twin with each block twice (``deeper``) at pp = 2 under zbh1, cut
    after the first block (cached): a block's is the mean of its copies in the second
    chunk, whose modules outside the blocks are ``post``'s."""
    if key not in tw.split_checked:
        model = deeper(tw)
        blocks = module_blocks(model)
        config = base.replace(
            micro_batch_size=1, global_batch_size=key.ep, tp=key.tp, cp=key.cp, pp=2, vpp=1,
            dp=key.ep, schedule="zbh1", sequence_parallel=key.sp, ep=key.ep,
            expert_tensor_parallel_size=key.expert_tp, recompute=key.recompute,
            recompute_num_layers=None, split_points=blocks[1:2] or None, zero=0,
            distributed_optimizer=False)
        try:
            with warnings.catch_warnings():  # a refused split's backward trace warns from
                # torch's anomaly mode before the refusal is raised: the refusal says it
                warnings.filterwarnings("ignore", message="Error detected in")
                program = transform(model, one_sample(example), config, loss_fn=loss_fn)
            tw.split_checked[key] = _split_parts(program, tw)
        except FxmegError as e:
            tw.split_checked[key] = e
    if isinstance(tw.split_checked[key], Exception):
        raise tw.split_checked[key]
    return tw.split_checked[key]


def _split_parts(program, tw: Twin) -> dict[str, tuple[int, int, int]]:
    """``check_split``'s answer from the deeper twin's ``program``: its blocks' part names
    are their kinds' (each twin block is there twice), and ``RECEIVED`` and
    ``SENT_GRADIENT`` the pipeline boundary's (of the second chunk and the first); third,
    each part's nodes in the split graphs (``split_nodes``: a block's, one copy's)."""
    names, blocks = module_blocks(tw.model), list(program.partition.blocks)
    own = tw.own or tuple(range(len(names)))
    kind = {b: names[own[i // 2]] for i, b in enumerate(blocks)}

    def part(module: str, outside: str) -> str:
        block = _block(module, blocks)
        return kind[block] if block is not None else outside

    last = split_held(program.chunks[-1])
    copies = Counter(kind[b] for b in {_block(m, blocks) for m in last} if b is not None)
    held: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for module, kept in last.items():
        p = part(module, RECEIVED if module == RECEIVED else POST)
        held[p] = [a + b for a, b in zip(held[p], kept)]
    nodes: dict[str, int] = defaultdict(int)
    for c, gm in enumerate(program.chunks):
        for module, n in split_nodes(gm).items():
            nodes[part(module, PRE if c == 0 else POST)] += n
    found = {p: (a // copies.get(p, 1), b // copies.get(p, 1), 0) for p, (a, b) in held.items()}
    found[SENT_GRADIENT] = (*split_held(program.chunks[0]).get(SENT_GRADIENT, (0, 0)), 0)
    for p, n in nodes.items():  # each kind's block is there twice
        found[p] = (*found.get(p, (0, 0, 0))[:2], n // 2 if p in kind.values() else n)
    return found


def _parts(program, kinds: int) -> Profile:
    (gm,) = program.chunks
    blocks = list(program.partition.blocks)
    top = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    first = next((i for i, n in enumerate(top) if _block(owning_module(n), blocks)), len(top))
    side = {}
    for i, n in enumerate(top):
        mod = owning_module(n)
        if mod and not _block(mod, blocks):  # top-level code goes by its place
            side.setdefault(mod, PRE if i < first else POST)
    acc = {name: defaultdict(list) for name in (PRE, *blocks, POST)}
    boundary: dict[str, int] = {}

    def part_of(node: fx.Node, default: str) -> str:
        mod = owning_module(node)
        return _block(mod, blocks) or (side.get(mod, default) if mod else default)

    for i, node in enumerate(top):
        where = part_of(node, PRE if i < first else POST)
        region = node.op == "call_module" and hasattr(attr(gm, node.target), "region")
        for n, inner in _flat(gm, node):
            if n.op != "call_function" or is_hop(n):
                continue
            p = part_of(n, where)
            pair = (node_flops(n), node_bytes(n))
            acc[p]["ops"].append(pair)
            acc[p]["largest"].append(_out_bytes(n))
            acc[p]["working"].append(attention_working(n))
            acc[p]["cost"].append(node_cost(n))
            if region or inner:
                acc[p]["recomputed"].append(pair) if region else None
            comm = _comm(n)
            if comm:
                acc[p]["comms"].extend(comm)
        v = val(node)
        if isinstance(v, torch.Tensor) and node.users:
            boundary[where] = v.numel() * v.element_size()
    for s in saved_tensors(gm):
        mod = s.module
        acc[_block(mod, blocks) or side.get(mod, POST)]["saved"].append(s.nbytes)
    for node in top:
        if node.op == "call_module" and hasattr(attr(gm, node.target), "region"):
            p = part_of(node, POST)
            acc[p]["working"].append(region_bytes(gm, node))
    params = _params(program, gm, blocks, side)
    banks = frozenset(program.ep_specs) if program.ep_specs else _banks(program)
    parts = []
    for name in (PRE, *blocks, POST):
        a = acc[name]
        parts.append(Part(
            name=name,
            params={p: (b, e, p in banks) for p, (b, e) in params[name].items()},
            activations=sum(a["saved"]), recompute_working=max(a["working"], default=0),
            flops=sum(f for f, _ in a["ops"]), cost=sum(a["cost"]), ops=tuple(a["ops"]),
            recomputed=tuple(a["recomputed"]), comms=tuple(a["comms"]),
            boundary=boundary.get(name, 0), largest=max(a["largest"], default=0),
            working=max(a["working"], default=0)))
    itemsize = next((lay.dtype.itemsize for lays in program.buffers for lay in lays), 4)
    # one part per kind: the twin's first block of each
    return Profile(_key(program.config), parts[0], tuple(parts[1:1 + kinds]), parts[-1],
                   itemsize, program.flops_per_microbatch)


def _out_bytes(node: fx.Node) -> int:
    v = val(node)
    vs = v if isinstance(v, (tuple, list)) else (v,)
    return sum(t.numel() * t.element_size() for t in vs if isinstance(t, torch.Tensor))


def _key(config: EngineConfig) -> Key:
    par = config.parallel
    return Key(par.tp, par.sequence_parallel, par.cp, par.ep, par.expert_tensor_parallel_size,
               config.recomputation.recompute)


def _block(module: str, blocks: list[str]) -> str | None:
    for b in blocks:
        if module == b or module.startswith(b + "."):
            return b
    return None


def _flat(gm: fx.GraphModule, node: fx.Node):
    """(node, inside a sub-graph) for ``node`` and every node of its sub-graphs."""
    yield node, False
    if node.op == "call_module":
        sub = attr(gm, node.target)
        sub = getattr(sub, "region", sub)
        if isinstance(sub, fx.GraphModule):
            for m in sub.modules():
                if isinstance(m, fx.GraphModule):
                    for n in m.graph.nodes:
                        yield n, True


def _params(program, gm, blocks, side) -> dict[str, dict[str, tuple[int, int]]]:
    """Per part, the trainable parameters it reads: (local bytes, local elements). A
    block's are those under its name; one outside the blocks belongs to every side that
    reads it (a tied embedding: before and after)."""
    out: dict[str, dict[str, tuple[int, int]]] = {n: {} for n in (PRE, *blocks, POST)}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in program.parameters:
            continue
        v = val(node)
        if v is None:
            continue
        size = (v.numel() * v.element_size(), v.numel())
        block = _block(node.target, blocks)
        if block is not None:
            out[block][node.target] = size
            continue
        readers = {side.get(owning_module(u), POST) for u in node.users} or {POST}
        for p in readers:
            out[p][node.target] = size
    return out


def _banks(program) -> frozenset[str]:
    from fxmeg.diagnostics.expert_banks import expert_banks

    return expert_banks(program)


def _ring_comms(node: fx.Node) -> list[Comm]:
    """The ring (fxmeg/runtime/ring_attention.py): steps - 1 passes of this rank's k and v
    forward, each beside a block of attention; in backward the same, and k's and v's fp32
    gradients steps times."""
    k, v = val(node.args[1]), val(node.args[2])
    steps = node.args[7] // node.args[8]
    kv = k.numel() * k.element_size() + v.numel() * v.element_size()
    grads = 4 * (k.numel() + v.numel())
    work = node_flops(node)  # its forward blocks; backward's are twice as many
    return [Comm("cp", "all_gather", kv * steps, False, work),
            Comm("cp", "all_gather", (kv + grads) * steps, True, 2 * work)]


def _comm(node: fx.Node) -> list[Comm]:
    """The collectives ``node`` runs, forward and backward (``COLLECTIVES``)."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if node.target is ops.routed_experts:
        name = "routed_experts"
    kinds = COLLECTIVES.get(name)
    if not kinds:
        return []
    group = "ep" if name == "routed_experts" else ("cp" if name.startswith("cp_") else "tp")
    if name == "routed_experts":
        hidden, index = val(node.args[1]), val(node.args[2])
        nbytes = index.numel() * hidden.shape[-1] * hidden.element_size()
        fwd = [Comm(group, "all_to_all", nbytes, False)] * 2
        return fwd + [Comm(group, "all_to_all", nbytes, True)] * 2
    tensors = [val(a) for a in node.all_input_nodes] + [val(node)]
    tensors = [t for v in tensors for t in (v if isinstance(v, (tuple, list)) else (v,))
               if isinstance(t, torch.Tensor)]
    if name == "cp_ring_attention":
        return _ring_comms(node)
    if name == "cp_attention":  # k and v gathered whole; dk and dv reduce-scattered
        size = node.args[5] if len(node.args) > 5 else node.kwargs.get("size", 1)
        k, v = val(node.args[1]), val(node.args[2])
        nbytes = (k.numel() * k.element_size() + v.numel() * v.element_size()) * size
    else:
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
    return [Comm(group, kind, nbytes, backward) for kind, backward in zip(kinds, (False, True))
            if kind]
