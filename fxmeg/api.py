"""Public entry points: ``parallelize`` and the engine it returns."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from fxmeg import ops, program
from fxmeg.capture import LossFn, capture
from fxmeg.checkpoint import gather_full_state
from fxmeg.collectives import TP, bind_groups
from fxmeg.config import EngineConfig, ParallelConfig, batch_dim, resolve_dp
from fxmeg.errors import BatchError, ConfigError, FxmegError, closest
from fxmeg.partition import Partition, node_flops, partition
from fxmeg.passes.buckets import buckets as buckets_pass
from fxmeg.passes.loss import loss as loss_pass
from fxmeg.passes.param_gather import param_gather as param_gather_pass
from fxmeg.passes.tensor_parallel import tensor_parallel as tp_pass
from fxmeg.passes.pipeline import pipeline as pipeline_pass
from fxmeg.passes.recompute import recompute as recompute_pass
from fxmeg.runtime import schedules
from fxmeg.runtime.ddp import DataParallel, Events, GradBuffer, finalize_model_grads
from fxmeg.runtime.executor import Executor
from fxmeg.runtime.groups import Groups, Topology, all_reduce, build_groups
from fxmeg.runtime.loss_scale import LossScaleConfig, LossScaler
from fxmeg.runtime.lr_schedule import LRSchedule, ParamScheduler
from fxmeg.runtime.optimizer import Optimizer, OptimizerFactory, default_optimizer
from fxmeg.trace import Tracer


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


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Token-weighted mean loss over the batch."""
    num_tokens: int


Batch = tuple[torch.Tensor, ...]


