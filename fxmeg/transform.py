"""The pass driver: a model and one example micro-batch in, a ``Program`` out.

The pass list is data (``PASSES``); ``transform`` captures the model, runs every pass in
order, logs each one's time and node count, can dump each pass's graph, and collects the
result into the frozen, rank-free ``fxmeg.program.Program`` (docs/design.md §1, §2).
Every pass has one shape, ``(gm, config) -> gm``; passes after ``pipeline`` receive the
parent graph and iterate its chunks themselves.

    FXMEG_DUMP_GRAPHS=DIR   write DIR/NN_<pass>.py, the code of the graph after each pass
    FXMEG_VERIFY=1          check each pass's Ensures after it runs (fxmeg.passes.verify;
                            the tests set it)

The ``fxmeg.transform`` logger reports each step at INFO; its records carry ``step``,
``seconds`` and ``nodes`` (bench/capture.py reads them).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxmeg.capture import LossFn, capture, on_meta, retarget
from fxmeg.config import EngineConfig, Example, cast_inputs, example_tensors, make_config
from fxmeg.passes import verify
from fxmeg.passes.analyse import analyse
from fxmeg.passes.buckets import buckets
from fxmeg.passes.context_parallel import context_parallel
from fxmeg.passes.loss import loss
from fxmeg.passes.param_gather import param_gather
from fxmeg.passes.partition import partition
from fxmeg.passes.pipeline import pipeline
from fxmeg.passes.recompute import recompute
from fxmeg.passes.split_backward import split_backward
from fxmeg.passes.tensor_parallel import tensor_parallel
from fxmeg.program import Program, buffer_layouts, chunk_spec, chunks
from fxmeg.ops import AUX_SCALE

log = logging.getLogger("fxmeg.transform")


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, EngineConfig], fx.GraphModule]
    reference: bool = False
    """Keep a copy of the graph after this pass as ``Program.reference``: the whole model,
    loss rewritten, nothing parallel yet (what ``Engine.verify`` compares against)."""


PASSES: tuple[Pass, ...] = (
    Pass("loss", loss),  # mean loss -> (loss_sum, num_tokens)
    Pass("analyse", analyse, reference=True),  # whole-model FLOPs and input value checks
    Pass("context_parallel", context_parallel),  # sequences split over cp ranks (cp > 1)
    Pass("tensor_parallel", tensor_parallel),  # shard tags and TP collectives (tp > 1)
    Pass("partition", partition),  # chunk tag on every node
    Pass("pipeline", pipeline),  # chunk graphs under a parent, recv / send / deallocate
    Pass("recompute", recompute),  # activation recompute regions per chunk
    Pass("buckets", buckets),  # gradient buffer layout and buckets per chunk
    Pass("param_gather", param_gather),  # parameter all-gather waits (overlap_param_gather)
    Pass("split_backward", split_backward),  # zero bubble: forward, input- and weight-gradient graphs
)
NAMES = tuple(p.name for p in PASSES)


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
    exactly the elements it updates.

    A model built under ``with torch.device("meta"):`` is captured and transformed on
    shapes alone; the Program then holds meta tensors, and the runtime materialises each
    rank's part (``fxmeg.materialize``). Tensors its forward creates go to ``device``
    (default: the example's device, or the current accelerator when the example is on
    meta too, else the CPU). For a model with real tensors, ``device`` is theirs.
    """
    if config is None:
        config = make_config(example, world=None, **options)
    elif options:
        raise TypeError(f"pass either config or options, not both: {sorted(options)}")
    if stop_after is not None and stop_after not in NAMES:
        raise ValueError(f"stop_after={stop_after!r} is not one of {NAMES}")
    meta = on_meta(model)
    target = _device(model, example, device, meta)
    dtypes = {n: t.dtype for n, t in (*model.named_parameters(), *model.named_buffers())}
    masters = _cast(model, config.dtype)
    example = cast_inputs(example, config.dtype)
    start = time.perf_counter()
    gm = capture(model, example, loss_fn=loss_fn).gm
    _report("capture", gm, start)
    reference = None
    for index, p in enumerate(PASSES):
        start = time.perf_counter()
        before = {n.name for n in _nodes(gm)}
        gm = p.run(gm, config)
        _tag_new_nodes(gm, before, p.name)
        _report(p.name, gm, start, index)
        if os.environ.get("FXMEG_VERIFY"):
            verify.after(p.name, gm, config)
        if p.name == stop_after:
            return gm
        if p.reference:
            reference = _share_tensors_copy(gm)
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
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator if accelerator is not None else torch.device("cpu")


def _nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The top-level nodes of the whole-model graph, or (after the pipeline pass) of
    every chunk graph: what ``_tag_new_nodes`` diffs by name (chunk graphs keep the
    names of the nodes they were copied from)."""
    graphs = [m for name, m in gm.named_children() if name.startswith("chunk_")] or [gm]
    return [n for g in graphs for n in g.graph.nodes]


def _tag_new_nodes(gm: fx.GraphModule, before: set[str], name: str) -> None:
    """``node.meta["fxmeg"]["pass"] = name`` on every node pass ``name`` inserted (a node
    name that was not there before it ran); nodes from capture carry no ``pass``. A new
    dict: passes copy each other's metadata dicts, so no other node changes."""
    for n in _nodes(gm):
        if n.name not in before:
            n.meta["fxmeg"] = {**n.meta.get("fxmeg", {}), "pass": name}


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
    meta = parent.meta["fxmeg"]
    info, facts, split = meta["capture"], meta["facts"], meta["partition"]
    graphs = tuple(chunks(parent))
    holders: dict[str, set[int]] = {}
    parameters: dict[str, nn.Parameter] = {}
    tp_specs: dict[str, tuple] = {}
    for c, gm in enumerate(graphs):
        for name, p in gm.named_parameters():
            if p.requires_grad:
                holders.setdefault(name, set()).add(split.placement[c])
                parameters.setdefault(name, p)
        for node in gm.graph.nodes:
            if node.op == "get_attr" and "tp" in node.meta.get("fxmeg", {}):
                tp_specs[node.target] = node.meta["fxmeg"]["tp"]
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
        holders={n: tuple(sorted(r)) for n, r in holders.items()},
        parameters=parameters,
        master_values={n: masters[n] for n in parameters if n in masters},
        untrained={k: t.detach() for k, t in state.items() if canonical.get(k, k) not in holders},
        aliases=info.aliases,
        full_shapes={k: (t.shape, t.dtype) for k, t in state.items()},
        inputs=info.inputs,
        keywords=info.keywords,
        cp_layout=meta.get("cp"),
        value_checks=facts.value_checks,
        position_tables=facts.position_tables,
        flops_per_microbatch=facts.flops_per_microbatch,
        aux_scale=aux,
        device=device,
        reference=reference,
        init_dtypes=dtypes,
    )


def _report(name: str, gm: fx.GraphModule, start: float, index: int = -1) -> None:
    graphs = [(n, m) for n, m in gm.named_modules() if isinstance(m, fx.GraphModule)]
    nodes = sum(len(g.graph.nodes) for _, g in graphs)
    seconds = time.perf_counter() - start
    record = {"step": name, "seconds": seconds, "nodes": nodes}
    log.info("%-16s %7.3f s  %6d nodes", name, seconds, nodes, extra=record)
    out = os.environ.get("FXMEG_DUMP_GRAPHS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{index + 1:02d}_{name}.py"), "w") as f:
            for module, g in graphs:
                f.write(f"# ---- {module or 'graph'}\n{g.code.strip()}\n\n")
