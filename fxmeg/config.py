"""Configuration: frozen dataclasses that check themselves before any work starts.

Every field has a one-line docstring; cross-field checks live in ``__post_init__`` and
their messages name the field, the numbers and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fxmeg.errors import ConfigError, closest
from fxmeg.loss_scale import LossScaleConfig
from fxmeg.lr_schedule import LRSchedule
from fxmeg.schedule_registry import (
    SCHEDULES,  # noqa: F401 (read from here too: fxmeg.config.SCHEDULES)
    SPECS,
    Spec,
    batch_refusal,
    layout_refusal,
    placement,
    resolve,
)
from fxmeg.sharding_modes import OptimizerSharding, check_sharding, decide_sharding
from fxmeg.sizes import Size, check_numbers, check_size

GRANULARITIES = ("none", "selective", "full")
"""Activation recompute: nothing, attention cores, or whole blocks."""
P2P_MODES = ("paired", "eager")
"""Where pipeline sends / receives are posted (see EngineConfig.p2p)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOAD_BALANCING = ("aux_loss", "global_aux_loss")
"""How a router loss counts tokens per expert (see EngineConfig.moe_router_load_balancing_type)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks, tensor-parallel fastest (Megatron's order
    tp-cp-dp-pp): rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).

    Experts fold over the data-parallel x context-parallel ranks (Megatron's "parallel
    folding"): the dp * cp ranks of one (tp, pp) coordinate, cp fastest, are cut into
    consecutive runs of ``ep``: q = cp_rank + cp * dp_rank, ep_rank = q % ep, expert-data-
    parallel rank = q // ep (Megatron's expert order tp-ep-dp-pp, with expert tp = tp)."""

    tp: int = 1
    """Tensor-parallel size (ranks that share every layer's weights)."""
    cp: int = 1
    """Context-parallel size (ranks that each hold 1/cp of every sequence's tokens)."""
    pp: int = 1
    """Pipeline-parallel size (ranks that each hold a run of layers)."""
    vpp: int = 1
    """Virtual pipeline chunks per pipeline rank (interleaved, zbv or dualpipev when > 1)."""
    dp: int | None = None
    """Data-parallel size (replicas that each see a slice of the global batch); None =
    world size // (tp * cp * pp), fixed by ``resolve`` when the ranks exist."""
    schedule: str = "auto"
    """'auto', 'none' (pp=1), 'gpipe', '1f1b', 'interleaved' (vpp > 1), or zero bubble:
    'zbh1' (vpp=1), 'zbv' or 'dualpipev' (vpp=2, chunks placed in a V)."""
    split_points: tuple[str, ...] | None = None
    """Pinned chunk starts, e.g. ('layers.2',): pp*vpp - 1 block names; None = balanced."""
    sequence_parallel: bool = False
    """Split the residual stream, norms and dropout along the sequence over tp ranks."""
    tp_plan: tuple[tuple[str, str], ...] = ()
    """Module-FQN glob -> colwise | rowwise | replicate | vocab, overriding the automatic plan."""
    ep: int = 1
    """Expert-parallel size: each layer's routed experts split over ep ranks carved out of
    the dp * cp ranks (must divide dp * cp and every layer's number of experts)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "tp": Size(1, "tensor-parallel size"),
        "cp": Size(1, "context-parallel size"),
        "pp": Size(1, "pipeline-parallel size"),
        "vpp": Size(1, "virtual pipeline size (chunks per pipeline rank)"),
        "dp": Size(1, "data-parallel size", "world size // (tp * cp * pp)"),
        "ep": Size(1, "expert-parallel size (ranks that split each layer's experts)"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if isinstance(self.tp_plan, dict):
            object.__setattr__(self, "tp_plan", tuple(self.tp_plan.items()))
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1")
        refusal = layout_refusal(self.schedule, pp=self.pp, vpp=self.vpp)  # fxmeg/schedule_registry.py
        if refusal:
            raise ConfigError(refusal)
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if self.dp is not None:
            self._check_ep()

    def _check_ep(self) -> None:
        """ep folds over dp * cp: it must divide it (needs dp resolved)."""
        if self.dp_cp % self.ep:
            names = "dp * cp" if self.cp > 1 else "dp"
            sizes = f"{self.dp} * {self.cp} = {self.dp_cp}" if self.cp > 1 else f"{self.dp}"
            raise ConfigError(
                f"ep={self.ep} does not divide {names} = {sizes}: experts are split over ep ranks "
                f"carved out of the data-parallel{' x context-parallel' if self.cp > 1 else ''} ranks; "
                f"choose ep among {[d for d in range(1, self.dp_cp + 1) if self.dp_cp % d == 0]} "
                f"or launch more ranks (`fxmeg train --dp` / --nproc, torchrun --nproc-per-node): "
                f"ep={self.ep} needs dp * cp to be a multiple of {self.ep}")

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts, (dp * cp) / ep."""
        return self.dp_cp // self.ep
    @property
    def model_ranks(self) -> int:
        """Ranks that share one slice of the global batch: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks over which gradients are reduced and the distributed optimizer shards:
        dp * cp (Megatron's data-parallel group with context parallel); needs dp resolved."""
        assert self.dp is not None, "dp is not resolved"
        return self.dp * self.cp

    def resolve(self, world: int) -> ParallelConfig:
        """This layout on ``world`` ranks: dp=None becomes world // (tp * cp * pp); a given
        dp must make tp * cp * pp * dp = world."""
        tp, cp, pp, dp = self.tp, self.cp, self.pp, self.dp
        # the messages name cp only where it is set
        names, sizes = ("tp * cp * pp", f"{tp} * {cp} * {pp}") if cp > 1 else ("tp * pp", f"{tp} * {pp}")
        if dp is None:
            if world % (tp * cp * pp):
                raise ConfigError(
                    f"world size {world} is not divisible by {names} = {sizes}; launch a multiple "
                    f"of {tp * cp * pp} ranks or change {names.replace(' * ', ' / ')}"
                )
            return dataclasses.replace(self, dp=world // (tp * cp * pp))
        if tp * cp * pp * dp != world:
            raise ConfigError(
                f"{names} * dp = {sizes} * {dp} = {tp * cp * pp * dp} does not match the world "
                f"size {world}; launch {tp * cp * pp * dp} ranks or leave dp=None"
            )
        return self

    @property
    def num_chunks(self) -> int:
        """Pipeline chunks in the model: pp * vpp."""
        return self.pp * self.vpp

    @property
    def spec(self) -> Spec:
        """The resolved schedule's row of ``fxmeg.schedule_registry.SPECS``."""
        return SPECS[self.resolved_schedule]

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs backward as separate I and W actions."""
        return self.spec.splits_backward

    @property
    def resolved_schedule(self) -> str:
        """The schedule 'auto' stands for: interleaved if vpp > 1, else 1f1b, else none
        (``fxmeg.schedule_registry.resolve``)."""
        return resolve(self.schedule, pp=self.pp, vpp=self.vpp)

    @property
    def placement(self) -> tuple[int, ...]:
        """The pipeline rank of each chunk under the resolved schedule (``placement``)."""
        return placement(self.resolved_schedule, pp=self.pp, vpp=self.vpp)


@dataclass(frozen=True)
class EngineConfig:
    """Everything ``fxmeg.parallelize`` needs besides the model and the optimizer."""

    micro_batch_size: int
    """Samples in one micro-batch on one rank (the example inputs' batch dimension)."""
    global_batch_size: int
    """Samples in one optimizer step over all data-parallel ranks."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    clip_grad: float = 1.0
    """Clip the global L2 gradient norm to this value; 0 disables clipping."""
    precision: str = "fp32"
    """Parameter and compute precision: fp32, bf16 or fp16 (fp32 masters and gradients)."""
    zero: int | None = None
    """ZeRO stage (docs/zero.md): 0 nothing sharded; 1 optimizer state and masters sharded
    over the data-parallel x context-parallel ranks (the distributed optimizer); 2 also the
    fp32 gradients; 3 also the parameters between uses. None: 1 with
    ``distributed_optimizer=True``, else 0."""
    distributed_optimizer: bool = False
    """ZeRO-1 (``zero >= 1`` sets it; kept as Megatron's spelling of zero=1)."""
    reshard_after_forward: bool = True
    """zero=3: free each bucket's parameters after forward's last use (False: keep them
    until the chunk's backward is done: faster, more memory)."""
    backward_prefetch: str = "pre"
    """zero=3 (docs/zero.md): 'pre' gathers the next bucket when backward first reads one,
    and reduces a bucket's gradients while the next bucket's are made (most overlap; up to
    two buckets of parameters and two of gradients whole at once); 'post' gathers the next
    bucket once backward freed the current one, and waits for a reduction before it stages
    the next bucket's gradients (at most one of each, and the next bucket's gather is
    exposed: less memory, slower)."""
    optimizer_sharding: str = "auto"
    """Distributed optimizer: 'elementwise' (flat equal slices of every bucket, for
    elementwise optimizers such as AdamW), 'layerwise' (whole parameters per rank,
    balanced by elements, stepped with their full shape: Muon, Shampoo-like ones) or
    'auto' (layerwise when an inner optimizer is known not to be elementwise)."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated parameters in the background and wait
    for each bucket only just before the next forward first reads it."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 loss scaling (ignored for fp32 / bf16)."""
    lr_schedule: LRSchedule | None = None
    """Learning-rate / weight-decay schedule in samples; None keeps the optimizer's lr."""
    check_for_nan_in_grad: bool = True
    """Look for inf / NaN in the reduced gradients every step (fp16 always does)."""
    on_nonfinite: str = "skip"
    """bf16 / fp32: 'skip' the step on every rank, or 'raise' naming parameter and rank."""
    skip_on_grad_norm_above: float = 0.0
    """Skip a step whose global gradient norm exceeds this (a loss-spike guard; 0: off)."""
    max_consecutive_skips: int = 50
    """Stop with an error after this many skipped steps in a row (0: never). fp16's first
    steps skip while the loss scale backs off from 2^32: keep this above ~25 there."""
    comm_timeout_s: float = 600.0
    """Seconds a pipeline send / receive may wait before the step fails naming the peer."""
    overlap_grad_reduce: bool = True
    """Reduce each gradient bucket as soon as it is complete, overlapping backward."""
    p2p: str = "auto"
    """Where pipeline sends / receives are posted: 'paired' (Megatron's send+receive
    groups between units; NCCL needs it), 'eager' (each send right after its compute,
    receives four units ahead; host backends such as gloo) or 'auto' (eager unless NCCL)."""
    bucket_size: int | None = None
    """Elements per gradient bucket; None = Megatron's max(40M, 1M * dp)."""
    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (attention cores) or 'full' (whole blocks)."""
    recompute_num_layers: int | None = None
    """With recompute='full': only the first this many blocks of each chunk (None: all)."""
    compile: bool = False
    """Run each chunk graph through torch.compile (inductor)."""
    broadcast_params: bool = False
    """At start-up, copy the first replica's parameters to the others (Megatron's
    broadcast_params) instead of refusing replicas that differ."""
    check_replicas_interval: int = 0
    """Before every this many steps, check that replicas still hold the same parameters
    (0: only at start-up)."""
    variable_seq_lengths: bool = False
    """Batches may differ from the example in their non-batch dimensions (the sequence
    length, per global batch, as with dynamic padding): each new shape is captured and
    transformed once, on shapes alone, with the example's pipeline cut, and its chunks
    share this rank's parameters (Megatron's ``--variable-seq-lengths``; fxmeg/variable_shapes.py).
    Off: a batch must have the example's shape."""
    moe_capacity_factor: float | None = None
    """Capacity mode (ep > 1): each expert takes at most ceil(tokens * top-k / experts * factor)
    of a rank's (token, slot) pairs, those of highest weight, padded to exactly that many
    (static shapes); the others are dropped and counted. None: dropless."""
    moe_router_load_balancing_type: str = "aux_loss"
    """A router loss as the model computes it per micro-batch ("aux_loss"), or with its
    tokens per expert averaged over the global batch's micro-batches so far, every dp
    rank's ("global_aux_loss", Megatron's name; the probabilities stay the micro-batch's)."""
    moe_router_bias_update_rate: float = 0.0
    """Loss-free expert balancing (DeepSeek-V3; Megatron's name): after every step, each
    mixture-of-experts router's expert bias buffer (the 1-D buffer it adds to the scores
    before its top-k, DeepSeek-V3's ``e_score_correction_bias``) moves by this rate times
    sign(mean count - count) of the step's tokens per expert. 0: off."""
    decided_sharding: OptimizerSharding | None = None
    """Set by ``parallelize``, not an option: the optimizer sharding decided once from the
    fields above and what the optimizer factory builds (``decide_sharding``); None before
    (read ``sharding``)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "micro_batch_size": Size(1, "micro-batch size (samples on one rank)"),
        "global_batch_size": Size(1, "global batch size (samples per optimizer step)"),
        "max_consecutive_skips": Size(0, "skipped steps allowed in a row (0: no limit)"),
        "bucket_size": Size(1, "gradient bucket size (elements)", "Megatron's max(40M, 1M * dp)"),
        "recompute_num_layers": Size(0, "number of blocks recomputed per chunk", "all of them"),
        "zero": Size(0, "ZeRO stage (0-3)", "1 with distributed_optimizer=True, else 0"),
        "check_replicas_interval": Size(0, "steps between replica checks (0: only at start-up)"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        self._check_batch()
        if self.clip_grad < 0:
            raise ConfigError(f"clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        if self.precision not in DTYPES:
            raise ConfigError(
                f"precision={self.precision!r} is not one of {tuple(DTYPES)}"
                + closest(self.precision, DTYPES)
            )
        if self.on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} must be 'skip' or 'raise'")
        if self.skip_on_grad_norm_above < 0 or self.comm_timeout_s <= 0:
            raise ConfigError(
                "skip_on_grad_norm_above must be >= 0 and comm_timeout_s > 0; "
                f"got {self.skip_on_grad_norm_above} and {self.comm_timeout_s}"
            )
        if self.recompute not in GRANULARITIES:
            raise ConfigError(f"recompute={self.recompute!r} must be 'none', 'selective' or 'full'"
                              + closest(self.recompute, GRANULARITIES))
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ConfigError(
                f"recompute_num_layers={self.recompute_num_layers} needs recompute='full' (got "
                f"recompute={self.recompute!r}); set recompute='full' or leave it None"
            )
        if self.p2p not in ("auto", *P2P_MODES):
            raise ConfigError(f"p2p={self.p2p!r} must be 'auto', 'paired' or 'eager'"
                              + closest(self.p2p, ("auto", *P2P_MODES)))
        check_sharding(self)
        self._check_experts()
        self._check_router_bias()
        self._check_router_loss()

    def _check_experts(self) -> None:
        """The capacity factor, and what expert parallelism does not run with yet, refused
        with the reason."""
        ep, factor = self.parallel.ep, self.moe_capacity_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ConfigError(
                f"moe_capacity_factor={factor} must be a finite number > 0 (each expert's capacity in "
                "multiples of an even share of the routed tokens), or None (dropless); e.g. "
                "moe_capacity_factor=1.0")
        if factor is not None and ep == 1:
            raise ConfigError(
                f"moe_capacity_factor={factor} needs ep > 1: at ep=1 fxmeg runs the model's own experts, "
                "dropless; set ep >= 2 or leave moe_capacity_factor=None")
        if ep == 1:
            return
        untested = "; moe_capacity_factor makes them static, but that is not tested yet" if factor else ""
        if self.parallel.splits_backward:
            raise ConfigError(
                f"ep={ep} does not run with schedule={self.parallel.resolved_schedule!r}: a zero-bubble "
                "schedule splits backward into input- and weight-gradient passes, and the experts' "
                "all-to-all exchanges tokens whose counts are known only at run time (data-dependent "
                f"shapes{untested}); use schedule='1f1b' or 'interleaved'")
        if self.compile and not factor:
            raise ConfigError(f"ep={ep} does not run with compile=True and dropless experts: the experts' token "
                              "counts are data-dependent shapes (dynamo recompiles for each new count); set "
                              "moe_capacity_factor (static shapes) or compile=False")
        if self.optimizer_sharding == "layerwise" or self.decided_sharding is OptimizerSharding.LAYERWISE:
            raise ConfigError(
                f"ep={ep} does not run with optimizer_sharding='layerwise' yet: experts are sharded over the "
                "expert-data-parallel ranks only (layer-wise sharding is asked for, or chosen for an optimizer "
                "that steps whole parameters, such as Muon); use optimizer_sharding='elementwise'")

    def _check_router_loss(self) -> None:
        """moe_router_load_balancing_type: one of LOAD_BALANCING; the global variant's
        running average is a forward-time state, which a recompute would advance twice."""
        kind = self.moe_router_load_balancing_type
        if kind not in LOAD_BALANCING:
            raise ConfigError(f"moe_router_load_balancing_type={kind!r} is not one of {LOAD_BALANCING}"
                              + closest(kind, LOAD_BALANCING))
        if kind == "global_aux_loss" and self.recompute != "none":
            raise ConfigError(
                f"moe_router_load_balancing_type='global_aux_loss' does not run with recompute={self.recompute!r} "
                "yet: the running tokens per expert would have moved on when backward recomputes a micro-batch; "
                "use recompute='none' or 'aux_loss'")

    def _check_router_bias(self) -> None:
        """moe_router_bias_update_rate: a finite rate >= 0, and a forward whose routing the
        runtime can count (fxmeg/runtime/expert_load.py)."""
        rate = self.moe_router_bias_update_rate
        if not math.isfinite(rate) or rate < 0:
            raise ConfigError(f"moe_router_bias_update_rate={rate} must be a finite number >= 0 (0: off); "
                              "DeepSeek-V3 uses 1e-3")
        if rate == 0:
            return
        if self.parallel.splits_backward:
            raise ConfigError(
                f"moe_router_bias_update_rate={rate} does not run with schedule="
                f"{self.parallel.resolved_schedule!r}: a zero-bubble schedule runs forward as a traced graph "
                "that does not count the tokens per expert; use schedule='1f1b' or 'interleaved'")
        if self.compile:
            raise ConfigError(f"moe_router_bias_update_rate={rate} does not run with compile=True: the tokens per "
                              "expert are counted outside the compiled graphs; set compile=False")

    def _check_batch(self) -> None:
        """global_batch_size against micro_batch_size * dp and the micro-batch count
        against the schedule's rule (``fxmeg.schedule_registry.batch_refusal``: interleaved,
        dualpipev); with dp still None only against micro_batch_size (the rest when
        ``resolve`` fixes dp)."""
        dp = self.parallel.dp
        per_step = self.micro_batch_size * (dp or 1)
        if self.global_batch_size % per_step:
            what = "micro_batch_size"
            if dp is not None:
                what += f" * dp = {self.micro_batch_size} * {dp}"
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"{what} = {per_step}; choose a multiple of {per_step}, e.g. "
                f"{max(per_step, self.global_batch_size // per_step * per_step)}"
            )
        if dp is None:
            return
        origin = f" (global_batch_size={self.global_batch_size} / (micro_batch_size * dp))"
        refusal = batch_refusal(self.parallel.resolved_schedule, pp=self.parallel.pp, m=self.num_microbatches,
                                origin=origin)
        if refusal:
            raise ConfigError(refusal)

    def resolve(self, world: int) -> EngineConfig:
        """This configuration on ``world`` ranks: the layout resolved
        (``ParallelConfig.resolve``) and every batch rule checked with the real dp."""
        return dataclasses.replace(self, parallel=self.parallel.resolve(world))

    @property
    def _dp(self) -> int:
        """The data-parallel size; an error while it is still None (unresolved)."""
        if self.parallel.dp is None:
            raise ConfigError("dp is not resolved yet: call config.resolve(world_size) first "
                              "(dp=None means world size // (tp * pp))")
        return self.parallel.dp

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in force: ``zero``, or for None 1 with the distributed optimizer, else 0."""
        return self.zero if self.zero is not None else int(self.distributed_optimizer)

    @property
    def sharding(self) -> OptimizerSharding:
        """The optimizer sharding in force: ``decided_sharding``, or before ``parallelize``
        decided it (a transform alone, ``fxmeg plan``) the default optimizer's (AdamW,
        elementwise: 'auto' is ELEMENTWISE)."""
        if self.decided_sharding is not None:
            return self.decided_sharding
        return decide_sharding(distributed=self.distributed_optimizer, requested=self.optimizer_sharding,
                               overlap_param_gather=self.overlap_param_gather, zero=self.zero_stage)

    @property
    def resolved_bucket_size(self) -> int | None:
        """Bucket size in elements; None (one bucket per buffer) without overlap."""
        if not self.overlap_grad_reduce:
            return None
        return self.bucket_size or max(40_000_000, 1_000_000 * self._dp)

    @property
    def num_microbatches(self) -> int:
        """m = global_batch_size / (micro_batch_size * dp), micro-batches per rank per step."""
        return self.global_batch_size // (self.micro_batch_size * self._dp)


