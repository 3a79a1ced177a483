"""This rank's runtime, built from the rank-free Program (docs/architecture.md §1, §3).

``build_context(program, config)`` creates, in this order: the optimizer plan (which
inner optimizer the factory gives each parameter; how the distributed optimizer shards
was decided by ``parallelize``: ``DataParallelConfig.decided_sharding``); the process groups; this
rank's chunks, bound (copies of the Program's chunk graphs whose tensor-parallel
parameters are materialised as this rank's shards, and whose symbolic group names and
param-gather markers point at this rank's objects); the check that replicas hold the same
values (``runtime/data_parallel/replicas.py``; with ``broadcast_params`` the first replica's values
copied first); the data-parallel gradient buffers;
the optimizer with its fp32 masters; the loss scaler and lr scheduler; the schedule; and
the executor. Everything a step needs is in the returned ``RankContext``; nothing is
global.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import fx, nn

from fxmeg.config import EngineConfig
from fxmeg.config_sections import DataParallelConfig, PipelineConfig
from fxmeg.errors import FxmegError
from fxmeg.ir import program as prog
from fxmeg.ir.layouts import ExpertShard, ParamLayout, is_split
from fxmeg.ir.program import CONSTANTS, Program
from fxmeg.ir.recomputation import Recomputation
from fxmeg.loss_scale import LossScaler
from fxmeg.lr_schedule import ParamScheduler
from fxmeg.runtime import collectives
from fxmeg.runtime.data_parallel import replicas
from fxmeg.runtime.data_parallel.build import data_parallel, grad_reductions
from fxmeg.runtime.data_parallel.ddp import DataParallel
from fxmeg.runtime.data_parallel.zero import ShardFill, ZeroParams
from fxmeg.runtime.expert_load import ExpertLoad, GlobalTokens
from fxmeg.runtime.experts import RankExperts
from fxmeg.runtime.groups import Groups, Topology, build_groups
from fxmeg.runtime.lanes import Lane
from fxmeg.runtime.optimizer.layerwise import gather_tp
from fxmeg.runtime.optimizer.optimizer import (
    FullSource,
    MasterSource,
    MasterSources,
    Optimizer,
    OptimizerFactory,
    StepOptions,
    default_optimizer,
    param_groups,
    plan_optimizers,
)
from fxmeg.runtime.pipeline import schedules
from fxmeg.runtime.pipeline.executor import ComputeHooks, Executor
from fxmeg.runtime.pipeline.p2p import PointToPoint
from fxmeg.runtime.release import release
from fxmeg.runtime.timelines import Tracer
from fxmeg.sharding_modes import OptimizerSharding
from fxmeg.weights.meta_init import Source
from fxmeg.weights.sharding import ep_shard, tp_shard


@dataclass(frozen=True)
class AuxLoss:
    """An auxiliary loss's gradient weight, set before every step (runtime/step.py)."""

    scale: torch.Tensor
    """The weight buffer of this rank's bound chunk graph."""
    counter: fx.GraphModule
    """num_tokens of a micro-batch from the chunk's data inputs."""
    data_inputs: tuple[int, ...]


@dataclass(frozen=True)
class Bound:
    """One Program's chunks bound to this rank's tensors, and what runs them."""

    program: Program
    chunks: dict[int, fx.GraphModule]
    executor: Executor
    aux: AuxLoss | None


