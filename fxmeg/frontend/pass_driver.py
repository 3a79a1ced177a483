"""The pass driver: a model and one example micro-batch in, a ``Program`` out.

The pass list is data (``PASSES``), the one list of the passes in order: each entry names
its pass, the graph the pass takes (``Scope``) and the check of its Ensures
(fxmeg/passes/verify.py); fxmeg/passes/__init__.py and docs/architecture.md §1 list the same
passes in the same order (tests/frontend/test_pass_list.py holds them to it). ``transform``
captures the model, runs every pass in order, logs each one's time and node count, can
dump each pass's graph, and collects the result into the frozen, rank-free
``fxmeg.ir.program.Program`` (docs/architecture.md §1, §2).

A pass is ``pass(gm, *, <what it reads>) -> gm``: its parameters after the graph name
what the driver hands it (``inputs``): a section of the EngineConfig by its field name
(``parallel``, ``data_parallel``, ``moe``, ``recomputation``, ...: ``fxmeg.config.SECTIONS``),
``config`` for the whole EngineConfig (a pass that reads several sections and the
config's own fields), and for a per-chunk pass (scope CHUNK) ``chunk``: the driver calls
it once per chunk graph, with that chunk's ``fxmeg.ir.program.ChunkInfo`` (index, pipeline
rank). A check is called the same way. The driver refuses a
pass whose graph is not of its scope (listed on the wrong side of ``pipeline``) and a
pass that returns anything but a GraphModule.

Debugging switches, from the environment (``DriverOptions``, read once per ``transform``):

    FXMEG_DUMP_GRAPHS=DIR   write DIR/NN_<pass>.py, the code of the graph after each pass
    FXMEG_VERIFY=1          check each pass's Ensures after it runs (the tests set it)
    FXMEG_SKIP_PASSES=a,b   debugging: do not run passes a and b (logged as a warning; the
                            passes the Program is built from cannot be skipped)

The ``fxmeg.frontend.pass_driver`` logger reports each step at INFO; its records carry ``step``,
``seconds`` and ``nodes`` (bench/capture.py reads them).
"""

from __future__ import annotations

import copy
import enum
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmeg.config import SECTIONS, EngineConfig, Example, cast_inputs, example_tensors, make_config
from fxmeg.errors import ConfigError, PassError, closest
from fxmeg.frontend.capture import LossFn, capture, on_meta, retarget
from fxmeg.frontend.model_checks import check_model
from fxmeg.frontend.router_bias import keep_router_biases_fp32
from fxmeg.interop.hugging_face import warn_shifted_labels
from fxmeg.ir import ops
from fxmeg.ir.layouts import ExpertShard
from fxmeg.ir.ops import AUX_SCALE
from fxmeg.ir.program import (
    ChunkInfo,
    Program,
    buffer_layouts,
    chunk_infos,
    chunk_name,
    chunk_spec,
    chunks,
    load_marks,
)
from fxmeg.ir.tags import has_tag, set_tag, tag
from fxmeg.passes import verify
from fxmeg.passes.analyse import analyse
from fxmeg.passes.buckets import buckets
from fxmeg.passes.context_parallel import context_parallel
from fxmeg.passes.expert_parallel import expert_parallel
from fxmeg.passes.loss import loss
from fxmeg.passes.param_gather import param_gather
from fxmeg.passes.partition import partition
from fxmeg.passes.pipeline import pipeline
from fxmeg.passes.recompute import recompute
from fxmeg.passes.split_backward import running_on, split_backward
from fxmeg.passes.tensor_parallel import tensor_parallel

log = logging.getLogger("fxmeg.frontend.pass_driver")


class Scope(enum.Enum):
    """The graph a pass takes."""

    MODEL = "model"
    """The whole-model graph, before the pipeline pass (which takes it and returns the parent)."""
    CHUNK = "chunk"
    """One chunk graph and its ChunkInfo; the driver runs the pass on each chunk in turn."""
    PARENT = "parent"
    """The pipelined parent graph: a pass that needs every chunk at once."""


