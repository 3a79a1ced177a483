"""Modes decided once and recorded in the EngineConfig, read by the passes and by the
runtime alike (a small module both may import: passes never import the runtime).

The optimizer sharding depends on the user's request and on what the optimizer factory
builds, so ``parallelize`` decides it before the passes (``DataParallelConfig.decided_sharding``):
the buckets pass pads the gradient buffers for it, the runtime shards the update by it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from fxmeg.errors import ConfigError, closest

OPTIMIZER_SHARDINGS = ("auto", "elementwise", "layerwise")
"""How the distributed optimizer splits the update (see DataParallelConfig.optimizer_sharding)."""
ZERO_STAGES = (0, 1, 2, 3)
BACKWARD_PREFETCH = ("pre", "post")
"""What ``DataParallelConfig.zero`` may be (docs/zero.md)."""


class OptimizerSharding(str, enum.Enum):
    """How the optimizer's update is split over the data-parallel ranks, decided once
    (``decide_sharding``) and read by the buckets pass and the runtime. A str enum: equal
    to its value, so checkpoints' meta.json and reports keep the words they had."""

    NONE = "none"
    """No distributed optimizer: every data-parallel rank updates every whole parameter."""
    ELEMENTWISE = "elementwise"
    """ZeRO-1: flat equal slices of every gradient bucket (the buckets are padded for it)."""
    LAYERWISE = "layerwise"
    """Whole parameters per rank, balanced by elements (optimizers that need the shape)."""


def decide_sharding(
    *,
    distributed: bool,
    requested: str,
    whole: Sequence[str] = (),
    overlap_param_gather: bool = False,
    zero: int = 1,
) -> OptimizerSharding:
    """The rule: NONE without the distributed optimizer, else ``requested`` ('auto':
    LAYERWISE iff an inner optimizer needs whole parameters; ``whole`` names them, from
    ``fxmeg.runtime.optimizer.optimizer.OptimizerPlan``). Raises ConfigError when the request
    cannot hold (before any process group)."""
    if not distributed:
        return OptimizerSharding.NONE
    chosen = OptimizerSharding(
        requested if requested != "auto" else "layerwise" if whole else "elementwise"
    )
    if chosen is OptimizerSharding.ELEMENTWISE and whole:
        raise ConfigError(
            f"optimizer_sharding='elementwise' hands each data-parallel rank flat slices of the "
            f"gradient buckets, but the inner optimizer {whole[0]} needs whole parameters; use "
            "optimizer_sharding='layerwise' (or 'auto')"
        )
    if chosen is OptimizerSharding.LAYERWISE and zero >= 2:
        raise ConfigError(
            f"zero={zero} keeps each data-parallel rank's flat slice of every gradient "
            f"bucket{' and parameter' if zero == 3 else ''}, but the distributed optimizer runs "
            "layer-wise here "
            f"({', '.join(whole) + ' needs' if whole else 'optimizer_sharding=layerwise asks for'} "
            "whole parameters); use zero=1 for a layer-wise optimizer, or an elementwise one "
            "(AdamW)"
        )
    if chosen is OptimizerSharding.LAYERWISE and overlap_param_gather:
        raise ConfigError(
            "overlap_param_gather=True needs optimizer_sharding='elementwise', but the distributed "
            f"optimizer runs layer-wise here ({', '.join(whole) or 'requested'} needs whole "
            "parameters); set overlap_param_gather=False"
        )
    return chosen