@dataclass
class RankContext:
    """Everything this rank runs a step with. The schedule is here, not in the Program:
    it changes with the micro-batch count (``set_global_batch_size``)."""

    config: EngineConfig
    """The configuration in force (the Program's, but for a changed global batch size)."""
    groups: Groups
    chunks: dict[int, fx.GraphModule]
    """Chunk index -> this rank's bound chunk graph."""
    named_parameters: dict[str, nn.Parameter]
    """This rank's trainable parameters (tensor-parallel shards) by the user's FQN."""
    device: torch.device
    tracer: Tracer
    ddp: DataParallel
    grad_reductions: list[tuple[nn.Parameter, str | None]]
    """Gradients all-reduced at finalize, in the same order on every rank: weights held
    by several pipeline ranks (tied), then tp-replicated weights whose gradient differs
    per tp rank (norms under sequence parallelism)."""
    optimizer: Optimizer
    scaler: LossScaler | None
    scheduler: ParamScheduler | None
    executor: Executor
    aux: AuxLoss | None
    lower: schedules.Lowering
    whole: dict[str, torch.Tensor]
    """A model built on meta: its buffers and untrained state, made whole on every rank
    (small; what the full state dict and the verify reference read). Empty otherwise."""
    binding: collectives.Binding
    """What this rank's chunk graphs' ops are bound to (``collectives.bind``; ``bind`` binds
    another input shape's chunks to the same)."""
    recomputation: Recomputation
    """Whether this rank's recompute regions run again (read by the expert-load recorder and
    the drop counts), and what they call before they run (zero=3)."""
    experts: RankExperts
    """This rank's routed experts: the all-to-all exchanges and the capacity mode's drops."""
    schedule: schedules.Schedule = field(init=False)
    """Compute actions per pipeline rank for the current micro-batch count."""
    steps: list[schedules.Step] = field(init=False)
    """This rank's lowered training steps."""
    global_tokens: GlobalTokens | None = None
    """A router loss's running tokens per expert over the step (``global_aux_loss``)."""
    load: ExpertLoad | None = None
    """Tokens per expert of the routed-experts layers (runtime/expert_load.py); None for a model
    without any, or where forward is compiled or split (compile, zero-bubble schedules)."""
    zero: ZeroParams | None = None
    """zero=3: the parameters' gathers and releases (runtime/data_parallel/zero.py)."""
    consecutive_skips: int = 0
    steps_taken: int = 0
    """train_step calls so far (``check_replicas_interval`` counts them)."""

    def __post_init__(self) -> None:
        self.set_global_batch_size(self.config.global_batch_size)

    def use(self, bound: Bound) -> None:
        """Run the next steps with ``bound``'s chunks (another input shape's Program,
        the same tensors: ``bind``)."""
        self.chunks, self.executor, self.aux = bound.chunks, bound.executor, bound.aux

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Train the next steps on global batches of this size: validated like the
        first one (EngineConfig), the schedule is rebuilt for the new micro-batch count."""
        self.config = dataclasses.replace(self.config, global_batch_size=global_batch_size)
        self.schedule = self.build_schedule(self.config.num_microbatches)
        self.steps = self.lower(self.schedule)[self.groups.pp_rank]

    def unsharded(self, *, write: bool = False):
        """A context inside which every parameter this rank holds is whole (zero=3 gathers
        them; collective), for what reads or writes them outside a step: state dicts,
        checkpoints, replica checks. With ``write`` what was written is kept."""
        return self.zero.whole(write=write) if self.zero is not None else contextlib.nullcontext()

    def build_schedule(self, m: int) -> schedules.Schedule:
        par = self.config.parallel
        return schedules.build(par.resolved_schedule, pp=par.pp, vpp=par.vpp, m=m,
                               max_pending_w=par.max_pending_w)


def build_context(program: Program, config: EngineConfig | None = None, *,
                  optimizer: OptimizerFactory | None = None, source: Source | None = None,
                  model: nn.Module | None = None) -> RankContext:
    """This rank's runtime for ``program`` (collective: every rank calls it). Tensors come
    from ``source`` (weights, or the initialisation of a model built on meta) where it
    has them, else from the Program's own (the user's) tensors. With ``model`` (the
    user's module), everything this rank does not hold is released in it and in
    ``program`` as soon as this rank's tensors are made (``runtime/release.py``)."""
    config = config or program.config
    par = config.parallel
    factory = optimizer or default_optimizer
    template = param_groups(_shapes(program.parameters))  # the whole model's groups, on every rank
    plan = plan_optimizers(factory, template, program.device)  # the optimizer of each parameter
    assert config.data_parallel.decided_sharding is not None, \
        "parallelize decides the optimizer sharding"
    sharding = config.data_parallel.decided_sharding
    tied = sorted({frozenset(r) for r in program.holders.values() if len(r) > 1}, key=sorted)
    groups = build_groups(Topology(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep),
                          tied=tied, timeout_s=config.guards.comm_timeout_s,
                          lanes=config.moe.overlap_moe_expert_parallel_comm)
    wanted = _wanted(program, groups, source, _whole_names(program))
    later = _sharded_later(program, config.data_parallel, groups, wanted)
    local = _values(program, groups, source, {n: w for n, w in wanted.items() if n not in later})
    chunks = _materialise(program, groups, local, later)
    masters = _local_masters(program, groups, local, later)
    # before release (the user's full tensors are compared over tp) and buffers/optimizer read
    _agree_at_start(program, config.data_parallel, groups, chunks, masters, local, later)
    whole = {n: t for n, t in local.items() if n in wanted and wanted[n].whole}
    fill, pieces = _shard_fill(program, groups, source, {n: wanted[n] for n in later})
    if model is not None:
        release(model, program, chunks, whole)
    named = {n: p for gm in chunks.values() for n, p in gm.named_parameters() if p.requires_grad}
    tracer = Tracer()
    ddp = data_parallel(program, config.data_parallel, chunks, groups, tracer, fill,
                         shard=sharding is OptimizerSharding.ELEMENTWISE)
    recomputation = Recomputation()  # this rank's recompute regions, for all that asks about one
    zero = (ZeroParams(ddp.buffers, recomputation=recomputation,
                       post=config.data_parallel.backward_prefetch == "post")
            if config.data_parallel.zero_stage == 3 else None)
    load = _expert_load(program, config, chunks, recomputation)
    # its all-to-alls join this rank's timeline; backward's go over the ep twin (lanes)
    rank_experts = RankExperts(recomputation, tracer, twins=groups.twin_names())
    tokens = GlobalTokens(par.dp)  # a router loss's running tokens per expert (global_aux_loss)
    binding = _binding(program, config.data_parallel, groups, ddp, zero, load, tokens,
                       rank_experts, recomputation)
    for gm in chunks.values():
        collectives.bind(gm, binding)
    opt = Optimizer(named, ddp, factory, groups=groups, holders=program.holders,
                    template=template, plan=plan, sharding=sharding, options=StepOptions.of(config),
                    tp_specs=program.tp_specs, experts=frozenset(program.ep_specs),
                    sources=MasterSources(_master_source(masters, pieces),
                                          _full_source(program, groups, masters)))
    executor = _executor(program, config, chunks, groups, ddp, tracer, zero)
    return RankContext(
        config=config, groups=groups, chunks=chunks, named_parameters=named, device=program.device,
        tracer=tracer, ddp=ddp, grad_reductions=grad_reductions(program, named, groups),
        optimizer=opt, scaler=LossScaler(config.loss_scale) if config.precision == "fp16" else None,
        scheduler=ParamScheduler(config.lr_schedule, opt.inner) if config.lr_schedule else None,
        executor=executor, aux=_aux_loss(program, chunks),
        lower=_lowering(program, config.pipeline, groups), whole=whole, binding=binding,
        recomputation=recomputation, experts=rank_experts, load=load, global_tokens=tokens,
        zero=zero)


def _expert_load(program: Program, config: EngineConfig, chunks: dict[int, fx.GraphModule],
                 recomputation: Recomputation) -> ExpertLoad | None:
    """The tokens-per-expert recorder of ``program``'s marked layers, holding this rank's
    router bias buffers; None without layers, and where the forward that runs is not the
    chunk graph with its markers (compiled, or a zero-bubble split: AOT autograd traces the
    markers, which return nothing, away; the split's routed-experts op would not do, for a
    marker is also where no block is rewritten, ep=1)."""
    if config.compile or config.parallel.splits_backward:
        return None
    load = ExpertLoad.of(program, recomputation)
    if load is not None:
        load.hold(program, chunks)
    return load


def _binding(program: Program, data_parallel: DataParallelConfig, groups: Groups,
             ddp: DataParallel, zero: ZeroParams | None, load: ExpertLoad | None,
             tokens: GlobalTokens, rank_experts: RankExperts,
             recomputation: Recomputation) -> collectives.Binding:
    """What this rank's chunk graphs' ops are bound to (``collectives.bind``)."""
    return collectives.Binding(
        _group_names(groups),
        wait_param_gather=ddp.wait_param_gather,
        zero=_zero_markers(zero),
        early_linear=ddp.early_linear if data_parallel.zero_stage >= 2 else None,
        device=program.device,
        expert_load=load.record if load is not None else None,
        global_tokens=tokens.running_mean,
        experts=rank_experts,
        recomputation=recomputation,
    )


def _zero_markers(zero: ZeroParams | None):
    """What the bound ``ops.zero_gather`` / ``ops.zero_release`` call (zero=3)."""
    return (zero.gather, zero.release) if zero is not None else None


def _executor(
    program: Program,
    config: EngineConfig,
    chunks: dict[int, fx.GraphModule],
    groups: Groups,
    ddp: DataParallel,
    tracer: Tracer,
    zero: ZeroParams | None,
) -> Executor:
    specs = {c: program.specs[c] for c in chunks}
    wire = PointToPoint(
        specs,
        pp=config.parallel.pp,
        peer=groups.pp_peer,
        group=groups.pp,
        device=program.device,
        placement=program.placement,
        timeout_s=config.guards.comm_timeout_s,
    )
    hooks = ComputeHooks(
        accumulate=ddp.accumulate, on_grad_sync=ddp.start_sync,
        on_backward=ddp.end_backward if config.data_parallel.zero_stage >= 2 else None,
        wait_params=ddp.wait_for_params if config.data_parallel.overlap_param_gather else None,
        running=zero.running if zero is not None else None)
    lane = Lane(groups.twin_names(), program.device) if groups.twins else None
    return Executor(chunks, specs=specs, rank=groups.rank, device=program.device, wire=wire,
                    hooks=hooks, compile=config.compile, tracer=tracer, lane=lane)


def bind(program: Program, first: Program, ctx: RankContext) -> Bound:
    """This rank's chunks of ``program``, another Program of the model ``ctx`` was built
    for from ``first`` (another input shape: fxmeg/frontend/variable_shapes.py), holding ``ctx``'s
    own tensors, with an executor that runs them (``RankContext.use`` switches to it).

    Requires: ``program`` has ``ctx``'s pipeline cut and gradient buffer layout (a
    mismatch raises: its gradients would land in other parameters' slots).
    Ensures: the bound graphs read and train exactly the tensors ``ctx``'s chunks hold
    (no copy); their collectives and parameter-gather waits are this rank's."""
    if program.placement != first.placement or program.buffers != first.buffers:
        raise FxmegError(
            "the Program of a new input shape cut the model or laid out its gradient buffers "
            "differently from the example's; it cannot share this rank's parameters (report "
            "this with the model: the passes should not depend on the sequence length here)"
        )
    live: dict[str, torch.Tensor] = {}
    for gm in ctx.chunks.values():
        live.update(gm.named_parameters(remove_duplicate=False))
        live.update(gm.named_buffers(remove_duplicate=False))
    memo: dict[int, torch.Tensor] = {}
    for c in program.chunks_of(ctx.groups.pp_rank):
        for name, t in (*program.chunks[c].named_parameters(remove_duplicate=False),
                        *program.chunks[c].named_buffers(remove_duplicate=False)):
            # this capture's own values (they may depend on the shape)
            if name.startswith(CONSTANTS):
                memo[id(t)] = t.to(program.device)
            elif name in live:
                memo[id(t)] = live[name]
            elif t.is_meta:
                raise FxmegError(
                    f"the Program of a new input shape reads {name!r}, which no chunk of this "
                    "rank holds"
                )
    chunks = {
        c: copy.deepcopy(program.chunks[c], memo) for c in program.chunks_of(ctx.groups.pp_rank)
    }
    for gm in chunks.values():
        collectives.bind(gm, ctx.binding)
    executor = _executor(program, ctx.config, chunks, ctx.groups, ctx.ddp, ctx.tracer, ctx.zero)
    return Bound(program, chunks, executor, _aux_loss(program, chunks))


def _group_names(groups: Groups) -> dict[str, str]:
    """The symbolic groups a chunk graph names ('tp', 'cp', 'ep', 'dp') -> this rank's process
    groups."""
    pairs = (("tp", groups.tp), ("cp", groups.cp), ("ep", groups.ep), ("dp", groups.dp))
    return {n: g.group_name for n, g in pairs if g is not None}


def _shapes(parameters) -> list[tuple[str, torch.Tensor]]:
    """(name, a meta tensor like the parameter): what the optimizer's group template
    needs, holding no reference to the user's tensors."""
    return [
        (n, torch.empty_like(p, device="meta").requires_grad_(p.requires_grad))
        for n, p in parameters.items()
    ]


def _whole_names(program: Program) -> set[str]:
    """What every rank holds whole: buffers (the reference graph reads them all) and state
    no chunk trains, by first name."""
    canonical = {a: n for n, names in program.aliases.items() for a in names}
    names = (
        {n for n, _ in program.reference.named_buffers()}
        if program.reference is not None
        else set()
    )
    return names | {canonical.get(k, k) for k in program.untrained}


class _Wanted(NamedTuple):
    spec: ParamLayout | None
    """The tensor-parallel split of a parameter this rank holds a shard of, else None."""
    dtype: torch.dtype
    whole: bool
    """A buffer or untrained tensor every rank holds whole."""
    experts: ExpertShard | None = None
    """An expert bank's split over ep ranks (this rank makes its experts only), else None."""


def _wanted(
    program: Program, groups: Groups, source: Source | None, whole_names: set[str]
) -> dict[str, _Wanted]:
    """What ``source`` provides of this rank's tensors (nothing without a source): every
    tensor of its chunks (parameters as their tensor-parallel shards) and, when the model
    was built on meta, the whole buffers and untrained state; in the dtype the user built
    them in (``Program.init_dtypes``: fp32 before a half-precision cast)."""
    if source is None:
        return {}
    tensors: dict[str, tuple[torch.Tensor, bool]] = {}
    for c in program.chunks_of(groups.pp_rank):
        gm = program.chunks[c]
        tensors.update({n: (t, True) for n, t in gm.named_parameters()})
        tensors.update({n: (t, False) for n, t in gm.named_buffers()})
    state = {n: t for gm in (program.reference, program.graph) if gm is not None
             for n, t in (*gm.named_parameters(), *gm.named_buffers())}
    for name in whole_names:
        if name in state:
            tensors.setdefault(name, (state[name], False))
    wanted = {}
    for name, (t, is_param) in tensors.items():
        if t.is_meta or source.has(name):
            spec = program.tp_specs.get(name) if is_param else None
            wanted[name] = _Wanted(
                spec if is_split(spec) else None,
                program.init_dtypes.get(name, t.dtype),
                name in whole_names,
                program.ep_specs.get(name) if is_param else None,
            )
    return wanted


def _values(program: Program, groups: Groups, source: Source | None,
            wanted: dict[str, _Wanted]) -> dict[str, torch.Tensor]:
    """This rank's value of each ``wanted`` tensor, made by ``source``."""
    if not wanted:
        return {}
    return source.values({n: (w.spec, w.dtype, w.experts) for n, w in wanted.items()},
                         program.device, groups.topo.tp, groups.tp_rank,
                         groups.topo.ep, groups.ep_rank)


def _sharded_later(program: Program, data_parallel: DataParallelConfig, groups: Groups,
                   wanted: dict[str, _Wanted]) -> frozenset[str]:
    """At zero=3, the trained parameters ``wanted`` from a source: made bucket by bucket
    while the gradient buffers shard them (``ShardFill``), each rank making only the
    parameters its shard covers, so that no rank ever holds its whole stage."""
    if data_parallel.zero_stage != 3:
        return frozenset()
    trained = {s.name for c in program.chunks_of(groups.pp_rank) for layout in program.buffers[c]
               for s in layout.slots}
    return frozenset(n for n, w in wanted.items() if n in trained and not w.whole)


def _agree_at_start(
    program: Program,
    data_parallel: DataParallelConfig,
    groups: Groups,
    chunks,
    masters,
    local,
    later: frozenset[str],
) -> None:
    """The start-up replica check (collective), of everything but what is made ``later``,
    as shards: every rank makes those from the same source."""
    held = {
        n: h
        for n, h in replicas.at_start(program, chunks, masters, local).items()
        if n not in later
    }
    replicas.agree(
        program, groups, held, device=program.device, broadcast=data_parallel.broadcast_params
    )


def _shard_fill(program: Program, groups: Groups, source: Source | None, wanted: dict[str, _Wanted]
                ) -> tuple[ShardFill | None, dict[str, tuple[int, torch.Tensor]]]:
    """The ShardFill of the parameters ``wanted`` later (None without any): ``make`` gets
    the element range [lo, hi) this rank's shard covers of some of them and returns their
    values; in half precision it keeps the fp32 values of that range in the returned dict
    (name -> (lo, values)) for the masters. Call it before ``release`` (which empties
    ``Program.master_values``)."""
    pieces: dict[str, tuple[int, torch.Tensor]] = {}
    if not wanted:
        return None, pieces
    halves = frozenset(n for n in wanted if n in program.master_values)

    def make(ranges: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        values = _values(program, groups, source, {n: wanted[n] for n in ranges})
        for name, (lo, hi) in ranges.items():
            if name in halves:
                pieces[name] = (lo, values[name].reshape(-1)[lo:hi].float().clone())
        return values

    return ShardFill(frozenset(wanted), make), pieces


def _materialise(program: Program, groups: Groups, local: dict[str, torch.Tensor],
                 later: frozenset[str] = frozenset()) -> dict[int, fx.GraphModule]:
    """Copies of this pipeline rank's chunk graphs holding this rank's tensors: ``local``
    values where there are some, else this tp rank's shard of the user's parameter (one
    tensor per name, shared by every chunk that reads it); unsharded parameters and
    buffers without a local value are the user's own. Parameters made ``later`` hold no
    memory yet (their gradient buffer gives them their values)."""
    tp, rank = groups.topo.tp, groups.tp_rank
    memo: dict[int, torch.Tensor] = {}
    mine = program.chunks_of(groups.pp_rank)
    for c in mine:
        gm = program.chunks[c]
        for name, t in (*gm.named_parameters(), *gm.named_buffers()):
            if id(t) in memo:
                continue
            spec = program.tp_specs.get(name)
            experts = program.ep_specs.get(name)
            if name in later:  # an expert bank in this rank's experts' shape
                value = _no_memory(t, spec, groups.topo.tp, program.device,
                                   experts and experts.experts // groups.topo.ep)
            elif name in local:
                value = local[name].to(t.dtype)
            elif isinstance(t, nn.Parameter) and is_split(spec):
                value = tp_shard(t, spec, tp, rank)
            else:
                value = t
            if experts is not None and name not in local and name not in later:
                value = ep_shard(value, experts, groups.topo.ep, groups.ep_rank)
            if isinstance(t, nn.Parameter) and value is not t:
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            memo[id(t)] = value
    return {c: copy.deepcopy(program.chunks[c], memo) for c in mine}


def _no_memory(t: torch.Tensor, spec: ParamLayout | None, tp: int, device: torch.device,
               rows: int | None = None) -> torch.Tensor:
    """A tensor of this rank's shape of ``t`` (full-size, or its tensor-parallel shard;
    ``rows`` of its first dim: an expert bank's experts on this rank) whose storage holds
    no memory."""
    shape = list(spec.local_shape(list(t.shape), tp) if is_split(spec) else t.shape)
    if rows is not None:
        shape[0] = rows
    value = torch.empty(shape, dtype=t.dtype, device=device)
    value.untyped_storage().resize_(0)
    return value


def _local_masters(program: Program, groups: Groups, local: dict[str, torch.Tensor],
                   later: frozenset[str]) -> dict[str, torch.Tensor]:
    """Half precision: the fp32 values of this rank's shard of each trainable parameter
    (from ``local``, or from the user's fp32 tensor); read while the optimizer is built,
    then dropped."""
    if not program.master_values:
        return {}
    tp, rank = groups.topo.tp, groups.tp_rank
    out = {}
    for c in program.chunks_of(groups.pp_rank):
        for name, _ in program.chunks[c].named_parameters():
            if name in out or name in later or name not in program.master_values:
                continue
            if name in local:
                out[name] = local[name]
            else:
                spec = program.tp_specs.get(name)
                full = program.master_values[name]
                out[name] = tp_shard(full, spec, tp, rank) if is_split(spec) else full
                out[name] = ep_shard(
                    out[name], program.ep_specs.get(name), groups.topo.ep, groups.ep_rank
                )
    return out


def _master_source(masters: dict[str, torch.Tensor],
                   pieces: dict[str, tuple[int, torch.Tensor]]) -> MasterSource | None:
    """Half precision: the fp32 master of elements [lo, hi) of this rank's shard of a
    parameter (only what the rank updates is made): from ``masters``, or for a parameter
    made as shards, its ``pieces`` entry (read once)."""
    if not masters and not pieces:
        return None

    def master(name: str, lo: int, hi: int) -> torch.Tensor:
        if name in pieces:
            at, values = pieces.pop(name)
            assert (at, at + values.numel()) == (lo, hi), (
                f"{name}: master [{lo}, {hi}) of a piece made for {at}"
            )
            return values
        return masters[name].detach().reshape(-1)[lo:hi].float().clone()

    return master


def _full_source(
    program: Program, groups: Groups, masters: dict[str, torch.Tensor]
) -> FullSource | None:
    """Half precision: a tensor-parallel parameter's full fp32 master (a full matrix
    stepped by an optimizer that needs the whole shape), gathered from the tp ranks'
    fp32 shards. Collective over the tp group."""
    if not masters:
        return None
    return lambda name: gather_tp(masters[name].detach().float(), program.tp_specs[name], groups.tp)


def _aux_loss(program: Program, chunks: dict[int, fx.GraphModule]) -> AuxLoss | None:
    """The bound chunk's own weight buffer (a fresh one: the Program's stays untouched)."""
    if program.aux_scale is None or program.aux_scale[0] not in chunks:
        return None
    c, name = program.aux_scale
    gm = chunks[c]
    gm.register_buffer(name, torch.zeros_like(gm.get_buffer(name)))
    return AuxLoss(gm.get_buffer(name), prog.token_counter(gm), program.specs[c].data_inputs)


def _lowering(program: Program, pipeline: PipelineConfig, groups: Groups) -> schedules.Lowering:
    grad_cuts = program.grad_cuts
    p2p = schedules.p2p_mode(
        pipeline.p2p, dist.get_backend(groups.pp) if groups.pp is not None else None
    )
    num_chunks, placement = program.num_chunks, program.placement
    return lambda schedule: schedules.lower(
        schedule, num_chunks=num_chunks, grad_cuts=grad_cuts, p2p=p2p, placement=placement
    )