_FLAG_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "int | None": int, "float | None": float}


def scalar_fields(cls: type) -> dict[str, type]:
    """Name -> value type of the fields of dataclass ``cls`` that one flag or config-file
    key can set (int, float, str, bool, int | None, float | None), in declaration order."""
    return {f.name: _FLAG_TYPES[f.type] for f in dataclasses.fields(cls) if f.type in _FLAG_TYPES}


Example = tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
"""One micro-batch: a tuple of tensors passed to ``forward`` positionally, or a dict of
tensors passed by keyword (a Hugging Face batch: input_ids, attention_mask, labels)."""


def example_tensors(example: Example) -> tuple[torch.Tensor, ...]:
    """The example's tensors in order (a dict's in its key order); refuses anything else."""
    if isinstance(example, Mapping):
        if example and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in example.items()):
            return tuple(example.values())
    elif isinstance(example, tuple) and example and all(isinstance(t, torch.Tensor) for t in example):
        return example
    raise ConfigError(
        "example_inputs must be one micro-batch: a non-empty tuple of tensors (passed to forward "
        "positionally) or a dict of tensors by argument name (passed by keyword, e.g. "
        f"{{'input_ids': ..., 'attention_mask': ..., 'labels': ...}}); got {type(example).__name__}"
    )


def batch_dim(example: Example, micro_batch_size: int | None) -> int:
    example = example_tensors(example)
    rows = {t.shape[0] if t.dim() else None for t in example}
    if len(rows) != 1 or None in rows:
        raise ConfigError(
            f"every example input needs the same batch dimension; got shapes "
            f"{[tuple(t.shape) for t in example]}"
        )
    (b,) = rows
    if micro_batch_size is not None:
        check_size("micro_batch_size", micro_batch_size, EngineConfig.SIZES["micro_batch_size"])
    if micro_batch_size is not None and micro_batch_size != b:
        raise ConfigError(
            f"the example inputs' batch dimension is {b}, but micro_batch_size="
            f"{micro_batch_size}; pass one micro-batch of {micro_batch_size} samples as "
            "example_inputs"
        )
    return b


