"""This rank's runtime, built from the rank-free Program (docs/design.md §1, §4).

``build_context(program, config)`` creates, in this order: the optimizer plan (what the
factory builds, and so how the distributed optimizer shards: checked before anything
else); the process groups; this
rank's chunks, bound (copies of the Program's chunk graphs whose tensor-parallel
parameters are materialised as this rank's shards, and whose symbolic group names and
param-gather markers point at this rank's objects); the data-parallel gradient buffers;
the optimizer with its fp32 masters; the loss scaler and lr scheduler; the schedule; and
the executor. Everything a step needs is in the returned ``RankContext``; nothing is
global.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn

from fxmeg import program as prog
from fxmeg.config import EngineConfig
from fxmeg.loss_scale import LossScaler
from fxmeg.lr_schedule import ParamScheduler
from fxmeg.program import Program
from fxmeg.runtime import collectives, schedules
from fxmeg.runtime.ddp import DataParallel, Events, GradBuffer
from fxmeg.runtime.executor import Executor
from fxmeg.runtime.groups import Groups, Topology, build_groups
from fxmeg.runtime.optimizer import (
    FullSource,
    MasterSource,
    Optimizer,
    OptimizerFactory,
    default_optimizer,
    param_groups,
    plan_optimizers,
)
from fxmeg.sharding import local_range, tp_shard
from fxmeg.trace import Tracer


@dataclass(frozen=True)
class AuxLoss:
    """An auxiliary loss's gradient weight, set before every step (runtime/step.py)."""

    scale: torch.Tensor
    """The weight buffer of this rank's bound chunk graph."""
    counter: fx.GraphModule
    """num_tokens of a micro-batch from the chunk's data inputs."""
    data_inputs: tuple[int, ...]


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
    grad_reductions: list[tuple[nn.Parameter, dist.ProcessGroup | None]]
    """Gradients all-reduced at finalize, in the same order on every rank: weights held
    by several pipeline ranks (tied), then tp-replicated weights whose gradient differs
    per tp rank (norms under sequence parallelism)."""
    optimizer: Optimizer
    scaler: LossScaler | None
    scheduler: ParamScheduler | None
    executor: Executor
    aux: AuxLoss | None
    lower: schedules.Lowering
    schedule: schedules.Schedule = field(init=False)
    """Compute actions per pipeline rank for the current micro-batch count."""
    steps: list[schedules.Step] = field(init=False)
    """This rank's lowered training steps."""
    consecutive_skips: int = 0

    def __post_init__(self) -> None:
        self.set_global_batch_size(self.config.global_batch_size)

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Train the next steps on global batches of this size: validated like the
        first one (EngineConfig), the schedule is rebuilt for the new micro-batch count."""
        self.config = dataclasses.replace(self.config, global_batch_size=global_batch_size)
        self.schedule = self.build_schedule(self.config.num_microbatches)
        self.steps = self.lower(self.schedule)[self.groups.pp_rank]

    def build_schedule(self, m: int) -> schedules.Schedule:
        par = self.config.parallel
        return schedules.build(par.resolved_schedule, pp=par.pp, vpp=par.vpp, m=m)


def build_context(
    program: Program, config: EngineConfig | None = None, *, optimizer: OptimizerFactory | None = None
) -> RankContext:
    """This rank's runtime for ``program`` (collective: every rank calls it)."""
    config = config or program.config
    par = config.parallel
    factory = optimizer or default_optimizer
    template = param_groups(program.parameters.items())  # the whole model's groups, on every rank
    plan = plan_optimizers(factory, template, program.device)
    sharding = plan.sharding(config.distributed_optimizer, config.optimizer_sharding,
                             overlap_param_gather=config.overlap_param_gather)
    tied = sorted({frozenset(r) for r in program.holders.values() if len(r) > 1}, key=sorted)
    groups = build_groups(Topology(tp=par.tp, pp=par.pp, dp=par.dp), tied=tied, timeout_s=config.comm_timeout_s)
    chunks = _materialise(program, groups)
    named = {n: p for gm in chunks.values() for n, p in gm.named_parameters() if p.requires_grad}
    tracer = Tracer()
    ddp = _data_parallel(program, config, chunks, groups, tracer, shard=sharding == "elementwise")
    names = {"tp": groups.tp.group_name} if groups.tp is not None else {}
    for gm in chunks.values():
        collectives.bind(gm, names, wait_param_gather=ddp.wait_param_gather)
    opt = Optimizer(
        named, ddp, factory, groups=groups, holders=program.holders, template=template, plan=plan,
        sharding=sharding, tp_specs=program.tp_specs, overlap_param_gather=config.overlap_param_gather,
        clip_grad=config.clip_grad, fp32_source=_master_source(program, groups),
        full_source=_full_source(program),
        check_nonfinite=config.check_for_nan_in_grad or config.precision == "fp16",
        raise_on_nonfinite=config.on_nonfinite == "raise" and config.precision != "fp16",
        max_grad_norm=config.skip_on_grad_norm_above,
    )
    executor = Executor(
        chunks, specs={c: program.specs[c] for c in chunks}, rank=groups.rank, pp=par.pp,
        peer=groups.pp_peer, group=groups.pp, device=program.device, timeout_s=config.comm_timeout_s,
        compile=config.compile, on_grad_sync=ddp.start_sync, tracer=tracer,
    )
    return RankContext(
        config=config, groups=groups, chunks=chunks, named_parameters=named, device=program.device,
        tracer=tracer, ddp=ddp, grad_reductions=_grad_reductions(program, named, groups),
        optimizer=opt,
        scaler=LossScaler(config.loss_scale) if config.precision == "fp16" else None,
        scheduler=ParamScheduler(config.lr_schedule, opt.inner) if config.lr_schedule else None,
        executor=executor, aux=_aux_loss(program, chunks), lower=_lowering(program, config, groups),
    )


