"""Backward split into input-gradient and weight-gradient work (zero-bubble schedules).

Zero-bubble schedules (Qi et al., ICLR 2024) run each chunk's backward in two parts: I,
the gradient of the chunk's received inputs (on the pipeline's critical path, sent
upstream at once), and W, the gradients of its weights (deferrable, filling the bubble).
This pass derives both, statically, from the chunk's joint forward/backward graph:

1. AOT autograd traces the chunk as ``f(*params, *buffers, *data, *recv)`` into one
   joint graph (forward and backward ATen ops, primals and tangents as inputs);
2. its partitioner cuts it into a forward graph, returning the chunk's outputs and the
   tensors backward needs, and a backward graph;
3. the backward graph is split by what each output needs: the input gradients' ancestors
   form the I graph, the weight gradients' remaining ancestors the W graph. The values
   W reads from the I part (and the saved tensors and tangents only W reads) are extra
   outputs of I, so after I a micro-batch keeps only what W needs.

A routed-experts block (ep; run-time row counts) is traced as an opaque op and runs eagerly,
I and W replaying its forward's autograd graph (``fxmeg.ir.moe_split``), its result saved.
A recompute region (``Recompute`` submodules of the recompute pass) is inlined with its
nodes tagged MUST_RECOMPUTE, and the min-cut partitioner recomputes them in backward
instead of saving their outputs: the same memory semantics as checkpointing.

Scope: one chunk graph (the driver runs it on each).
Requires: pipeline (a chunk graph with a ChunkSpec); recompute, buckets, param_gather may
have run. Ensures: when the schedule runs I / W actions (``parallel.splits_backward``),
the chunk graph has three parameter-free submodules ``zb_forward``, ``zb_input``,
``zb_weight`` and ``gm.meta["fxmeg"]["split"]``, a ``fxmeg.ir.program.SplitSpec`` (their
calling conventions); ``zb_input`` then ``zb_weight`` compute exactly the gradients the
chunk's autograd backward does. Otherwise the graphs are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import operator

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fxmeg.config import ParallelConfig
from fxmeg.errors import PassError
from fxmeg.frontend.capture import owning_module, retarget
from fxmeg.ir import ops
from fxmeg.ir.program import ChunkInfo, SplitSpec, chunk_spec
from fxmeg.ir.tags import set_tag
from fxmeg.passes.graph_utils import val
from fxmeg.passes.recompute import Recompute
from fxmeg.torch_private import (
    FakeTensorMode,
    aot_export_joint_simple,
    default_partition,
    detect_fake_mode,
    min_cut_rematerialization_partition,
    reparametrize_module,
)


def split_backward(
    gm: fx.GraphModule, *, parallel: ParallelConfig, chunk: ChunkInfo
) -> fx.GraphModule:
    """Split the chunk graph ``gm``'s backward (see the module docstring); ``chunk``
    names it in the error."""
    if not parallel.splits_backward:
        return gm
    try:
        _split_chunk(gm)
    except PassError:
        raise
    except Exception as exc:  # AOT autograd raises many types; all mean "cannot split"
        raise PassError(
            f"cannot split chunk {chunk.index}'s backward into input- and weight-gradient graphs "
            f"for schedule {parallel.schedule!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}. Use schedule='1f1b' or 'interleaved'."
        ) from exc
    return gm


def _split_chunk(gm: fx.GraphModule) -> None:
    spec = chunk_spec(gm)
    rng = [n.name for m in gm.modules() if isinstance(m, fx.GraphModule)
           for n in m.graph.nodes if n.target in ops.RNG_MARKERS]
    if rng:
        raise PassError(
            f"node {rng[0]!r} draws random numbers per tensor-parallel rank (dropout under tp), "
                        "which the split graphs cannot keep")
    params = [n for n, _ in gm.named_parameters()]
    buffers = [n for n, _ in gm.named_buffers()]
    flat, recompute = _inline_regions(gm)
    _name_makers(flat)
    experts = _opaque_experts(flat)
    _own_outputs(flat)
    placeholders = [n for n in flat.graph.nodes if n.op == "placeholder"]
    num_data = len(spec.data_inputs)
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    names = params + buffers

    def chunk_fn(*args):  # an Interpreter, so each traced op inherits its node's recompute tag
        state = dict(zip(names, args[: len(names)]))
        run = lambda *inputs: fx.Interpreter(flat).run(*inputs)  # noqa: E731
        with reparametrize_module(flat, state):
            return tuple(run(*args[len(names):]))

    local = {n.target: val(n) for n in gm.graph.nodes if n.op == "get_attr" and val(n) is not None}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # parameters in their local (tensor-parallel shard) shapes
        args = [_fake(local.get(n, tensors[n]),
                      tensors[n].requires_grad and n in params) for n in names]
        args += [_fake(val(p), i >= num_data and spec.recv[i - num_data].grad) for i,
                 p in enumerate(placeholders)]
    with fx.traceback.preserve_node_meta():
        joint = aot_export_joint_simple(chunk_fn, args, trace_joint=True)
    outputs = len(spec.send) + (2 if spec.is_last else 0)
    partition = min_cut_rematerialization_partition if recompute else default_partition
    kwargs = {"compiler": "aot_eager"} if recompute else {}
    with mode:  # the min-cut partitioner makes fake RNG states for recomputed random ops
        forward, backward = partition(joint, args, num_fwd_outputs=outputs, **kwargs)
    grads = backward.graph.output_node().args[0]
    recv_at = len(names) + num_data
    input_grads = [i for i in range(recv_at, len(args)) if spec.recv[i - recv_at].grad]
    weight_grads = [i for i, n in enumerate(params) if tensors[n].requires_grad]
    inputs_graph, weights_graph, carry = _split(backward, [grads[i] for i in input_grads],
                                               [grads[i] for i in weight_grads])
    _runnable_experts(forward, inputs_graph, weights_graph, experts)
    saved = len(forward.graph.output_node().args[0]) - outputs
    tangents = [n.name for n in backward.graph.nodes if n.op == "placeholder"][saved:]
    tangent_of = tuple(i for i, b in enumerate(spec.send) if b.grad) + ((len(spec.send),
                                                                         ) if spec.is_last else ())
    if len(tangent_of) != len(tangents):
        raise PassError(
            f"the joint graph has {len(tangents)} tangents for {len(tangent_of)} outputs with a "
            "gradient")
    gm.add_submodule("zb_forward", forward)
    gm.add_submodule("zb_input", inputs_graph)
    gm.add_submodule("zb_weight", weights_graph)
    set_tag(gm, "split", SplitSpec(
        state=tuple(names), saved=saved, tangents=len(tangents), outputs=outputs,
        weights=tuple(params[i] for i in weight_grads), carry=carry,
        tangent_of=tangent_of,
    ))


_EXPERT_TENSORS = ("hidden", "top_k_index", "top_k_weights", "w_up", "w_down", "b_up", "b_down")
"""``ops.routed_experts``' tensor arguments, in ``moe_split.traced_forward``'s order."""


def _opaque_experts(flat: fx.GraphModule) -> list[tuple[str, fx.GraphModule, dict]]:
    """Replace each routed-experts node of ``flat`` by ``moe_split``'s traced stand-in, its
    result saved (a recompute region's tag overridden: inside one, the block itself keeps
    only its inputs and runs again in I, ``again``); returns each block's (middle's name,
    middle, options), by the stand-in's ``block`` index."""
    blocks = []
    for node in list(flat.graph.nodes):
        if node.op != "call_function" or node.target is not ops.routed_experts:
            continue
        given = inspect.signature(ops.routed_experts).bind(*node.args, **node.kwargs).arguments
        middle = given.pop("middle")
        if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
            given["again"] = True  # kept as its inputs, run again in I (moe_split)
        tensors = [given.pop(name, None) for name in _EXPERT_TENSORS]
        with flat.graph.inserting_before(node):
            both = flat.graph.call_function(torch.ops.fxmeg.split_experts.default,
                                            (*tensors, len(blocks)))
            out = flat.graph.call_function(operator.getitem, (both, 0))
        for n in (both, out):
            n.meta = {**node.meta, "recompute": CheckpointPolicy.MUST_SAVE}
        both.meta.pop("val", None)
        node.replace_all_uses_with(out)
        flat.graph.erase_node(node)
        blocks.append((middle.target, flat.get_submodule(middle.target), given))
        if not middle.users:
            flat.graph.erase_node(middle)
    flat.recompile()
    return blocks