def parallelize(
    model: nn.Module,
    example_inputs: Batch,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    dp: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    schedule: str = "auto",
    split_points: Iterable[str] | None = None,
    sequence_parallel: bool = False,
    tp_plan: dict[str, str] | None = None,
    optimizer: OptimizerFactory | None = None,
    precision: str = "fp32",
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = True,
    bucket_size: int | None = None,
    distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    loss_scale: LossScaleConfig | None = None,
    lr_schedule: LRSchedule | None = None,
    loss_fn: LossFn | None = None,
    **options,
) -> Engine:
    """Capture ``model`` on one example micro-batch and return an engine that trains it
    with Megatron-LM's semantics on this process's rank.

    ``example_inputs`` is one micro-batch, e.g. ``(input_ids, labels)``; the model returns
    its mean loss (or pass ``loss_fn(model, *batch) -> (loss_sum, num_tokens)``).
    ``optimizer`` is a factory receiving parameter groups (see
    ``fxmeg.runtime.optimizer.param_groups``); default AdamW. All checks that can fail on
    user input run before any process-group work.

    With ``precision`` "bf16" or "fp16" the model's parameters and floating buffers are
    cast in place (as Megatron's Float16Module), so pass the model in fp32: the fp32
    masters start from those values.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = resolve_dp(world, tp, pp, dp)
    parallel = ParallelConfig(
        tp=tp, pp=pp, vpp=vpp, dp=dp, schedule=schedule,
        split_points=tuple(split_points) if split_points is not None else None,
        sequence_parallel=sequence_parallel, tp_plan=tuple((tp_plan or {}).items()),
    )
    mbs = batch_dim(example_inputs, micro_batch_size)
    config = EngineConfig(
        micro_batch_size=mbs,
        global_batch_size=global_batch_size or mbs * dp,
        parallel=parallel,
        clip_grad=clip_grad,
        precision=precision,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
        loss_scale=loss_scale or LossScaleConfig(),
        lr_schedule=lr_schedule,
        **_engine_options(options),
    )
    fp32_values = None
    if config.dtype != torch.float32:
        fp32_values = {n: p.detach().clone() for n, p in model.named_parameters()}
        model.to(config.dtype)  # parameters and floating buffers, in place
        example_inputs = _cast(example_inputs, config.dtype)
    full_shapes = {k: (t.shape, t.dtype) for k, t in model.state_dict().items()}
    captured = capture(model, example_inputs, loss_fn=loss_fn)
    gm = loss_pass(captured.gm, explicit=captured.explicit_loss)
    flops = sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")
    checks = program.value_checks(gm)
    tp_rank = Topology(tp=tp, pp=pp, dp=dp).coords(dist.get_rank() if world > 1 else 0)[0]
    gm = tp_pass(gm, tp=tp, rank=tp_rank, plan=dict(parallel.tp_plan),
                 sequence_parallel=sequence_parallel)
    split = partition(gm, num_chunks=parallel.num_chunks, split_points=parallel.split_points)
    parent = pipeline_pass(gm, num_chunks=parallel.num_chunks)
    for chunk in program.chunks(parent):
        recompute_pass(chunk, granularity=config.recompute, num_layers=config.recompute_num_layers)
    parent = buckets_pass(
        parent, pp=pp, dp=dp, bucket_size=config.resolved_bucket_size,
        shard=config.distributed_optimizer,
    )
    if config.overlap_param_gather:
        parent = param_gather_pass(parent)
    compute = schedules.build(
        parallel.resolved_schedule, pp=pp, vpp=vpp, m=config.num_microbatches
    )
    return Engine(
        model=model,
        config=config,
        parent=parent,
        partition=split,
        compute=compute,
        example_inputs=example_inputs,
        input_names=captured.input_names,
        aliases=captured.aliases,
        optimizer=optimizer or default_optimizer,
        fp32_values=fp32_values,
        full_shapes=full_shapes,
        flops_per_microbatch=flops,
        value_checks=checks,
    )


class Engine:
    """Trains this rank's chunks of a captured model; built by ``parallelize``."""

    def __init__(
        self,
        *,
        model: nn.Module,
        config: EngineConfig,
        parent: fx.GraphModule,
        partition: Partition,
        compute: schedules.Schedule,
        example_inputs: Batch,
        input_names: list[str],
        aliases: dict[str, list[str]],
        optimizer: OptimizerFactory,
        fp32_values: dict[str, torch.Tensor] | None,
        full_shapes: dict[str, tuple[torch.Size, torch.dtype]],
        flops_per_microbatch: float,
        value_checks: list[program.ValueCheck] = (),
    ) -> None:
        par = config.parallel
        self.config, self.partition, self.parent = config, partition, parent
        self.model, self.aliases, self._input_names = model, aliases, input_names
        self.full_shapes = full_shapes
        self.flops_per_microbatch = flops_per_microbatch
        self._value_checks = value_checks
        """Forward FLOPs of the whole model on one micro-batch (matmuls and attention)."""
        self._example = example_inputs
        all_chunks = program.chunks(parent)
        self.holders = program.holders(all_chunks, par.pp)
        tied = sorted({frozenset(r) for r in self.holders.values() if len(r) > 1}, key=sorted)
        self.groups: Groups = build_groups(Topology(tp=par.tp, pp=par.pp, dp=par.dp), tied=tied,
                                           timeout_s=config.comm_timeout_s)
        pp_rank = self.groups.pp_rank
        self.chunks = {c: gm for c, gm in enumerate(all_chunks) if c % par.pp == pp_rank}
        if self.groups.tp is not None:
            for gm in self.chunks.values():
                bind_groups(gm, {TP: self.groups.tp.group_name})
        self.tp_specs = program.tp_specs(self.chunks.values())
        self.named_parameters = program.unique_parameters(self.chunks.values())
        self.device = _device(self.named_parameters, example_inputs)
        self.tracer = Tracer()
        self.ddp = self._data_parallel()
        self._tied = [  # sorted: every holder issues these all-reduces in the same order
            (self.named_parameters[n], self.groups.tied[frozenset(self.holders[n])])
            for n in sorted(self.named_parameters) if len(self.holders[n]) > 1
        ] + [  # replicated over tp ranks but with per-rank gradients (sequence parallelism)
            (self.named_parameters[n], self.groups.tp)
            for n in sorted(self.named_parameters) if self.tp_specs.get(n) == ("replicate", True)
        ]
        self.optimizer = Optimizer(
            self.named_parameters, self.ddp, optimizer, groups=self.groups,
            holders=self.holders, distributed=config.distributed_optimizer,
            overlap_param_gather=config.overlap_param_gather,
            tp_sharded={n for n, spec in self.tp_specs.items() if spec[0] == "shard"},
            clip_grad=config.clip_grad, fp32_values=fp32_values,
            check_nonfinite=config.check_for_nan_in_grad or config.precision == "fp16",
            raise_on_nonfinite=config.on_nonfinite == "raise" and config.precision != "fp16",
            max_grad_norm=config.skip_on_grad_norm_above,
        )
        self.scaler = LossScaler(config.loss_scale) if config.precision == "fp16" else None
        self.scheduler = (
            ParamScheduler(config.lr_schedule, self.optimizer.inner) if config.lr_schedule else None
        )
        self._compute = compute
        grad_cuts = frozenset(
            c for c, gm in enumerate(all_chunks[1:]) if any(b.grad for b in program.chunk_spec(gm).recv)
        )
        p2p = config.p2p
        if p2p == "auto":
            p2p = "paired" if self.groups.pp is not None and dist.get_backend(self.groups.pp) == "nccl" else "eager"
        self._lower = lambda sched: schedules.lower(sched, num_chunks=par.num_chunks, grad_cuts=grad_cuts, p2p=p2p)
        self._train_steps = self._lower(compute)[pp_rank]
        self.executor = Executor(
            self.chunks, rank=self.groups.rank, pp=par.pp, peer=self.groups.pp_peer,
            group=self.groups.pp, device=self.device, timeout_s=config.comm_timeout_s, compile=config.compile,
        )
        self.executor.on_grad_sync = self.ddp.start_sync
        self.executor.tracer = self.tracer
        self.consecutive_skips = 0
        self._aux = next(((gm, program.token_counter(gm)) for gm in self.chunks.values()
                          if hasattr(gm, ops.AUX_SCALE)), None)

    def _data_parallel(self) -> DataParallel:
        events = Events()
        buffers = {
            c: [
                GradBuffer(layout, dict(gm.named_parameters()), label=f"chunk{c}",
                           group=self.groups.dp, overlap=self.config.overlap_grad_reduce,
                           shard=self.config.distributed_optimizer, events=events,
                           deferred=frozenset(n for n, h in self.holders.items() if len(h) > 1),
                           tracer=self.tracer)
                for layout in program.buffer_layouts(gm)
            ]
            for c, gm in self.chunks.items()
        }
        return DataParallel(buffers, events)

    # ------------------------------------------------------------ training

    @property
    def needs_data(self) -> bool:
        """Whether this rank's chunks read inputs; middle pipeline stages may pass None."""
        return any(program.chunk_spec(gm).data_inputs for gm in self.chunks.values())

    @property
    def model_flops_per_step(self) -> float:
        """Model FLOPs of one step over all ranks: 3 x forward (backward ~ 2 x) for
        every micro-batch of every data-parallel replica."""
        return 3.0 * self.flops_per_microbatch * self.config.num_microbatches * self.config.parallel.dp

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Train the next steps on global batches of this size (a batch-size schedule):
        validated like the initial one, the schedule is rebuilt for the new m."""
        config = dataclasses.replace(self.config, global_batch_size=global_batch_size)
        par = config.parallel
        compute = schedules.build(par.resolved_schedule, pp=par.pp, vpp=par.vpp, m=config.num_microbatches)
        self.config, self._compute = config, compute
        self._train_steps = self._lower(compute)[self.groups.pp_rank]

    def params_norm(self) -> float:
        """L2 norm of all parameters (each element once). Collective."""
        self.ddp.wait_for_params()
        return self.optimizer.global_norm("master")

    def train_step(
        self, batch: Batch | Iterator[Batch] | None, *, check_determinism: bool = False, trace: bool = False
    ) -> StepResult:
        """One optimizer step on a global batch (tensors shaped [global_batch_size, ...],
        the same on every rank) or an iterator over this rank's micro-batches.

        ``check_determinism`` runs forward and backward twice on the batch (Megatron's
        rerun idea) and reports in ``rerun_mismatch`` whether loss or any reduced gradient
        differed; the step then uses the second run. ``trace`` records this step's
        timeline in ``self.tracer.events`` (see fxmeg.trace)."""
        self.tracer.begin_step(trace)
        step_start = time.perf_counter_ns()
        mbs = self._microbatches(batch, self.config.num_microbatches)
        mismatch = None
        if check_determinism:
            first = self._forward_backward(mbs)
            grads = [b.data.clone() for b in self.ddp.all()]
        loss_sum, num_tokens = self._forward_backward(mbs)
        if check_determinism:
            same = (loss_sum, num_tokens) == first and all(
                torch.equal(g, b.data) for g, b in zip(grads, self.ddp.all()))
            flag = torch.tensor([0.0 if same else 1.0], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mismatch = bool(flag.item())
        lr = float(self.optimizer.param_groups[0]["lr"])
        with self.tracer.span("optimizer", "optimizer"):
            outcome = self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(found_inf=outcome.skip_reason == "nonfinite")
        if self.scheduler is not None and not outcome.skipped:
            self.scheduler.step(self.config.global_batch_size)
        self._count_skips(outcome)
        self.tracer.add("step", "step", step_start, time.perf_counter_ns())
        return StepResult(
            loss=loss_sum / max(num_tokens, 1.0), num_tokens=int(num_tokens),
            grad_norm=outcome.grad_norm, skipped=outcome.skipped, lr=lr,
            skip_reason=outcome.skip_reason, rerun_mismatch=mismatch,
        )

    def _forward_backward(self, mbs: list[Batch]) -> tuple[float, float]:
        """All micro-batches through the schedule, gradients reduced and finalized;
        the global (loss_sum, num_tokens)."""
        self.ddp.zero_grad_buffer()
        if self._aux is not None:
            self._weigh_aux_loss(mbs)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        stats = self.executor.run(self._train_steps, mbs, train=True, loss_scale=scale)
        with self.tracer.span("finalize", "finalize"):
            loss_sum, num_tokens = self._reduce_stats(stats)
            finalize_model_grads(self.ddp, self._tied, max(num_tokens, 1.0) * scale)
        return loss_sum, num_tokens

    def _count_skips(self, outcome) -> None:
        self.consecutive_skips = self.consecutive_skips + 1 if outcome.skipped else 0
        limit = self.config.max_consecutive_skips
        if limit and self.consecutive_skips >= limit:
            raise FxmegError(
                f"{self.consecutive_skips} steps in a row were skipped (last: "
                f"{outcome.skip_reason}); the run is not recovering. Lower the learning rate, "
                "check the data, or raise max_consecutive_skips"
            )

    def _weigh_aux_loss(self, mbs: list[Batch]) -> None:
        """Each micro-batch's auxiliary loss enters the gradients with weight 1 / (m * dp)
        (Megatron's AutoScaler, averaged over the global batch's micro-batches). Gradients
        are divided by the global token count N at finalize, so its gradient carries
        N / (m * dp); N is counted from the labels before the step."""
        gm, counter = self._aux
        spec = program.chunk_spec(gm)
        local = sum(float(counter(*[mb[i] for i in spec.data_inputs])) for mb in mbs)
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        all_reduce(total, self.groups.dp)
        m, dp = self.config.num_microbatches, self.config.parallel.dp
        getattr(gm, ops.AUX_SCALE).fill_(max(float(total), 1.0) / (m * dp))

    @torch.no_grad()
    def eval_step(self, batch: Batch | Iterator[Batch] | None, *, num_microbatches: int | None = None) -> EvalResult:
        """Forward-only pass over a batch (any multiple of micro_batch_size * dp samples);
        token-weighted loss. Ranks that read no data pass None and num_microbatches."""
        per_mb = self.config.micro_batch_size * self.config.parallel.dp
        m = num_microbatches or (
            batch[0].shape[0] // per_mb if isinstance(batch, tuple) else self.config.num_microbatches
        )
        mbs = self._microbatches(batch, m)
        par = self.config.parallel
        compute = schedules.build(par.resolved_schedule, pp=par.pp, vpp=par.vpp, m=m)
        steps = self._lower(schedules.forward_only(compute))[self.groups.pp_rank]
        stats = self.executor.run(steps, mbs, train=False)
        loss_sum, num_tokens = self._reduce_stats(stats)
        return EvalResult(loss=loss_sum / max(num_tokens, 1.0), num_tokens=int(num_tokens))

    def _reduce_stats(self, stats: torch.Tensor) -> tuple[float, float]:
        """Sum (loss_sum, num_tokens) over the last pipeline stage and all DP ranks."""
        all_reduce(stats, self.groups.pp)  # only the last stage contributes
        all_reduce(stats, self.groups.dp)
        return float(stats[0]), float(stats[1])

    # ------------------------------------------------------------ batches

    def _microbatches(self, batch: Batch | Iterator[Batch], m: int) -> list[Batch]:
        mbs, dp = self.config.micro_batch_size, self.config.parallel.dp
        if batch is None:
            if self.needs_data:
                raise BatchError("this rank's pipeline chunks read inputs: pass the batch, not None")
            return [()] * m
        if isinstance(batch, tuple):
            self._check(batch, rows=m * mbs * dp, what="global batch")
            self._check_values(batch, "global batch")
            r = self.groups.dp_rank
            rows = [slice((i * dp + r) * mbs, (i * dp + r + 1) * mbs) for i in range(m)]
            out = [tuple(t[s] for t in batch) for s in rows]
        else:
            out = [next(batch) for _ in range(m)]
            for mb in out:
                self._check(mb, rows=mbs, what="micro-batch")
                self._check_values(mb, "micro-batch")
        return [_cast(tuple(t.to(self.device, non_blocking=True) for t in mb), self.config.dtype) for mb in out]

    def _check(self, batch: Batch, *, rows: int, what: str) -> None:
        if not isinstance(batch, tuple) or len(batch) != len(self._example):
            raise BatchError(
                f"a {what} must be a tuple of {len(self._example)} tensors "
                f"({', '.join(self._input_names)}), like the example inputs"
            )
        for name, t, ex in zip(self._input_names, batch, self._example):
            want = (rows, *ex.shape[1:])
            same_kind = t.dtype == ex.dtype or (t.is_floating_point() and ex.is_floating_point())
            if tuple(t.shape) != want or not same_kind:
                raise BatchError(
                    f"{what} input {name!r} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                    f"expected {want} and {ex.dtype} (the example micro-batch's shape with "
                    f"{rows} rows = micro_batch_size x dp x micro-batches)"
                )

    def _check_values(self, batch: Batch, what: str) -> None:
        """Labels inside the loss's classes and token ids inside their embedding, checked
        on every rank that has the batch, before any communication: out of range they
        would fail deep in one stage's forward while the other ranks wait."""
        for c in self._value_checks:
            t = batch[c.index]
            bad = (t >= c.high) | ((t < 0) & (t != c.ignore) if c.ignore is not None else (t < 0))
            if bool(bad.any()):
                where = tuple(int(i) for i in bad.nonzero()[0])
                allowed = f"0..{c.high - 1}" + (f" or {c.ignore}" if c.ignore is not None else "")
                raise BatchError(
                    f"{what} input {self._input_names[c.index]!r} holds {int(t[where])} at "
                    f"{where}: {c.what} must be in {allowed}; check the tokenizer's vocabulary "
                    f"against the model's ({c.high})"
                )

    # ------------------------------------------------------------ state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The user model's state_dict (every name, tied ones included) with this
        engine's current values, gathered on every rank. Collective: call it on every
        rank."""
        return gather_full_state(self)


def _engine_options(options: dict) -> dict:
    """EngineConfig fields given as keyword options; an unknown name is refused with the
    nearest valid one."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"parallel", "micro_batch_size", "global_batch_size"}
    for name in options:
        if name not in fields:
            raise ConfigError(f"parallelize() got an unknown option {name!r}" + closest(name, sorted(fields)))
    return options


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """Floating inputs in the training dtype; token ids and masks as they are."""
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in batch)


def _device(params: dict[str, nn.Parameter], example: Batch) -> torch.device:
    return next(iter(params.values())).device if params else example[0].device
