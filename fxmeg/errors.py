"""Errors a user can reach. Each message names the offending thing, the numbers and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FxmegError(Exception):
    """Base class of every error fxmeg raises for bad input or an unsupported model."""


class ConfigError(FxmegError, ValueError):
    """An invalid or inconsistent configuration value."""


class DataError(ConfigError):
    """Data the run cannot train on, or input prepare-data cannot read (refused before
    the first step, or before anything is written)."""


class CaptureError(FxmegError):
    """The model could not be captured with torch.export."""


class PassError(FxmegError):
    """A graph pass met a pattern it cannot transform safely."""


class BatchError(FxmegError, ValueError):
    """A batch handed to the engine does not match the example micro-batch."""


class ScheduleError(FxmegError):
    """A pipeline schedule cannot be built or failed while running."""


class LayoutError(FxmegError, ValueError):
    """A layout (``fxmeg.ir.layouts``) made with fields that cannot describe a tensor: an
    internal error when a pass makes it, a user error when it comes from a plan."""


class CommTimeoutError(ScheduleError):
    """A pipeline peer did not answer within comm_timeout_s (raised by the executor)."""


class NonFiniteGradError(FxmegError):
    """A gradient held inf or NaN and the run asked to stop (on_nonfinite='raise')."""


class ReleasedError(FxmegError, RuntimeError):
    """A parameter of the user's module read after ``parallelize``, where this rank does not
    hold it readable (another pipeline stage's, the full tensor of a shard, zero=3's)."""


class GroupDestroyedError(FxmegError, RuntimeError):
    """An engine used after ``dist.destroy_process_group()`` destroyed its process groups
    (fxmeg holds them weakly: fxmeg/runtime/groups.py, ``WeakGroup``)."""


class CheckpointError(FxmegError):
    """A checkpoint that is missing, incomplete or from an incompatible model."""


def closest(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid name, or '' when none is near (or
    ``name`` is no string: ``recompute=None``, Megatron's spelling of 'none')."""
    if not isinstance(name, str):
        return ""
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


class InitError(FxmegError):
    """A module of a model built on meta that fxmeg cannot initialise."""

    def __init__(self, message: str, module: str = "") -> None:
        super().__init__(message)
        self.module = module
        """The module, quoted (``'layers.0.norm'``), for a message listing several."""


class WeightsError(FxmegError):
    """Initial weights that are missing, unreadable or do not fit the model."""


class ReplicaError(FxmegError):
    """Ranks that must hold the same parameter values (data- or tensor-parallel replicas,
    the holders of a tied weight) do not."""

    def __init__(self, message: str, *, parameter: str, ranks: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.parameter = parameter
        """The first differing parameter in the Program's order."""
        self.ranks = ranks
        """(rank, the rank it was compared with) for each rank holding it differently."""