def _runnable_experts(forward: fx.GraphModule, inputs: fx.GraphModule, weights: fx.GraphModule,
                      blocks: list[tuple[str, fx.GraphModule, dict]]) -> None:
    """Point the traced stand-ins of ``_opaque_experts`` at the ops that run them: the
    forward graph's at ``ops.routed_experts_split`` (with the block's middle as a submodule
    and its options), I's at ``ops.experts_input_grad``, W's at ``ops.experts_weight_grad``."""
    traced = torch.ops.fxmeg
    for node in list(forward.graph.nodes):
        if node.target is traced.split_experts.default:
            *tensors, block = node.args
            name, middle, options = blocks[block]
            forward.add_submodule(name, middle)
            with forward.graph.inserting_before(node):
                body = forward.graph.get_attr(name)
            node.target, node.args = ops.routed_experts_split, (body, *tensors)
            node.kwargs = options
    # a chunk without input gradients (the first) has its blocks' I in the W graph
    for node in [*inputs.graph.nodes, *weights.graph.nodes]:
        if node.target is traced.split_experts_input.default:
            grad, state, *_, hidden, weights_, banks = node.args
            node.target, node.args = ops.experts_input_grad, (grad, state)
            node.kwargs = {"hidden": hidden, "weights": weights_, "banks": banks}
        elif node.target is traced.split_experts_weight.default:
            node.target, node.args = ops.experts_weight_grad, node.args[:2]
    for g in (forward, inputs, weights):
        g.graph.lint()
        g.recompile()