@dataclass(frozen=True)
class Pass:
    """One entry of the pass list."""

    name: str
    """The pass's function and file (fxmeg/passes/<name>.py) and its check (verify.<name>)."""
    run: Callable[..., fx.GraphModule]
    scope: Scope
    check: Callable[..., None]
    """Asserts what the pass ensures; called like ``run``, on its result (FXMEG_VERIFY=1)."""
    reference: bool = False
    """Keep a copy of the graph after this pass as ``Program.reference``: the whole model,
    loss rewritten, nothing parallel yet (what ``Engine.verify`` compares against)."""
    skippable: bool = True
    """False for the passes whose records the Program is built from (FXMEG_SKIP_PASSES)."""


MODEL, CHUNK, PARENT = Scope.MODEL, Scope.CHUNK, Scope.PARENT
PASSES: tuple[Pass, ...] = (
    # mean loss -> (loss_sum, num_tokens)
    Pass("loss", loss, MODEL, verify.loss, skippable=False),
    # whole-model FLOPs, input value checks and position tables
    Pass("analyse", analyse, MODEL, verify.analyse, reference=True, skippable=False),
    # sequences split over cp ranks (cp > 1)
    Pass("context_parallel", context_parallel, MODEL, verify.context_parallel),
    # shard tags and TP collectives (tp > 1)
    Pass("tensor_parallel", tensor_parallel, MODEL, verify.tensor_parallel),
    # chunk tag on every node, placement
    Pass("partition", partition, MODEL, verify.partition, skippable=False),
    # chunk graphs under a parent, recv / send / deallocate
    Pass("pipeline", pipeline, MODEL, verify.pipeline, skippable=False),
    # routed experts split over ep ranks, tokens exchanged all-to-all (ep > 1)
    Pass("expert_parallel", expert_parallel, CHUNK, verify.expert_parallel),
    # activation recompute regions
    Pass("recompute", recompute, CHUNK, verify.recompute),
    # gradient buffer layout and buckets: one slot per parameter per pipeline rank
    Pass("buckets", buckets, PARENT, verify.buckets),
    # parameter all-gather waits (overlap_param_gather)
    Pass("param_gather", param_gather, CHUNK, verify.param_gather),
    # zero bubble: forward, input- and weight-gradient graphs
    Pass("split_backward", split_backward, CHUNK, verify.split_backward),
)
NAMES = tuple(p.name for p in PASSES)
_BY_NAME = {p.name: p for p in PASSES}


def transform(
    model: nn.Module,
    example: Example,
    config: EngineConfig | None = None,
    *,
    loss_fn: LossFn | None = None,
    stop_after: str | None = None,
    device: torch.device | str | None = None,
    **options,
) -> Program | fx.GraphModule:
    """Capture ``model`` on ``example`` (one micro-batch) and run the passes for
    ``config`` (or one made from ``options``: ``tp=2, pp=2, ...``, as ``parallelize``
    takes them). Returns the Program, or with ``stop_after`` the graph right after that
    pass (for tests and notebooks).

    With precision bf16 / fp16 the model's parameters and floating buffers are cast in
    place before capture (as Megatron's Float16Module); their fp32 tensors are kept (not
    copied) in ``Program.master_values``, from which each rank reads the fp32 masters of
    exactly the elements it updates. The routers' expert biases the expert-parallel pass
    finds are fp32 again after the passes (fxmeg/frontend/router_bias.py), as Megatron's.

    A model built under ``with torch.device("meta"):`` is captured and transformed on
    shapes alone; the Program then holds meta tensors, and the runtime materialises each
    rank's part (``fxmeg.weights.meta_init``). Tensors its forward creates go to ``device``
    (default: the example's device, or the current accelerator when the example is on
    meta too, else the CPU). For a model with real tensors, ``device`` is theirs.
    """
    if config is None:
        config = make_config(example, world=None, **options)
    elif options:
        raise TypeError(f"pass either config or options, not both: {sorted(options)}")
    if stop_after is not None and stop_after not in NAMES:
        raise ValueError(f"stop_after={stop_after!r} is not one of {NAMES}")
    # what the model's config states, before a capture that may take minutes
    check_model(model, config)
    warn_shifted_labels(model, example, loss_fn=loss_fn)
    meta = on_meta(model)
    target = _device(model, example, device, meta)
    dtypes = {n: t.dtype for n, t in (*model.named_parameters(), *model.named_buffers())}
    buffers = dict(model.named_buffers(remove_duplicate=False))  # before the cast replaces them
    masters = _cast(model, config.dtype)
    example = cast_inputs(example, config.dtype)
    opts = DriverOptions.from_env()
    start = time.perf_counter()
    par = config.parallel
    # readable experts
    grouped = par.ep > 1 or par.cp > 1 or config.moe.moe_router_bias_update_rate > 0
    gm = capture(model, example, loss_fn=loss_fn, grouped_experts=grouped).gm
    _report("capture", gm, start, opts)
    reference = None
    with running_on(target):  # a meta model's split backward traced where it will run
        for index, p in enumerate(PASSES):
            if p.name not in opts.skip:
                gm = _run(p, gm, config, index, opts)
            if p.name == stop_after:
                return gm
            if p.reference:
                reference = _share_tensors_copy(gm)
    keep_router_biases_fp32(model, gm, reference, buffers)
    if meta:
        for graph in (gm, reference):
            retarget(graph, target)
    return _program(model, gm, config, masters, target, reference, dtypes)


