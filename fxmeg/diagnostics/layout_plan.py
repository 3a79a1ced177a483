"""Plan a layout before running it: per pipeline stage, the memory one rank holds, its
forward FLOPs and the schedule's bubble, from the Program alone (docs/megatron-semantics.md
§2.8). No process group, no rank, no real tensor: ``plan(model, example, tp=8, pp=8)``
transforms a copy of the model on the meta device, so a 70B model plans in seconds.

What each column counts (parameters, gradient buffers, optimizer state, zero >= 2,
activations, FLOPs, bubble, experts): docs/architecture.md §8.3; against Megatron's formula:
docs/megatron-semantics.md §2.8.1.

``memory_report(program, ctx)``, the trainer's first-log report, is this plan's stages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fxmeg.config import EngineConfig, Example, batch_dim
from fxmeg.diagnostics.devices import GiB
from fxmeg.diagnostics.expert_banks import expert_banks
from fxmeg.diagnostics.saved_activations import (
    activation_bytes,
    attention_working_bytes,
    breakdown,
    by_block,
    recompute_working_bytes,
)
from fxmeg.diagnostics.split_activations import held_weights
from fxmeg.errors import ConfigError
from fxmeg.frontend.capture import LossFn
from fxmeg.frontend.pass_driver import transform
from fxmeg.frontend.variable_shapes import meta_twin
from fxmeg.ir import ops
from fxmeg.ir.program import Program
from fxmeg.passes.graph_utils import is_hop, val
from fxmeg.passes.partition import node_flops
from fxmeg.passes.split_backward import SPLIT_GRAPHS
from fxmeg.runtime.data_parallel.zero import IN_FLIGHT
from fxmeg.runtime.pipeline import schedules, simulator

if TYPE_CHECKING:
    from fxmeg.runtime.context import RankContext

ADAM_STATES = 2
"""fp32 optimizer states per element (Adam's two moments)."""
F_COST, B_COST = 1.0, 2.0
"""Simulated cost of one chunk's forward and backward (backward ~ 2 x forward)."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage on one tensor-parallel rank; sizes in bytes."""

    stage: int
    chunks: tuple[int, ...]
    units: str
    """The units (blocks) of each chunk, e.g. 'layers.0..4, layers.8..12'."""
    parameter_elements: int
    expert_parameter_elements: int
    """Of ``parameter_elements``: those of routed-experts banks (``expert_banks``)."""
    parameters: int
    gradient_buffers: int
    expert_gradient_buffers: int
    """Of ``gradient_buffers``: the experts' own buffers (ep > 1, padding for edp
    included), or at ep = 1 their slots in the shared buffer."""
    optimizer_state: int
    expert_optimizer_state: int
    """Of ``optimizer_state``: the experts' (divided by edp with the distributed optimizer)."""
    activations_per_microbatch: int
    """One micro-batch's saved tensors in this rank's largest chunk."""
    microbatches_in_flight: int
    """The most micro-batches (of any of its chunks) holding activations at once."""
    activations: int
    """The most saved bytes held at once, each micro-batch its chunk's (``peak_held_by``)."""
    total: int
    flops_per_microbatch: float
    """Forward FLOPs of one micro-batch on this rank (matmuls and attention)."""
    bubble: float
    buckets_in_flight: int = 0
    """zero >= 2: gradient (and zero=3 parameter) buckets whole at once (in ``total``)."""
    recompute_working_set: int = 0
    """Under recompute: the largest region's own tensors, held once while backward runs it
    again (in ``total``)."""
    attention_working_set: int = 0
    """cp > 1: what one attention's backward holds for itself, once (in ``total``)."""
    recompute_inputs: int = 0
    """What one micro-batch would keep under full recompute: the blocks' inputs and the
    tensors saved outside blocks (the verdict's remedy: ``remedies``)."""
    largest_block: int = 0
    """One block's saved tensors for one micro-batch (the largest block of the stage)."""
    layers: int = 0
    """Blocks in the stage's largest chunk (``activation_breakdown`` sums over them)."""
    activation_breakdown: dict = field(default_factory=dict)
    """Bytes one micro-batch keeps, by what keeps them: 'layer: mlp.down_proj: input'
    summed over the chunk's ``layers`` blocks, the rest by module ('lm_head: input')."""

    @property
    def weights_and_optimizer(self) -> int:
        """What Megatron's compute_weight_and_optimizer_memory counts: parameters,
        gradients and optimizer state."""
        return self.parameters + self.gradient_buffers + self.optimizer_state


@dataclass(frozen=True)
class Plan:
    """A layout's per-stage memory, FLOPs and bubble. ``str(plan)`` is a table."""

    config: EngineConfig
    stages: tuple[StagePlan, ...]
    total_parameters: int
    """Trainable elements of the whole model, full shapes, each tensor once."""
    flops_per_microbatch: float
    """Forward FLOPs of one micro-batch of the whole model (all tp ranks)."""
    tp_whole: tuple[tuple[str, str], ...] = ()
    """(module glob, why) of the blocks' projections every tp rank holds whole
    (``Program.tp_whole``)."""
    blocks: tuple[str, ...] = ()
    """The model's blocks (``Partition.blocks``)."""
    device_memory: int | None = None
    """Bytes of one rank's device (``with_device``); the verdict says which stages fit."""

    @property
    def ranks(self) -> int:
        par = self.config.parallel
        return par.model_ranks * (par.dp or 1)

    def with_device(self, device_memory: int) -> Plan:
        """This plan judged against a device of ``device_memory`` bytes."""
        return dataclasses.replace(self, device_memory=device_memory)

    def verdict(self) -> list[dict] | None:
        """Per stage: 'total', 'fits', 'free' (negative: the excess) and, when it exceeds,
        'remedies' (change, saves, total, fits), most saving first; None without a device."""
        return None if self.device_memory is None else verdict(self, self.device_memory)

    def to_dict(self) -> dict:
        cfg, par = self.config, self.config.parallel
        return {
            "layout": {"tp": par.tp, "cp": par.cp, "pp": par.pp, "vpp": par.vpp, "dp": par.dp,
                       "ep": par.ep, "schedule": par.resolved_schedule,
                       "sequence_parallel": par.sequence_parallel,
                       "cp_comm_type": par.cp_comm_type},
            "ranks": self.ranks,
            "precision": cfg.precision,
            "distributed_optimizer": cfg.data_parallel.distributed_optimizer,
            "zero": cfg.data_parallel.zero_stage,
            "recompute": cfg.recomputation.recompute,
            "micro_batch_size": cfg.micro_batch_size,
            "global_batch_size": cfg.global_batch_size,
            "num_microbatches": cfg.num_microbatches,
            "total_parameters": self.total_parameters,
            "flops_per_microbatch": self.flops_per_microbatch,
            "bubble_costs": {"forward": F_COST, "backward": B_COST},
            "stages": [dataclasses.asdict(s) for s in self.stages],
            "tp_whole": [{"modules": m, "why": why} for m, why in self.tp_whole],
            "device_memory": self.device_memory,
            "verdict": self.verdict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        cfg, par, dp = self.config, self.config.parallel, self.config.data_parallel
        unit, scale = (("GiB", 2**30) if max(s.total for s in self.stages) >= 2**30
                       else ("MiB", 2**20))
        sp = " (sequence parallel)" if par.sequence_parallel else ""
        ep = f" ep={par.ep}" if par.ep > 1 else ""
        # a column only for a mixture of experts
        experts = any(s.expert_parameter_elements for s in self.stages)
        head = [
            (f"Plan: {_si(self.total_parameters)} parameters; tp={par.tp} x cp={par.cp} x "
             f"pp={par.pp} x dp={par.dp} = {self.ranks} ranks; vpp={par.vpp}{ep}{sp}, "
             f"{cfg.precision}, distributed optimizer {'on' if dp.distributed_optimizer else 'off'}"
             f"{f' (zero={dp.zero_stage})' if dp.zero_stage >= 2 else ''}, "
             f"recompute {cfg.recomputation.recompute}"),
            (f"  {cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} per step; "
             f"{_si(self.flops_per_microbatch, 'G')} FLOP forward per micro-batch (whole model); "
             f"pipeline bubble: {max(s.bubble for s in self.stages):.1%} of the step (schedule "
             f"{par.resolved_schedule}, {cfg.num_microbatches} micro-batches; a backward costs "
             f"{B_COST / F_COST:g} forwards)"),
            f"  per tensor-parallel rank (all alike), in {unit}; Adam-like optimizer",
        ]
        columns = ("stage", "units", "params", *(("experts",) if experts else ()), "weights",
                   "grads", "optim", "act/mb", "in flight", "acts", "total", "FLOP/mb", "bubble")
        rows = [columns] + [(
            str(s.stage), s.units, _si(s.parameter_elements),
            *((_si(s.expert_parameter_elements),) if experts else ()),
            *(f"{n / scale:,.2f}" for n in (s.parameters, s.gradient_buffers, s.optimizer_state,
                                            s.activations_per_microbatch)),
            str(s.microbatches_in_flight), f"{s.activations / scale:,.2f}",
            f"{s.total / scale:,.2f}",
            _si(s.flops_per_microbatch, "G"), f"{s.bubble:.1%}",
        ) for s in self.stages]
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
        lines = ["  ".join(c.ljust(w) if i == 1 else c.rjust(w)  # units read left-aligned
                           for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        whole = [f"  tp={par.tp} leaves whole on every tp rank: {m} ({why})" for m,
                 why in self.tp_whole]
        device = verdict_lines(self, self.device_memory) if self.device_memory is not None else []
        attention = max(s.attention_working_set for s in self.stages)
        exchange = [f"  cp_comm_type {par.cp_comm_type}: one attention's backward holds "
                    f"{attention / scale:,.2f} {unit} for itself (in total)"] if par.cp > 1 else []
        return "\n".join(head + lines + whole + exchange + _breakdown_lines(self.stages[0])
                         + device)


def plan(model: nn.Module, example: Example, *, loss_fn: LossFn | None = None,
         config: EngineConfig | None = None, device_memory: int | None = None,
         progress: Callable[[str], None] | None = None, **options) -> Plan:
    """The plan of training ``model`` on micro-batches like ``example`` under ``config``
    (or ``options``: ``tp=8, pp=8, vpp=2, global_batch_size=64, precision="bf16", ...`` as
    ``parallelize`` takes them; dp defaults to 1). The model and the example are copied
    to the meta device first: the user's model is left as it is (no cast, no move), and
    no tensor is allocated, however large the model. No process group is created.
    ``device_memory`` (bytes of one rank's device) adds the verdict (``Plan.verdict``);
    ``progress`` is called with a short line at each step (capture, each pass, each stage)."""
    if isinstance(example, Mapping) and all(isinstance(t, torch.Tensor) for t in example.values()):
        # passed by keyword, as parallelize does
        example = {k: t.to("meta") for k, t in example.items()}
    elif isinstance(example, tuple) and all(isinstance(t, torch.Tensor) for t in example):
        example = tuple(t.to("meta") for t in example)
    else:
        raise ConfigError(
            "example must be a tuple or a dict of tensors (one micro-batch; shapes and dtypes "
            "are what counts)"
        )
    if config is not None and options:
        raise ConfigError(
            f"pass either config= or options, not both; got config and {sorted(options)}"
        )
    if config is not None:
        batch_dim(example, config.micro_batch_size)
        par = config.parallel
        config = config.resolve(par.model_ranks * (par.dp or 1))  # dp=None: one replica
    with _pass_progress(progress):
        program = transform(meta_twin(model), example, config, loss_fn=loss_fn, **options)
    result = plan_of(program, progress=progress)
    return result if device_memory is None else result.with_device(device_memory)


class _Progress(logging.Handler):
    """Passes the pass driver's per-step records (fxmeg.frontend.pass_driver at INFO) on as lines.
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        step = getattr(record, "step", None)
        if step is not None:
            self.say(f"{step} {record.seconds:.1f} s")


class _pass_progress:
    def __init__(self, say: Callable[[str], None] | None) -> None:
        self.say, self.handler, self.level = say, None, None

    def __enter__(self):
        if self.say is not None:
            log = logging.getLogger("fxmeg.frontend.pass_driver")
            self.handler, self.level = _Progress(self.say), log.level
            log.addHandler(self.handler)
            if not log.isEnabledFor(logging.INFO):
                log.setLevel(logging.INFO)
            self.say("capturing the model (torch.export) and running the passes")

    def __exit__(self, *exc):
        if self.handler is not None:
            log = logging.getLogger("fxmeg.frontend.pass_driver")
            log.removeHandler(self.handler)
            log.setLevel(self.level)


def stderr_progress() -> Callable[[str], None]:
    """``progress`` lines on stderr, each with the seconds since the first."""
    start = time.perf_counter()
    return lambda line: print(
        f"fxmeg plan [{time.perf_counter() - start:5.1f} s] {line}", file=sys.stderr, flush=True
    )


def plan_of(program: Program, config: EngineConfig | None = None, *,
            progress: Callable[[str], None] | None = None) -> Plan:
    """The plan of a transformed ``program`` under ``config`` (default its own; the
    runtime may change only the global batch size)."""
    config = config or program.config
    par = config.parallel
    schedule = schedules.build(par.resolved_schedule, pp=par.pp, vpp=par.vpp,
                               m=config.num_microbatches, max_pending_w=par.max_pending_w)
    # the in-flight count follows each rank's compute order alone, which p2p does not change
    lowered = schedules.lower(
        schedule,
        num_chunks=program.num_chunks,
        grad_cuts=program.grad_cuts,
        p2p="eager",
        placement=program.placement,
    )
    sim = simulator.simulate(
        lowered, pp=par.pp, placement=program.placement, f_cost=F_COST, b_cost=B_COST
    )
    stages = []
    for stage in range(par.pp):
        if progress is not None:
            progress(f"accounting stage {stage} of {par.pp}")
        stages.append(_stage(program, config, stage, sim))
    total = sum(program.full_shapes[n][0].numel() for n in program.parameters)
    return Plan(config, tuple(stages), total, program.flops_per_microbatch, program.tp_whole,
                program.partition.blocks)


def _stage(program: Program, config: EngineConfig, stage: int,
           sim: simulator.Simulation) -> StagePlan:
    mine = program.chunks_of(stage)
    graphs = [program.chunks[c] for c in mine]
    local = {}  # name -> the local (shard) value recorded on its get_attr node
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target in program.parameters and val(
                node) is not None:
                local[node.target] = val(node)
    banks = expert_banks(program)
    elements = sum(v.numel() for v in local.values())
    experts = sum(v.numel() for n, v in local.items() if n in banks)
    params = sum(v.numel() * v.element_size() for v in local.values())
    layouts = [lay for c in mine for lay in program.buffers[c]]
    grads = sum(lay.numel * lay.dtype.itemsize for lay in layouts)
    expert_grads = sum(lay.numel * lay.dtype.itemsize for lay in layouts if lay.experts) + sum(
        s.numel * lay.dtype.itemsize for lay in layouts if not lay.experts for s in lay.slots
        if s.name in banks)
    par = config.parallel
    dense_ranks, expert_ranks = (par.dp_cp,
                                 par.edp) if config.data_parallel.distributed_optimizer else (1, 1)
    states = ADAM_STATES + (1 if config.precision != "fp32" else 0)  # + the fp32 master
    expert_optimizer = int(states * 4 * experts / expert_ranks)
    optimizer = int(states * (4 * (elements - experts) / dense_ranks)) + expert_optimizer
    buckets = 0
    if config.data_parallel.zero_stage >= 2:
        size = params // max(elements, 1)  # bytes per parameter element
        grads, buckets = _zero_memory(layouts, size, config, _early_read(graphs))
        if config.data_parallel.zero_stage == 3:
            params = sum(lay.numel // _sharers(lay, par) for lay in layouts) * size
    acts = [activation_bytes(gm) for gm in graphs]
    act, largest = max(acts), graphs[acts.index(max(acts))]
    where = program.placement or schedules.round_robin(par.pp, program.num_chunks)
    held = sim.peak_held_by(where, *held_weights(mine, graphs, acts))[stage]
    working = max(recompute_working_bytes(gm) for gm in graphs)
    attention = max(attention_working_bytes(gm) for gm in graphs)
    inside, outside, entering = by_block(largest)
    layers, parts = breakdown(largest)
    peak = sim.peak_held[stage]  # zero bubble: what waits for its W still holds activations
    return StagePlan(
        stage=stage, chunks=tuple(mine),
        units=", ".join(_span(program.partition.chunk_units(c)) for c in mine),
        parameter_elements=elements, expert_parameter_elements=experts, parameters=params,
        gradient_buffers=grads, expert_gradient_buffers=expert_grads,
        optimizer_state=optimizer, expert_optimizer_state=expert_optimizer,
        activations_per_microbatch=act, microbatches_in_flight=peak, activations=int(held),
        total=params + grads + optimizer + int(held) + buckets + working + attention,
        flops_per_microbatch=sum(graph_flops(gm) for gm in graphs), bubble=sim.bubble(stage),
        buckets_in_flight=buckets, recompute_working_set=working, attention_working_set=attention,
        recompute_inputs=outside + entering, largest_block=max(inside.values(), default=0),
        layers=layers, activation_breakdown=dict(sorted(parts.items(), key=lambda kv: -kv[1])))


def _zero_memory(
    layouts, size: int, config: EngineConfig, early: frozenset[str]
) -> tuple[int, int]:
    """zero >= 2: (the gradient shards' bytes, the bytes of buckets whole at once). A
    bucket holding a weight that ``ops.early_linear`` reads (a tied embedding) is whole
    alone (at the head and the embedding), so the others set the working set."""
    grads = sum(lay.numel * lay.dtype.itemsize // _sharers(lay, config.parallel)
                for lay in layouts)
    sizes = [(b.end - b.start, bool(early & set(b.params))) for lay in layouts for b in lay.buckets]
    largest = max((n for n, tied in sizes if not tied), default=0)
    if config.data_parallel.zero_stage < 3:
        return grads, (1 + IN_FLIGHT) * largest * 4  # fp32 gradient staging
    # one bucket of each whole, and the fresh gradient
    if config.data_parallel.backward_prefetch == "post":
        whole = 2 * largest * 4 + largest * size
    else:  # gradients staged and reducing, parameters computed with and prefetched
        whole = (1 + IN_FLIGHT) * largest * 4 + 2 * largest * size
    return grads, max([whole] + [n * size for n, tied in sizes if tied])


def _sharers(layout, par) -> int:
    """The ranks a gradient buffer's shards split over at zero >= 2: the experts' own buffer
    over the expert-data-parallel ranks (those holding the same experts), the others over
    dp x cp."""
    return par.edp if layout.experts else par.dp_cp


def _early_read(graphs) -> frozenset[str]:
    """The parameters that ``ops.early_linear`` nodes read as their weight."""
    return frozenset(
        n.args[1].target for gm in graphs for n in gm.graph.nodes if n.target is ops.early_linear
    )


def graph_flops(gm: fx.GraphModule) -> float:
    """Forward FLOPs of a chunk graph: its nodes and those of every sub-graph in it
    (recompute regions, higher-order ops' bodies), each counted once; a zero-bubble split's
    forward, input- and weight-gradient graphs (``SPLIT_GRAPHS``) are not the forward."""
    split = tuple(f"{name}." for name in SPLIT_GRAPHS)
    return sum(node_flops(n) for name, m in gm.named_modules()
               if isinstance(m, fx.GraphModule) and not f"{name}.".startswith(split)
               for n in m.graph.nodes if n.op == "call_function" and not is_hop(n))


def memory_report(program: Program, ctx: RankContext) -> list[dict]:
    """The trainer's memory report: one dict per pipeline stage (``StagePlan``'s fields)
    for the configuration in force. Every tensor-parallel rank holds the same shapes, so
    this is ``ctx``'s tp rank's too."""
    return [dataclasses.asdict(s) for s in plan_of(program, ctx.config).stages]


def _breakdown_lines(stage: StagePlan, width: int = 100) -> list[str]:
    """Stage ``stage``'s activations of one micro-batch by what keeps them: one layer's
    (the chunk's blocks' sum over their count), then what lies outside the blocks."""
    parts, n = stage.activation_breakdown, max(stage.layers, 1)
    if not parts:
        return []
    layer = {k.removeprefix("layer: "): v / n for k, v in parts.items() if k.startswith("layer: ")}
    rest = {k: v for k, v in parts.items() if not k.startswith("layer: ")}
    lines = []
    for title, items in ((f"one layer of stage {stage.stage} (mean of {stage.layers})", layer),
                         (f"outside the layers, stage {stage.stage}", rest)):
        if not items:
            continue
        lines.append(f"  activations per micro-batch, {title}: {human_bytes(sum(items.values()))}")
        line = "   "
        for key, v in sorted(items.items(), key=lambda kv: -kv[1]):
            word = f" {key} {human_bytes(v)};"
            if len(line) + len(word) > width:
                lines.append(line.rstrip(";"))
                line = "   "
            line += word
        lines.append(line.rstrip(";"))
    return lines


def human_bytes(n: float) -> str:
    """'12.34 GiB' from 1 GiB on, else '12.3 MiB'."""
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def _span(units: tuple[str, ...]) -> str:
    """'layers.0..4' for a chunk from layers.0 to the end of layers.4 (its last unit may
    be a residual point inside layers.4: the chunk runs to that block's end); '-' for none."""
    if not units:
        return "-"
    first, last = units[0], units[-1].split(":")[0]
    if first == last:
        return first
    prefix = first.rpartition(".")[0] + "."
    return f"{first}..{last.removeprefix(prefix)}"


def _si(n: float, billion: str = "B") -> str:
    """'70.6B', '1.20M', '45.3K', '512': three significant digits (``billion``: 'G' for FLOPs)."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, billion), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


# ---------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Remedy:
    """One change and the stage's total it predicts (bytes)."""

    change: str
    saves: int
    total: int
    fits: bool


def remedies(plan: Plan, stage: StagePlan, device: int) -> list[Remedy]:
    """The changes that lower ``stage``'s total, most saving first (``fxmeg plan
    --device-memory``). Each is predicted from the plan's own numbers, per stage:

      full recompute     the blocks keep only their inputs per micro-batch (the plan's
                         ``recompute_inputs``), and backward holds one block's own tensors
                         while it runs it again (the largest block's, once)
      distributed        the optimizer state divided by dp x cp (Megatron's distributed
      optimizer          optimizer, ZeRO-1)
      zero=2 / zero=3    besides, the gradient buffers (zero=2) and the parameters (zero=3)
                         divided by dp x cp; the buckets being reduced or gathered stay whole
                         (neglected here)
      pp x 2             each stage holds half the blocks: weights, gradients, optimizer
                         state and each micro-batch's activations halve, while 1F1B keeps up
                         to twice as many micro-batches in flight on the first stages
      micro-batch 1      each micro-batch's activations scale with its size; the number in
                         flight is the schedule's, at most pp, so it does not grow

    Each is applied alone to the stage's total, so the savings do not add up exactly.
    """
    cfg, par, dp = plan.config, plan.config.parallel, plan.config.data_parallel
    ranks, out = par.dp_cp, []

    def add(change: str, total: int) -> None:
        if total < stage.total:
            out.append(Remedy(change, stage.total - total, total, total <= device))

    if cfg.recomputation.recompute != "full" and stage.recompute_inputs:
        acts = stage.recompute_inputs * stage.microbatches_in_flight + stage.largest_block
        add(
            "--recompute full", stage.total - stage.activations - stage.recompute_working_set + acts
        )
    if ranks > 1 and not dp.distributed_optimizer and dp.zero_stage < 2:
        add(f"--distributed-optimizer (optimizer state / {ranks})",
            stage.total - stage.optimizer_state + stage.optimizer_state // ranks)
    if ranks > 1 and dp.zero_stage < 2:
        optimizer = (
            stage.optimizer_state if dp.distributed_optimizer else stage.optimizer_state // ranks
        )
        saved = (
            stage.optimizer_state
            - optimizer
            + stage.gradient_buffers
            - stage.gradient_buffers // ranks
        )
        add(f"--zero 2 (optimizer state and gradients / {ranks})", stage.total - saved)
        add(f"--zero 3 (optimizer state, gradients and parameters / {ranks})",
            stage.total - saved - stage.parameters + stage.parameters // ranks)
    blocks = len(plan.blocks) if plan.blocks else 0
    if blocks >= 2 * par.pp * par.vpp:
        weights = stage.parameters + stage.gradient_buffers + stage.optimizer_state
        flight = min(2 * stage.microbatches_in_flight, cfg.num_microbatches)
        add(
            f"--pp {2 * par.pp} (half the blocks per stage)",
            stage.total
            - weights // 2
            - stage.activations
            + stage.activations_per_microbatch // 2 * flight,
        )
    if cfg.micro_batch_size > 1:
        add(f"--micro-batch-size 1 (activations / {cfg.micro_batch_size})",
            stage.total - stage.activations + stage.activations // cfg.micro_batch_size)
    return sorted(out, key=lambda r: -r.saves)


def verdict(plan: Plan, device: int) -> list[dict]:
    """Per stage: free bytes or the excess, and when it exceeds, the remedies."""
    rows = []
    for s in plan.stages:
        row = {
            "stage": s.stage,
            "total": s.total,
            "fits": s.total <= device,
            "free": device - s.total,
        }
        if s.total > device:
            row["remedies"] = [r.__dict__ for r in remedies(plan, s, device)]
        rows.append(row)
    return rows


def verdict_lines(plan: Plan, device: int) -> list[str]:
    """The verdict as text: one line per stage, then the remedies of the stages that exceed."""
    lines = [f"  device memory {device / GiB:,.1f} GiB per rank:"]
    for row in verdict(plan, device):
        state = (f"fits ({row['free'] / GiB:,.2f} GiB free)" if row["fits"]
                 else f"exceeds by {-row['free'] / GiB:,.2f} GiB")
        lines.append(f"    stage {row['stage']}: {row['total'] / GiB:,.2f} GiB, {state}")
        for r in row.get("remedies", []):
            mark = "fits" if r["fits"] else "still exceeds"
            lines.append(f"      {r['change']}: saves {r['saves'] / GiB:,.2f} GiB -> "
                         f"{r['total'] / GiB:,.2f} GiB, {mark}")
        if "remedies" in row and not row["remedies"]:
            lines.append("      no remedy predicted here: add tensor parallelism or ranks")
    return lines