def check_sharding(config) -> None:
    """``DataParallelConfig``'s zero stage, optimizer sharding and their companions (called by
    its ``__post_init__``, before any process group; ``check_zero3_companions`` checks zero=3
    against the other sections). ``zero`` None stands for 1 with
    ``distributed_optimizer=True``, else 0 (``zero_stage``); ``distributed_optimizer`` is set
    when ``zero >= 1`` is given."""
    zero = config.zero
    if zero is None:
        zero = 1 if config.distributed_optimizer else 0
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ConfigError(
            f"zero={zero!r} must be one of {ZERO_STAGES} (0: nothing sharded, 1: optimizer "
            "state, 2: and gradients, 3: and parameters)"
        )
    if config.distributed_optimizer and zero == 0:
        raise ConfigError("distributed_optimizer=True is zero=1, but zero=0 was given: drop "
                          "distributed_optimizer, or set zero to 1, 2 or 3")
    object.__setattr__(config, "distributed_optimizer", zero >= 1)
    _check_zero3_options(config, zero)
    if zero >= 2 and config.optimizer_sharding == "layerwise":
        raise ConfigError(
            f"zero={zero} does not run with optimizer_sharding='layerwise' (it shards every "
            "gradient bucket flat, a layer-wise optimizer steps whole parameters); use zero=1"
        )
    if config.optimizer_sharding not in OPTIMIZER_SHARDINGS:
        raise ConfigError(
            f"optimizer_sharding={config.optimizer_sharding!r} is not one of "
            f"{OPTIMIZER_SHARDINGS}" + closest(config.optimizer_sharding, OPTIMIZER_SHARDINGS)
        )
    if config.optimizer_sharding != "auto" and not config.distributed_optimizer:
        raise ConfigError(
            f"optimizer_sharding={config.optimizer_sharding!r} needs distributed_optimizer=True "
            "(zero >= 1; without it every data-parallel rank updates every whole parameter)"
        )
    if config.overlap_param_gather and config.optimizer_sharding == "layerwise":
        raise ConfigError(
            "overlap_param_gather=True needs optimizer_sharding='elementwise' (the layer-wise "
            "optimizer gathers whole parameters in one all-gather after the step)"
        )
    if config.overlap_param_gather and not config.distributed_optimizer:
        raise ConfigError(
            "overlap_param_gather=True needs distributed_optimizer=True (zero >= 1: only the "
            "distributed optimizer gathers parameters)"
        )
    decided = config.decided_sharding
    if decided is not None and decided not in _possible(config):
        raise ConfigError(
            f"decided_sharding={decided.value!r} contradicts "
            f"distributed_optimizer={config.distributed_optimizer} (zero={zero}), "
            f"optimizer_sharding={config.optimizer_sharding!r}: leave decided_sharding to "
            "parallelize (it is not an option)"
        )


def _check_zero3_options(config, zero: int) -> None:
    """The options that only zero=3 takes, and the one it does not run with in its own section."""
    if not config.reshard_after_forward and zero != 3:
        raise ConfigError(
            f"reshard_after_forward=False needs zero=3 (zero={zero} keeps whole parameters "
            "anyway); drop it or set zero=3"
        )
    if config.backward_prefetch not in BACKWARD_PREFETCH:
        raise ConfigError(
            f"backward_prefetch={config.backward_prefetch!r} is not one of {BACKWARD_PREFETCH} "
            "('pre': more overlap, 'post': less memory)"
            + closest(config.backward_prefetch, BACKWARD_PREFETCH)
        )
    if config.backward_prefetch != "pre" and zero != 3:
        raise ConfigError(
            f"backward_prefetch={config.backward_prefetch!r} needs zero=3 (zero={zero} gathers no "
            "parameters in backward); drop it or set zero=3"
        )
    if zero == 3 and config.overlap_param_gather:
        raise ConfigError(
            "zero=3 does not run with overlap_param_gather=True: zero=3 gathers each bucket "
            "before its first use by itself; drop overlap_param_gather"
        )


def check_zero3_companions(config) -> None:
    """What zero=3 does not run with in the rest of an ``EngineConfig`` (called by its
    ``__post_init__``): the options of other sections its gathers and releases cannot serve."""
    if config.data_parallel.zero_stage != 3:
        return
    par = config.parallel
    refused = (
        (
            config.compile,
            "compile=True",
            "its gathers and releases are not traced by torch.compile yet; "
            "set compile=False or zero=2",
        ),
        (
            par.splits_backward,
            f"schedule={par.resolved_schedule!r}",
            "a zero-bubble weight-gradient action runs outside the backward that regathers "
            "parameters; use 1f1b or interleaved, or zero=2",
        ),
        (
            config.variable_seq_lengths,
            "variable_seq_lengths=True",
            "the Programs of other shapes are not checked at zero=3 yet; use zero=2",
        ),
    )
    for flag, what, fix in refused:
        if flag:
            raise ConfigError(f"zero=3 does not run with {what}: {fix}")


def _possible(config) -> tuple[OptimizerSharding, ...]:
    """What ``decide_sharding`` may decide for these fields, whatever the optimizer."""
    if not config.distributed_optimizer:
        return (OptimizerSharding.NONE,)
    if config.optimizer_sharding != "auto":
        return (OptimizerSharding(config.optimizer_sharding),)
    return (OptimizerSharding.ELEMENTWISE, OptimizerSharding.LAYERWISE)