def _device(model: nn.Module, example: Example, device, meta: bool) -> torch.device:
    """Where this rank computes: the model's device; for a model on meta, ``device``, the
    example's device, or the current accelerator (the CPU when there is none)."""
    example = example_tensors(example)
    if not meta:
        first = next(iter((*model.parameters(), *model.buffers())), None)
        found = first.device if first is not None else example[0].device
        if device is not None and torch.device(device) != found:
            raise ValueError(f"device={device!r} but the model's tensors are on {found}; move the "
                             "model, or build it on meta and let fxmeg materialise it there")
        return found
    if device is not None:
        return torch.device(device)
    if not example[0].is_meta:
        return example[0].device
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    return accelerator if accelerator is not None else torch.device("cpu")


@dataclass(frozen=True)
class DriverOptions:
    """The driver's debugging switches, read from the environment once per ``transform``
    (``from_env``: the one place fxmeg reads them; docs/python.md lists them)."""

    skip: frozenset[str] = frozenset()
    """FXMEG_SKIP_PASSES=a,b: passes not run (``skipped_passes``)."""
    verify: bool = False
    """FXMEG_VERIFY=1: check each pass's Ensures after it runs (the tests set it)."""
    dump_graphs: str | None = None
    """FXMEG_DUMP_GRAPHS=DIR: write DIR/NN_<pass>.py, the graph's code after each pass."""

    @classmethod
    def from_env(cls) -> DriverOptions:
        env = os.environ
        return cls(
            skip=skipped_passes(env.get("FXMEG_SKIP_PASSES", "")),
            verify=bool(env.get("FXMEG_VERIFY")),
            dump_graphs=env.get("FXMEG_DUMP_GRAPHS") or None,
        )


