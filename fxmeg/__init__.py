"""fxmeg: Megatron-LM's parallel training semantics for unmodified PyTorch models, by
transforming their traced graphs."""

from fxmeg.api import Engine, EvalResult, StepResult, VerifyResult, parallelize
from fxmeg.config import EngineConfig, ParallelConfig
from fxmeg.errors import FxmegError
from fxmeg.loss_scale import LossScaleConfig
from fxmeg.lr_schedule import LRSchedule
from fxmeg.materialize import materialize
from fxmeg.plan import Plan, plan
from fxmeg.program import Program
from fxmeg.transform import transform

__all__ = [
    "Engine", "EngineConfig", "EvalResult", "FxmegError", "LRSchedule", "LossScaleConfig",
    "ParallelConfig", "Plan", "Program", "StepResult", "VerifyResult", "materialize", "parallelize",
    "plan", "transform",
]