SPLIT_GRAPHS = ("zb_forward", "zb_input", "zb_weight")
"""The submodules a split chunk graph carries (the chunk's own graph stays its forward)."""

RUN_DEVICE = contextvars.ContextVar("fxmeg_split_device", default=torch.device("cpu"))
"""Where a meta model's program will compute (``transform`` sets it: ``running_on``): the
kernels the trace picks follow the fakes' device (SDPA's backward among them), and a run on
CPU must get the CPU ones. A program transformed only to be planned (``fxmeg.plan``, the
layout search) is split on CPU fakes too: on meta fakes the loss's backward is lost (nll_loss
has no autograd kernel for meta), and the last chunk's split saved and carried nothing."""


@contextlib.contextmanager
def running_on(device: torch.device):
    """Transform a meta model whose program will compute on ``device``: its chunks are
    split on fakes of ``device``, and the tensors its graph makes (``device=meta``
    arguments, ``retarget``) are made there too."""
    token = RUN_DEVICE.set(torch.device(device))
    try:
        yield
    finally:
        RUN_DEVICE.reset(token)


def fake_device() -> torch.device:
    """The device a meta model's chunk is split on (``RUN_DEVICE``)."""
    return RUN_DEVICE.get()


def _fake(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    mode = detect_fake_mode()
    device = fake_device() if t.is_meta else t.device
    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
    return mode.from_tensor(empty).requires_grad_(requires_grad and empty.is_floating_point())


def _inline_regions(gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """A copy of ``gm`` with every ``Recompute`` region's nodes inlined, tagged
    MUST_RECOMPUTE (one ``ac_graph_id`` per region; ``_made_where_split``), and whether
    there were any."""
    regions = {
        n
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Recompute)
    }
    if not regions:
        return _made_where_split(gm, fx.GraphModule(gm, copy.deepcopy(gm.graph))), False
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node not in regions:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        region_id = len(env)  # the same on every rank (a string's hash is not)
        body = gm.get_submodule(node.target).region
        inner: dict[fx.Node, fx.Node] = {}
        args = iter(node.args)
        for n in body.graph.nodes:
            if n.op == "placeholder":
                inner[n] = env[next(args)]
            elif n.op == "output":
                env[node] = _output_value(graph, n.args[0], inner)
            else:
                inner[n] = graph.node_copy(n, lambda a: inner[a])
                inner[n].meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                inner[n].meta["ac_graph_id"] = region_id
    return _made_where_split(gm, fx.GraphModule(gm, graph)), True


def _made_where_split(gm: fx.GraphModule, flat: fx.GraphModule) -> fx.GraphModule:
    """``flat`` with a meta capture's own tensors (``arange(device=meta)``) made on the
    device the split's fakes are on (``fake_device``) when it is not meta."""
    if any(t.is_meta for t in gm.parameters()) and fake_device().type != "meta":
        retarget(flat, fake_device())
    return flat


def _name_makers(flat: fx.GraphModule) -> None:
    """Give every node its fxmeg module (``owning_module``, the passes' own nodes too: a
    sequence-parallel gather is the module it works for) as its ``nn_module_stack``, which
    the traced graphs keep: what a split chunk holds is then told by the model's own module
    names (``fxmeg.diagnostics.split_activations``). Export's stacks run through the module
    it captured, a Hugging Face model's wrapper (``model.model.layers.0`` for Mixtral's
    ``model.layers.0``), which no block name matches."""
    for node in flat.graph.nodes:
        module = owning_module(node)
        if node.op == "call_function" and module:
            node.meta["nn_module_stack"] = {module: (module, "")}


def _own_outputs(gm: fx.GraphModule) -> None:
    """Clone each output that is a view of an input or a buffer (a rotary table sliced and
    sent on, a relayed value), a view of an intermediate, or a linear map of a 3-D tensor
    (a block ending in a bare ``nn.Linear``): AOT autograd's joint export needs outputs that
    own their storage. Only such values are copied (a block ending in a residual add is not)."""
    output = gm.graph.output_node()
    for value in output.args[0]:
        source, viewed = value, False
        while source.op == "call_function" and (
            source.target in (ops.send, ops.recv) or _is_view(source)
        ):
            viewed |= _is_view(source)
            source = source.args[0]
        if source.op in ("placeholder", "get_attr") or viewed or _folds_back(source):
            with gm.graph.inserting_before(output):
                clone = gm.graph.call_function(torch.ops.aten.clone.default, (value,))
            clone.meta = dict(value.meta)
            output.replace_input_with(value, clone)
    gm.recompile()


def _is_view(node: fx.Node) -> bool:
    """A view of another value (a linear map's output reshaped back to 3-D is a view of the
    2-D product), which AOT autograd exports as an alias it refuses."""
    return node.op == "call_function" and getattr(node.target, "is_view", False)


def _folds_back(node: fx.Node) -> bool:
    """A linear map or matmul of a tensor of 3 or more dimensions: AOT autograd computes it
    as a 2-D product viewed back to the input's rank, an alias it refuses as an output."""
    if node.op != "call_function" or node.target not in (torch.ops.aten.linear.default,
                                                          torch.ops.aten.matmul.default):
        return False
    first = val(node.args[0])
    return first is not None and first.dim() >= 3


def _output_value(graph: fx.Graph, out, inner: dict) -> fx.Node:
    """A region returns a node or a tuple of them; the caller indexes a tuple with getitem."""
    if isinstance(out, fx.Node):
        return inner[out]
    return graph.call_function(tuple, (tuple(inner[o] for o in out),))


def _split(backward: fx.GraphModule, input_grads: list, weight_grads: list):
    """Split ``backward`` into the I graph computing ``input_grads`` (plus the values the
    W graph reads from it, returned after them) and the W graph computing
    ``weight_grads`` from those values. Returns (I graph, W graph, number of carried values)."""
    need_i = _ancestors([g for g in input_grads if isinstance(g, fx.Node)])
    need_w = _ancestors([g for g in weight_grads if isinstance(g, fx.Node)])
    only_w = [
        n for n in backward.graph.nodes if n in need_w and n not in need_i and n.op != "placeholder"
    ]
    # what W reads of I's values, and the weight gradients I computes anyway (a fused
    # backward's (dx, dw) pair that an input gradient reads through)
    done = {g for g in weight_grads if isinstance(g, fx.Node) and g not in only_w}
    carried = [n for n in backward.graph.nodes
               if (n in need_i or n.op == "placeholder")
               and (n in done or any(u in only_w for u in n.users))]
    i_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in backward.graph.nodes:
        if n.op == "placeholder":
            env[n] = i_graph.node_copy(n)
        elif n in need_i and n.op != "output":
            env[n] = i_graph.node_copy(n, lambda a: env[a])
    i_graph.output(tuple(_zero_or(env, g) for g in input_grads) + tuple(env[n] for n in carried))
    w_graph = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for n in carried:
        wenv[n] = w_graph.placeholder(n.name)
        wenv[n].meta = dict(n.meta)
    for n in only_w:
        wenv[n] = w_graph.node_copy(n, lambda a: wenv[a])
    w_graph.output(tuple(wenv[g] if isinstance(g, fx.Node) else None for g in weight_grads))
    i_module, w_module = fx.GraphModule(backward, i_graph), fx.GraphModule(backward, w_graph)
    for g in (i_module, w_module):
        g.graph.eliminate_dead_code()
        g.graph.lint()
        g.recompile()
    return i_module, w_module, len(carried)


def _zero_or(env: dict, g):
    return env[g] if isinstance(g, fx.Node) else None


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen
