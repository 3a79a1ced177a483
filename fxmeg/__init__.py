"""fxmeg: Megatron-LM's parallel training semantics for unmodified PyTorch models, by
transforming their traced graphs."""

from fxmeg.api import Engine, EvalResult, StepResult, parallelize
from fxmeg.errors import FxmegError

__all__ = ["Engine", "EvalResult", "FxmegError", "StepResult", "parallelize"]
