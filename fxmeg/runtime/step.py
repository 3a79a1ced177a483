"""One training or evaluation step on this rank (docs/megatron-semantics.md §1): micro-batches
through the schedule, the token-weighted loss reduced, gradients finalized, the optimizer step
with its skip decisions, the loss scaler and the lr schedule advanced.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxmeg.errors import FxmegError
from fxmeg.ir.program import Program
from fxmeg.runtime.batches import Batch, UserBatch, microbatches, positional
from fxmeg.runtime.context import RankContext
from fxmeg.runtime.data_parallel import replicas
from fxmeg.runtime.data_parallel.ddp import finalize_model_grads
from fxmeg.runtime.expert_load import load_imbalance
from fxmeg.runtime.groups import all_reduce
from fxmeg.runtime.optimizer.optimizer import StepOutcome
from fxmeg.runtime.pipeline.schedules import forward_only
from fxmeg.runtime.state import gather_full_grads


@dataclass(frozen=True)
class StepResult:
    """The outcome of one optimizer step; identical on every rank."""

    loss: float
    """Token-weighted mean loss over the global batch: sum(loss_sum) / sum(num_tokens)."""
    num_tokens: int
    """Tokens that counted towards the loss (labels not ignored) in the global batch."""
    grad_norm: float | None
    """Global L2 norm of the gradients before clipping; None for a skipped step."""
    skipped: bool
    """True when the update was skipped (parameters and optimizer state untouched)."""
    lr: float
    """Learning rate the step used (first parameter group)."""
    skip_reason: str | None = None
    """Why the step was skipped: 'nonfinite' (inf / NaN gradient) or 'grad_norm'."""
    rerun_mismatch: bool | None = None
    """With check_determinism: whether a second forward / backward differed."""
    grads: Mapping[str, torch.Tensor] | None = None
    """With ``full_grads``: every parameter's gradient of the step, whole, in fp32, by every
    name of the user's model (tied ones under each), as reduced over the global batch and
    divided by its token count, before clipping: what ``param.grad`` holds in plain PyTorch
    after ``loss.backward()``. Parameters no chunk reads have none (PyTorch: None)."""
    expert_load: Mapping[str, tuple[int, ...]] | None = None
    """Tokens per expert of each routed-experts layer (its experts module's FQN) over the
    global batch: the (token, slot) pairs its router sent to each expert
    (runtime/expert_load.py); None for a model without any (or under compile / zero bubble)."""

    @property
    def load_imbalance(self) -> dict[str, float]:
        """max / mean tokens per expert of each layer (1: balanced; Megatron's figure)."""
        return {layer: load_imbalance(c) for layer, c in (self.expert_load or {}).items()}


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Token-weighted mean loss over the batch."""
    num_tokens: int


def train_step(
    program: Program, ctx: RankContext, batch: UserBatch | Iterator[UserBatch] | None, *,
    check_determinism: bool = False, trace: bool = False, full_grads: bool = False,
) -> StepResult:
    """One optimizer step (see ``fxmeg.Engine.train_step``)."""
    interval = ctx.config.data_parallel.check_replicas_interval
    if interval and ctx.steps_taken % interval == 0:
        check_replicas(program, ctx)
    ctx.steps_taken += 1
    ctx.tracer.begin_step(trace)
    step_start = time.perf_counter_ns()
    mbs = microbatches(program, ctx, batch, ctx.config.num_microbatches)
    mismatch = None
    if check_determinism:
        first = forward_backward(program, ctx, mbs)
        ctx.experts.drops.reset()  # the step's drops are counted once
        grads = [b.reduced().clone() for b in ctx.ddp.all()]
    loss_sum, num_tokens = forward_backward(program, ctx, mbs)
    if ctx.config.moe.moe_capacity_factor is not None:
        ctx.experts.drops.log(f"train step {ctx.steps_taken}")
    if check_determinism:
        same = (loss_sum, num_tokens) == first and all(
            torch.equal(g, b.reduced()) for g, b in zip(grads, ctx.ddp.all())
        )
        mismatch = _any_rank(not same, ctx)
    grads = None
    # before the optimizer clips them (in place, and only in the pieces it updates here)
    if full_grads:
        grads = {alias: g for name, g in gather_full_grads(program, ctx).items()
                 for alias in program.aliases.get(name, (name,))}
    lr = float(ctx.optimizer.param_groups[0]["lr"])
    with ctx.tracer.span("optimizer", "optimizer"):
        outcome = ctx.optimizer.step()
    if ctx.scaler is not None:
        ctx.scaler.update(found_inf=outcome.skip_reason == "nonfinite")
    if ctx.scheduler is not None and not outcome.skipped:
        ctx.scheduler.step(ctx.config.global_batch_size)
    _count_skips(ctx, outcome)
    load = _expert_load(ctx)
    ctx.tracer.add("step", "step", step_start, time.perf_counter_ns())
    return StepResult(
        loss=loss_sum / max(num_tokens, 1.0), num_tokens=int(num_tokens),
        grad_norm=outcome.grad_norm, skipped=outcome.skipped, lr=lr,
        skip_reason=outcome.skip_reason, rerun_mismatch=mismatch, grads=grads, expert_load=load,
    )


def _expert_load(ctx: RankContext) -> dict[str, tuple[int, ...]] | None:
    """The step's tokens per expert, reduced over every rank; with
    ``moe_router_bias_update_rate`` each router's expert bias moved by them (after the
    optimizer step, skipped or not: the counts measure this step's routing, as
    Megatron's update in finalize_model_grads)."""
    if ctx.load is None:
        return None
    counts = ctx.load.reduce(ctx.groups)
    if ctx.config.moe.moe_router_bias_update_rate:
        ctx.load.update_biases(ctx.config.moe.moe_router_bias_update_rate)
    return counts


def check_replicas(program: Program, ctx: RankContext) -> None:
    """Raise ReplicaError on every rank when replicas no longer hold the same parameters
    (before a step: a drifted replica trains no further). Collective."""
    ctx.ddp.wait_for_params()  # overlap_param_gather: the last step's gathers may be in flight
    with ctx.unsharded():
        replicas.agree(program, ctx.groups, replicas.now(program, ctx.named_parameters, ctx.chunks),
                       device=ctx.device, step=ctx.steps_taken + 1)


@torch.no_grad()
def eval_step(
    program: Program, ctx: RankContext, batch: UserBatch | Iterator[UserBatch] | None, *,
    num_microbatches: int | None = None
) -> EvalResult:
    """Forward-only pass over a batch (see ``fxmeg.Engine.eval_step``)."""
    per_mb = ctx.config.micro_batch_size * ctx.config.parallel.dp
    if num_microbatches is None and isinstance(batch, (tuple, Mapping)):
        num_microbatches = positional(program, batch, what="batch")[0].shape[0] // per_mb
    m = num_microbatches or ctx.config.num_microbatches
    mbs = microbatches(program, ctx, batch, m)
    steps = ctx.lower(forward_only(ctx.build_schedule(m)))[ctx.groups.pp_rank]
    stats = ctx.executor.run(steps, mbs, train=False)
    if ctx.config.moe.moe_capacity_factor is not None:
        ctx.experts.drops.log("eval step")
    loss_sum, num_tokens = _reduce_stats(ctx, stats)
    return EvalResult(loss=loss_sum / max(num_tokens, 1.0), num_tokens=int(num_tokens))


def forward_backward(program: Program, ctx: RankContext, mbs: list[Batch]) -> tuple[float, float]:
    """All micro-batches through the schedule, gradients reduced and finalized; the
    global (loss_sum, num_tokens)."""
    ctx.ddp.zero_grad_buffer()
    if ctx.load is not None:
        # each forward_backward counts its micro-batches afresh (check_determinism runs two)
        ctx.load.reset()
    if ctx.global_tokens is not None:
        ctx.global_tokens.reset()  # global_aux_loss: a running mean over this step's micro-batches
    if ctx.aux is not None:
        weigh_aux_loss(ctx, mbs)
    scale = ctx.scaler.scale if ctx.scaler is not None else 1.0
    stats = ctx.executor.run(ctx.steps, mbs, train=True, loss_scale=scale,
                             units=ctx.schedule[ctx.groups.pp_rank])
    with ctx.tracer.span("finalize", "finalize"):
        loss_sum, num_tokens = _reduce_stats(ctx, stats)
        finalize_model_grads(ctx.ddp, ctx.grad_reductions, max(num_tokens, 1.0) * scale)
    return loss_sum, num_tokens


def weigh_aux_loss(ctx: RankContext, mbs: list[Batch]) -> None:
    """Each micro-batch's auxiliary loss enters the gradients with weight 1 / (m * dp)
    (Megatron's AutoScaler, averaged over the global batch's micro-batches). Gradients
    are divided by the global token count N at finalize, so its gradient carries
    N / (m * dp); N is counted from the labels before the step."""
    aux = ctx.aux
    local = sum(float(aux.counter(*[mb[i] for i in aux.data_inputs])) for mb in mbs)
    total = torch.tensor([local], dtype=torch.float64, device=ctx.device)
    all_reduce(total, ctx.groups.dp_cp)
    m, dp = ctx.config.num_microbatches, ctx.config.parallel.dp
    aux.scale.fill_(max(float(total), 1.0) / (m * dp))


def _reduce_stats(ctx: RankContext, stats: torch.Tensor) -> tuple[float, float]:
    """Sum (loss_sum, num_tokens) over the last pipeline stage and all dp x cp ranks
    (each cp rank holds the sums over its part of every sequence; Megatron: the
    data-parallel group with context parallel)."""
    all_reduce(stats, ctx.groups.pp)  # only the last stage contributes
    all_reduce(stats, ctx.groups.dp_cp)
    return float(stats[0]), float(stats[1])


def _any_rank(flag: bool, ctx: RankContext) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    all_reduce(t, ctx.groups.world, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _count_skips(ctx: RankContext, outcome: StepOutcome) -> None:
    ctx.consecutive_skips = ctx.consecutive_skips + 1 if outcome.skipped else 0
    limit = ctx.config.guards.max_consecutive_skips
    if limit and ctx.consecutive_skips >= limit:
        raise FxmegError(
            f"{ctx.consecutive_skips} steps in a row were skipped (last: "
            f"{outcome.skip_reason}); the run is not recovering. Lower the learning rate, "
            "check the data, or raise max_consecutive_skips"
        )