def skipped_passes(raw: str) -> frozenset[str]:
    """The passes ``raw``, FXMEG_SKIP_PASSES's value (comma-separated names), switches off,
    for debugging; each must be a pass of ``PASSES`` that the Program does not depend on."""
    names = [n.strip() for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in _BY_NAME:
            raise ConfigError(
                f"FXMEG_SKIP_PASSES={raw!r} names {name!r}, which is not a "
                f"pass{closest(name, NAMES)}; the passes are {', '.join(NAMES)}"
            )
        if not _BY_NAME[name].skippable:
            skippable = [p.name for p in PASSES if p.skippable]
            raise ConfigError(
                f"FXMEG_SKIP_PASSES={raw!r}: pass {name!r} cannot be skipped, the Program is built "
                f"from what it records; passes that can be: {', '.join(skippable)}"
            )
    if names:
        log.warning(
            "FXMEG_SKIP_PASSES: not running pass(es) %s; the Program differs from the one fxmeg "
            "builds (for debugging only)",
            ", ".join(names),
        )
    return frozenset(names)


def check_pass(name: str, gm: fx.GraphModule, config: EngineConfig) -> None:
    """Assert what pass ``name`` ensures on its result ``gm`` (the check runs on each chunk
    graph after a per-chunk pass)."""
    _check(_BY_NAME[name], gm, config)


def _check(p: Pass, gm: fx.GraphModule, config: EngineConfig) -> None:
    if p.scope is CHUNK:
        for info, chunk in zip(chunk_infos(gm), chunks(gm), strict=True):
            p.check(chunk, **inputs(p.check, config, info))
    else:
        p.check(gm, **inputs(p.check, config))


def _run(
    p: Pass, gm: fx.GraphModule, config: EngineConfig, index: int, opts: DriverOptions
) -> fx.GraphModule:
    """Pass ``p`` on ``gm`` at its scope, its new nodes tagged, reported and (FXMEG_VERIFY) checked.
    """
    pipelined = bool(chunks(gm))
    assert pipelined == (p.scope is not MODEL), (
        f"pass {p.name!r} takes the {p.scope.value} graph, but it got a graph that is "
        f"{'' if pipelined else 'not '}split into chunks: is it listed on the wrong side of "
        "'pipeline' in PASSES?"
    )
    start = time.perf_counter()
    before = {n.name for n in _nodes(gm)}
    if p.scope is CHUNK:
        for info, chunk in zip(chunk_infos(gm), chunks(gm), strict=True):
            out = _returned(
                p, p.run(chunk, **inputs(p.run, config, info)), f" for chunk {info.index}"
            )
            if out is not chunk:  # a new graph takes the chunk's place under the parent
                assert tag(out, "spec") == chunk_spec(chunk), (
                    f"pass {p.name!r} returned a new graph for chunk {info.index} without its "
                    "ChunkSpec"
                )
                setattr(gm, chunk_name(info.index), out)
    else:
        gm = _returned(p, p.run(gm, **inputs(p.run, config)), "")
    _tag_new_nodes(gm, before, p.name)
    _report(p.name, gm, start, opts, index)
    if opts.verify:
        _check(p, gm, config)
    return gm


def inputs(fn: Callable, config: EngineConfig, chunk: ChunkInfo | None = None) -> dict:
    """What pass (or check) ``fn`` reads, by the names of its parameters after the graph:
    a section of ``config`` (``fxmeg.config.SECTIONS``), ``config`` whole, or ``chunk``."""
    given = {"config": config, "chunk": chunk, **{name: getattr(config, name) for name in SECTIONS}}
    wanted = [q.name for q in list(inspect.signature(fn).parameters.values())[1:]
              if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    unknown = [name for name in wanted if name not in given]
    assert not unknown, f"{fn.__qualname__} takes {unknown}: a pass reads only {sorted(given)}"
    return {name: given[name] for name in wanted}


def _returned(p: Pass, out, where: str) -> fx.GraphModule:
    if not isinstance(out, fx.GraphModule):
        raise TypeError(
            f"pass {p.name!r} returned {type(out).__name__}{where}, not an fx.GraphModule "
            "(a pass returns the graph it was given, or a new one)"
        )
    return out


def _nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The top-level nodes of the whole-model graph, or (after the pipeline pass) of
    every chunk graph: what ``_tag_new_nodes`` diffs by name (chunk graphs keep the
    names of the nodes they were copied from)."""
    return [n for g in chunks(gm) or [gm] for n in g.graph.nodes]


def _tag_new_nodes(gm: fx.GraphModule, before: set[str], name: str) -> None:
    """``node.meta["fxmeg"]["pass"] = name`` on every node pass ``name`` inserted (a node
    name that was not there before it ran); nodes from capture carry no ``pass``. A new
    dict: passes copy each other's metadata dicts, so no other node changes."""
    for n in _nodes(gm):
        if n.name not in before:
            set_tag(n, "pass", name)


def _share_tensors_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (graph and sub-graphs) holding the same parameter and buffer
    tensors, so later passes, which edit graphs in place, leave it as it is."""
    memo = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    return copy.deepcopy(gm, memo)


def _cast(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast the model in place to ``dtype``; the parameters' fp32 values from before it:
    the user's own fp32 tensors, kept (not copied) while the parameters move to new
    half-precision storage, so fxmeg allocates no fp32 copy of any parameter."""
    if dtype == torch.float32:
        return {}
    masters = {n: p.detach() for n, p in model.named_parameters()}
    model.to(dtype)  # parameters and floating buffers, in place: `p.data` becomes a new tensor
    return masters


def _program(model: nn.Module, parent: fx.GraphModule, config: EngineConfig, masters: dict,
             device: torch.device, reference: fx.GraphModule | None, dtypes: dict) -> Program:
    info, facts, split = tag(parent, "capture"), tag(parent, "facts"), tag(parent, "partition")
    graphs = tuple(chunks(parent))
    holders: dict[str, set[int]] = {}
    parameters: dict[str, nn.Parameter] = {}
    tp_specs: dict[str, tuple] = {}
    ep_specs: dict[str, ExpertShard] = {}
    for c, gm in enumerate(graphs):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                holders.setdefault(name, set()).add(split.placement[c])
                parameters.setdefault(name, p)
        for node in gm.graph.nodes:
            if node.op == "get_attr" and has_tag(node, "tp"):
                tp_specs[node.target] = tag(node, "tp")
            if node.op == "get_attr" and has_tag(node, "ep"):
                ep_specs[node.target] = tag(node, "ep")
    _check_experts(config, graphs, ep_specs)
    state = model.state_dict(keep_vars=True)
    canonical = {alias: name for name, names in info.aliases.items() for alias in names}
    aux = next(((c, AUX_SCALE) for c, gm in enumerate(graphs) if hasattr(gm, AUX_SCALE)), None)
    return Program(
        config=config,
        graph=parent,
        chunks=graphs,
        specs=tuple(chunk_spec(gm) for gm in graphs),
        buffers=tuple(buffer_layouts(gm) for gm in graphs),
        placement=split.placement,
        partition=split,
        tp_specs=tp_specs,
        ep_specs=ep_specs,
        holders={n: tuple(sorted(r)) for n, r in holders.items()},
        parameters=parameters,
        master_values={n: masters[n] for n in parameters if n in masters},
        untrained={k: t.detach() for k, t in state.items() if canonical.get(k, k) not in holders},
        aliases=info.aliases,
        full_shapes={k: (t.shape, t.dtype) for k, t in state.items()},
        inputs=info.inputs,
        keywords=info.keywords,
        cp_layout=tag(parent, "cp"),
        tp_whole=tag(parent, "tp_whole", ()),
        value_checks=facts.value_checks,
        position_tables=facts.position_tables,
        flops_per_microbatch=facts.flops_per_microbatch,
        aux_scale=aux,
        device=device,
        reference=reference,
        init_dtypes=dtypes,
        unread=tuple(
            n for n, p in model.named_parameters() if p.requires_grad and n not in holders
        ),
    )



def _check_experts(
    config: EngineConfig, graphs: tuple[fx.GraphModule, ...], ep_specs: dict
) -> None:
    """The mixture-of-experts options found what they act on in the whole model (each
    chunk's pass saw only its chunk): routed experts for ep and loss-free balancing, a
    router loss for global_aux_loss. Refused by name otherwise."""
    if config.moe.moe_router_load_balancing_type == "global_aux_loss" and not any(
            n.target is ops.global_tokens for gm in graphs for n in gm.graph.nodes):
        raise PassError(
            "moe_router_load_balancing_type='global_aux_loss', but this model computes no router "
            "loss (a Hugging Face mixture of experts computes it with output_router_logits=True in "
            "its config); set that, or leave moe_router_load_balancing_type='aux_loss'"
        )
    if config.parallel.ep > 1 and not ep_specs:
        raise PassError(
            f"ep={config.parallel.ep}, but fxmeg finds no routed experts in this model: expert "
            "parallelism splits the 3-D expert banks of Hugging Face grouped-experts blocks "
            "(fxmeg/passes/expert_parallel.py); train a dense model with ep=1"
        )
    rate = config.moe.moe_router_bias_update_rate
    if rate > 0 and not any(load_marks(gm) for gm in graphs):
        raise PassError(
            f"moe_router_bias_update_rate={rate}, but fxmeg finds no routed experts in this model: "
            "loss-free balancing updates the expert bias of the routers of Hugging Face "
            "grouped-experts blocks (fxmeg/passes/expert_parallel.py); train this model with "
            "moe_router_bias_update_rate=0"
        )


def _report(
    name: str, gm: fx.GraphModule, start: float, opts: DriverOptions, index: int = -1
) -> None:
    graphs = [(n, m) for n, m in gm.named_modules() if isinstance(m, fx.GraphModule)]
    nodes = sum(len(g.graph.nodes) for _, g in graphs)
    seconds = time.perf_counter() - start
    record = {"step": name, "seconds": seconds, "nodes": nodes}
    log.info("%-16s %7.3f s  %6d nodes", name, seconds, nodes, extra=record)
    out = opts.dump_graphs
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{index + 1:02d}_{name}.py"), "w") as f:
            for module, g in graphs:
                f.write(f"# ---- {module or 'graph'}\n{g.code.strip()}\n\n")
