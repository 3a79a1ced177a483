"""The sections of ``EngineConfig`` besides the layout (``ParallelConfig``), as Megatron-Core
keeps its DDP and optimizer options in their own configs: pipeline messaging, data
parallelism and ZeRO, mixture of experts, activation recompute, and the step's guards.

Each section is a frozen dataclass whose fields keep the flat names of the `fxmeg train`
flags, the config-file keys and ``parallelize``'s keywords (``--moe-capacity-factor`` is
``config.moe.moe_capacity_factor``), so one name is greppable from the flag to its reader;
``EngineConfig.from_flat`` maps the flat names onto the sections. A section checks its
own fields in ``__post_init__``; rules that join two sections are ``EngineConfig``'s (the
mixture-of-experts ones it asks ``MoEConfig.check_with``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from fxmeg.errors import ConfigError, closest
from fxmeg.sharding_modes import OptimizerSharding, check_sharding, decide_sharding
from fxmeg.sizes import Size, check_numbers

GRANULARITIES = ("none", "selective", "full")
"""Activation recompute: nothing, attention cores, or whole blocks."""
P2P_MODES = ("paired", "eager")
"""Where pipeline sends / receives are posted (see PipelineConfig.p2p)."""
LOAD_BALANCING = ("aux_loss", "global_aux_loss")
"""How a router loss counts tokens per expert (see MoEConfig.moe_router_load_balancing_type)."""


@dataclass(frozen=True)
class PipelineConfig:
    """How pipeline stages exchange activations (the schedule and the cut are
    ``ParallelConfig``'s; the receive timeout is ``GuardsConfig.comm_timeout_s``)."""

    p2p: str = "auto"
    """Where pipeline sends / receives are posted: 'paired' (Megatron's send+receive
    groups between units; NCCL needs it), 'eager' (each send right after its compute,
    receives four units ahead; host backends such as gloo) or 'auto' (eager unless NCCL)."""

    def __post_init__(self) -> None:
        if self.p2p not in ("auto", *P2P_MODES):
            raise ConfigError(f"p2p={self.p2p!r} must be 'auto', 'paired' or 'eager'"
                              + closest(self.p2p, ("auto", *P2P_MODES)))


@dataclass(frozen=True)
class DataParallelConfig:
    """Gradient reduction and ZeRO over the data-parallel x context-parallel ranks
    (Megatron's DistributedDataParallelConfig and its distributed optimizer's options)."""

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
    overlap_grad_reduce: bool = True
    """Reduce each gradient bucket as soon as it is complete, overlapping backward."""
    bucket_size: int | None = None
    """Elements per gradient bucket; None = Megatron's max(40M, 1M * dp)."""
    broadcast_params: bool = False
    """At start-up, copy the first replica's parameters to the others (Megatron's
    broadcast_params) instead of refusing replicas that differ."""
    check_replicas_interval: int = 0
    """Before every this many steps, check that replicas still hold the same parameters
    (0: only at start-up)."""
    decided_sharding: OptimizerSharding | None = None
    """Set by ``parallelize``, not an option: the optimizer sharding decided once from the
    fields above and what the optimizer factory builds (``decide_sharding``); None before
    (read ``sharding``)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "zero": Size(0, "ZeRO stage (0-3)", "1 with distributed_optimizer=True, else 0"),
        "bucket_size": Size(1, "gradient bucket size (elements)", "Megatron's max(40M, 1M * dp)"),
        "check_replicas_interval": Size(0, "steps between replica checks (0: only at start-up)"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        check_sharding(self)  # fxmeg/sharding_modes.py; sets distributed_optimizer from zero

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in force: ``zero``, or for None 1 with the distributed optimizer, else 0.
        """
        return self.zero if self.zero is not None else int(self.distributed_optimizer)

    @property
    def sharding(self) -> OptimizerSharding:
        """The optimizer sharding in force: ``decided_sharding``, or before ``parallelize``
        decided it (a transform alone, ``fxmeg plan``) the default optimizer's (AdamW,
        elementwise: 'auto' is ELEMENTWISE)."""
        if self.decided_sharding is not None:
            return self.decided_sharding
        return decide_sharding(
            distributed=self.distributed_optimizer,
            requested=self.optimizer_sharding,
            overlap_param_gather=self.overlap_param_gather,
            zero=self.zero_stage,
        )

    def resolved_bucket_size(self, dp: int) -> int | None:
        """Bucket size in elements at data-parallel size ``dp``; None (one bucket per
        buffer) without overlap."""
        if not self.overlap_grad_reduce:
            return None
        return self.bucket_size or max(40_000_000, 1_000_000 * dp)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts options (the expert-parallel size is ``ParallelConfig.ep``)."""

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
    overlap_moe_expert_parallel_comm: bool = False
    """DualPipe's overlap (Megatron's name; ep > 1 under schedule='dualpipev'): in each
    unit that pairs one chunk's forward with another's backward, run the backward in a
    second lane (a thread over twin process groups, on an accelerator its own stream), so
    that each lane's expert all-to-alls wait while the other computes
    (fxmeg/runtime/lanes.py). Same values; on the CPU no faster (one core per rank)."""

    SIZES: ClassVar[dict[str, Size]] = {}
    """No integer fields (``fxmeg.sizes.check_numbers`` checks the floats' types)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        factor, rate, kind = (self.moe_capacity_factor, self.moe_router_bias_update_rate,
                              self.moe_router_load_balancing_type)
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ConfigError(
                f"moe_capacity_factor={factor} must be a finite number > 0 (each expert's capacity "
                "in multiples of an even share of the routed tokens), or None (dropless); e.g. "
                "moe_capacity_factor=1.0"
            )
        if not math.isfinite(rate) or rate < 0:
            raise ConfigError(
                f"moe_router_bias_update_rate={rate} must be a finite number >= 0 (0: off); "
                "DeepSeek-V3 uses 1e-3"
            )
        if kind not in LOAD_BALANCING:
            raise ConfigError(
                f"moe_router_load_balancing_type={kind!r} is not one of {LOAD_BALANCING}"
                + closest(kind, LOAD_BALANCING)
            )

    def check_with(self, parallel, *, compile: bool) -> None:
        """The rules that join these options to the layout (``parallel``, a
        ``fxmeg.config.ParallelConfig``, which imports this module) and ``compile``
        (called by ``EngineConfig``, which holds all three)."""
        self._check_lanes(parallel, compile)
        self._check_router_bias(parallel, compile)
        self._check_global_router_loss(parallel)

    def _check_lanes(self, parallel, compile: bool) -> None:
        """overlap_moe_expert_parallel_comm runs the backward of DualPipeV's paired units in
        a second lane (fxmeg/runtime/lanes.py): it needs those units, expert all-to-alls to
        hide, and eager graphs (zero=3, whose forward would gather parameters over the group
        the backward reduces over, is refused under every split backward)."""
        if not self.overlap_moe_expert_parallel_comm:
            return
        name, schedule = "overlap_moe_expert_parallel_comm=True", parallel.resolved_schedule
        if parallel.ep == 1 or schedule != "dualpipev":
            raise ConfigError(
                f"{name} overlaps the expert all-to-alls of DualPipeV's paired forward and "
                f"backward: it needs ep > 1 and schedule='dualpipev'; got ep={parallel.ep}, "
                f"schedule={schedule!r}"
            )
        if compile:
            raise ConfigError(f"{name} does not run with compile=True: the second lane runs "
                              "eager graphs; set compile=False")

    def _check_global_router_loss(self, parallel) -> None:
        """global_aux_loss's running tokens per expert advance in the forward the runtime
        runs (``ops.global_tokens``, fxmeg/runtime/expert_load.py), which a zero-bubble
        schedule traces into a graph of its own: measured 2026-12-05, Mixtral at pp2 x dp2
        under zbh1 (ep=1 and ep=2) trains with the wrong loss from step 1."""
        if (self.moe_router_load_balancing_type == "global_aux_loss"
                and parallel.splits_backward):
            raise ConfigError(
                "moe_router_load_balancing_type='global_aux_loss' does not run with "
                f"schedule={parallel.resolved_schedule!r}: a zero-bubble schedule traces "
                "forward into a graph of its own, which does not advance the running tokens per "
                "expert; use schedule='1f1b' or 'interleaved', or "
                "moe_router_load_balancing_type='aux_loss'"
            )

    def _check_router_bias(self, parallel, compile: bool) -> None:
        """moe_router_bias_update_rate > 0 needs a forward whose routing the runtime can
        count (fxmeg/runtime/expert_load.py)."""
        rate = self.moe_router_bias_update_rate
        if rate == 0:
            return
        if parallel.splits_backward:
            raise ConfigError(
                f"moe_router_bias_update_rate={rate} does not run with "
                f"schedule={parallel.resolved_schedule!r}: a zero-bubble schedule runs "
                "forward as a traced graph that does not count the tokens per expert; use "
                "schedule='1f1b' or 'interleaved'"
            )
        if compile:
            raise ConfigError(
                f"moe_router_bias_update_rate={rate} does not run with compile=True: the tokens "
                "per expert are counted outside the compiled graphs; set compile=False"
            )


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron's recompute_granularity and recompute_num_layers)."""

    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (attention cores) or 'full' (whole blocks)."""
    recompute_num_layers: int | None = None
    """With recompute='full': only the first this many blocks of each chunk (None: all)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "recompute_num_layers": Size(0, "number of blocks recomputed per chunk", "all of them"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.recompute not in GRANULARITIES:
            raise ConfigError(f"recompute={self.recompute!r} must be 'none', 'selective' or 'full'"
                              + closest(self.recompute, GRANULARITIES))
        if self.recompute_num_layers is not None and self.recompute != "full":
            raise ConfigError(
                f"recompute_num_layers={self.recompute_num_layers} needs recompute='full' (got "
                f"recompute={self.recompute!r}); set recompute='full' or leave it None"
            )


@dataclass(frozen=True)
class GuardsConfig:
    """What a step does about non-finite gradients, loss spikes and stuck peers."""

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

    SIZES: ClassVar[dict[str, Size]] = {
        "max_consecutive_skips": Size(0, "skipped steps allowed in a row (0: no limit)"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} must be 'skip' or 'raise'")
        if self.skip_on_grad_norm_above < 0 or self.comm_timeout_s <= 0:
            raise ConfigError(
                "skip_on_grad_norm_above must be >= 0 and comm_timeout_s > 0; "
                f"got {self.skip_on_grad_norm_above} and {self.comm_timeout_s}"
            )