def _materialise(program: Program, groups: Groups) -> dict[int, fx.GraphModule]:
    """Copies of this pipeline rank's chunk graphs holding this tp rank's parameter
    shards (one tensor per name, shared by every chunk that reads it; unsharded
    parameters and buffers are the user's own)."""
    tp, rank = groups.topo.tp, groups.tp_rank
    memo: dict[int, torch.Tensor] = {}
    mine = program.chunks_of(groups.pp_rank)
    for c in mine:
        for name, p in program.chunks[c].named_parameters():
            spec = program.tp_specs.get(name)
            if id(p) not in memo and spec is not None and spec[0] == "shard":
                memo[id(p)] = nn.Parameter(tp_shard(p, spec, tp, rank), requires_grad=p.requires_grad)
    for c in mine:
        for t in (*program.chunks[c].parameters(), *program.chunks[c].buffers()):
            memo.setdefault(id(t), t)
    return {c: copy.deepcopy(program.chunks[c], memo) for c in mine}


def _master_source(program: Program, groups: Groups) -> MasterSource | None:
    """Half precision: reads the fp32 master of elements [lo, hi) of this rank's shard of a
    parameter straight from the user's fp32 tensor (only what the rank updates is made)."""
    if not program.master_values:
        return None
    tp, rank = groups.topo.tp, groups.tp_rank

    def source(name: str, lo: int, hi: int) -> torch.Tensor:
        spec = program.tp_specs.get(name)
        return local_range(program.master_values[name], spec, tp, rank, lo, hi, torch.float32)

    return source


def _full_source(program: Program) -> FullSource | None:
    """Half precision: a parameter's full fp32 master from the user's fp32 tensor (a full
    matrix stepped by an optimizer that needs the whole shape)."""
    if not program.master_values:
        return None
    return lambda name: program.master_values[name].detach().float().clone()


def _data_parallel(program: Program, config: EngineConfig, chunks, groups: Groups, tracer: Tracer, *,
                   shard: bool) -> DataParallel:
    events = Events()
    deferred = frozenset(n for n, h in program.holders.items() if len(h) > 1)
    buffers = {
        c: [
            GradBuffer(layout, dict(gm.named_parameters()), label=f"chunk{c}", group=groups.dp,
                       overlap=config.overlap_grad_reduce, shard=shard,
                       events=events, deferred=deferred, tracer=tracer)
            for layout in program.buffers[c]
        ]
        for c, gm in chunks.items()
    }
    return DataParallel(buffers, events)


def _grad_reductions(program: Program, named: dict[str, nn.Parameter], groups: Groups) -> list:
    names = sorted(named)  # every holder issues these all-reduces in the same order
    tied = [(named[n], groups.tied[frozenset(program.holders[n])]) for n in names if len(program.holders[n]) > 1]
    replicated = [(named[n], groups.tp) for n in names if program.tp_specs.get(n) == ("replicate", True)]
    return tied + replicated


def _aux_loss(program: Program, chunks: dict[int, fx.GraphModule]) -> AuxLoss | None:
    """The bound chunk's own weight buffer (a fresh one: the Program's stays untouched)."""
    if program.aux_scale is None or program.aux_scale[0] not in chunks:
        return None
    c, name = program.aux_scale
    gm = chunks[c]
    gm.register_buffer(name, torch.zeros_like(gm.get_buffer(name)))
    return AuxLoss(gm.get_buffer(name), prog.token_counter(gm), program.specs[c].data_inputs)


def _lowering(program: Program, config: EngineConfig, groups: Groups) -> schedules.Lowering:
    grad_cuts = program.grad_cuts
    p2p = config.p2p
    if p2p == "auto":
        nccl = groups.pp is not None and dist.get_backend(groups.pp) == "nccl"
        p2p = "paired" if nccl else "eager"
    num_chunks = program.num_chunks
    return lambda schedule: schedules.lower(schedule, num_chunks=num_chunks, grad_cuts=grad_cuts, p2p=p2p)
