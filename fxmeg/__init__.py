"""fxmeg: Megatron-LM's parallel training semantics for unmodified PyTorch models, by
transforming their traced graphs."""

from fxmeg.api import Engine, EvalResult, StepResult, parallelize
from fxmeg.errors import FxmegError
from fxmeg.runtime.loss_scale import LossScaleConfig
from fxmeg.runtime.lr_schedule import LRSchedule

__all__ = ["Engine", "EvalResult", "FxmegError", "LRSchedule", "LossScaleConfig", "StepResult", "parallelize"]