_LAYOUT = {f for f in ParallelConfig.__dataclass_fields__}


def make_config(
    example: Example,
    *,
    world: int | None,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    split_points=None,
    tp_plan: dict[str, str] | None = None,
    **options,
) -> EngineConfig:
    """The EngineConfig of ``parallelize(model, example, **options)``: ParallelConfig
    fields and EngineConfig fields as keywords; an unknown name is refused with the
    nearest valid one. ``world`` (the launched world size) fixes dp when it is None;
    ``world=None`` (a transform without processes) takes dp=1 unless given."""
    for name in options:
        if name not in _LAYOUT and name not in _ENGINE_OPTIONS:
            raise ConfigError(
                f"unknown option {name!r}" + closest(name, sorted(_LAYOUT | _ENGINE_OPTIONS))
            )
    parallel = ParallelConfig(
        tp=tp, pp=pp, dp=1 if world is None and dp is None else dp,
        split_points=tuple(split_points) if split_points is not None else None,
        tp_plan=tuple((tp_plan or {}).items()),
        **{k: v for k, v in options.items() if k in _LAYOUT},
    )
    parallel = parallel.resolve(world) if world is not None else parallel
    mbs = batch_dim(example, micro_batch_size)
    return EngineConfig(
        micro_batch_size=mbs,
        global_batch_size=mbs * parallel.dp if global_batch_size is None else global_batch_size,
        parallel=parallel,
        **{k: v for k, v in options.items() if k not in _LAYOUT},
    )


_ENGINE_OPTIONS = {f for f in EngineConfig.__dataclass_fields__} - {
    "parallel", "micro_batch_size", "global_batch_size", "decided_sharding"}


def cast_inputs(batch: Example, dtype: torch.dtype) -> Example:
    """Floating inputs in the training dtype (``EngineConfig.dtype``); token ids and masks
    as they are. A dict stays a dict."""
    if isinstance(batch, Mapping):
        return dict(zip(batch, cast_inputs(tuple(batch.values()), dtype)))
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in batch)
