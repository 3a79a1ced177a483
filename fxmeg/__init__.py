"""fxmeg: Megatron-LM's parallel training semantics for unmodified PyTorch models, by
transforming their traced graphs.

The names below are imported on first use (PEP 562), so ``fxmeg --help`` and a config error
answer without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOMES = {
    "Engine": "fxmeg.api", "EvalResult": "fxmeg.api", "StepResult": "fxmeg.api",
    "VerifyResult": "fxmeg.api", "parallelize": "fxmeg.api",
    "EngineConfig": "fxmeg.config", "ParallelConfig": "fxmeg.config",
    "FxmegError": "fxmeg.errors",
    "LossScaleConfig": "fxmeg.loss_scale",
    "LRSchedule": "fxmeg.lr_schedule",
    "materialize": "fxmeg.weights.meta_init",
    "Plan": "fxmeg.diagnostics.layout_plan", "plan": "fxmeg.diagnostics.layout_plan",
    "Program": "fxmeg.ir.program",
    "transform": "fxmeg.frontend.pass_driver",
}
"""Each public name and the module that defines it."""

__all__ = [
    "Engine", "EngineConfig", "EvalResult", "FxmegError", "LRSchedule", "LossScaleConfig",
    "ParallelConfig", "Plan", "Program", "StepResult", "VerifyResult", "materialize", "parallelize",
    "plan", "transform",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'fxmeg' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


if TYPE_CHECKING:
    from fxmeg.api import Engine, EvalResult, StepResult, VerifyResult, parallelize
    from fxmeg.config import EngineConfig, ParallelConfig
    from fxmeg.diagnostics.layout_plan import Plan, plan
    from fxmeg.errors import FxmegError
    from fxmeg.frontend.pass_driver import transform
    from fxmeg.ir.program import Program
    from fxmeg.loss_scale import LossScaleConfig
    from fxmeg.lr_schedule import LRSchedule
    from fxmeg.weights.meta_init import materialize
