"""Modes decided once and recorded in the EngineConfig, read by the passes and by the
runtime alike (a small module both may import: passes never import the runtime).

The optimizer sharding depends on the user's request and on what the optimizer factory
builds, so ``parallelize`` decides it before the passes (``EngineConfig.decided_sharding``):
the buckets pass pads the gradient buffers for it, the runtime shards the update by it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from fxmeg.errors import ConfigError


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
    *, distributed: bool, requested: str, whole: Sequence[str] = (), overlap_param_gather: bool = False
) -> OptimizerSharding:
    """The rule: NONE without the distributed optimizer, else ``requested`` ('auto':
    LAYERWISE iff an inner optimizer needs whole parameters; ``whole`` names them, from
    ``fxmeg.runtime.optimizer.OptimizerPlan``). Raises ConfigError when the request
    cannot hold (before any process group)."""
    if not distributed:
        return OptimizerSharding.NONE
    chosen = OptimizerSharding(requested if requested != "auto" else "layerwise" if whole else "elementwise")
    if chosen is OptimizerSharding.ELEMENTWISE and whole:
        raise ConfigError(
            f"optimizer_sharding='elementwise' hands each data-parallel rank flat slices of the "
            f"gradient buckets, but the inner optimizer {whole[0]} needs whole parameters; use "
            "optimizer_sharding='layerwise' (or 'auto')"
        )
    if chosen is OptimizerSharding.LAYERWISE and overlap_param_gather:
        raise ConfigError(
            f"overlap_param_gather=True needs optimizer_sharding='elementwise', but the distributed "
            f"optimizer runs layer-wise here ({', '.join(whole) or 'requested'} needs whole "
            "parameters); set overlap_param_gather=False"
        )
    return chosen
