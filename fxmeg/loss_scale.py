"""fp16 loss scaling (Megatron's DynamicGradScaler, docs/megatron-semantics.md §2.7 and §2.10).

The loss is multiplied by the scale only where backward starts, on the last pipeline
stage; finalize divides the gradients by it. A step that found an inf/NaN anywhere is
skipped on every rank; the scale backs off after ``hysteresis`` such steps and grows
after ``growth_interval`` clean ones in a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxmeg.errors import ConfigError
from fxmeg.sizes import Size, check_numbers


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling, with Megatron's defaults."""

    static: float | None = None
    """A fixed scale instead of a dynamic one (Megatron's --loss-scale)."""
    initial: float = 2.0**32
    """Starting dynamic scale (--initial-loss-scale)."""
    min_scale: float = 1.0
    """The dynamic scale never drops below this (--min-loss-scale)."""
    growth_factor: float = 2.0
    """Multiply the scale by this after growth_interval clean steps."""
    backoff_factor: float = 0.5
    """Multiply the scale by this after hysteresis overflowing steps."""
    growth_interval: int = 1000
    """Clean steps in a row before the scale grows (--loss-scale-window)."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the scale backs off (--hysteresis)."""

    SIZES: ClassVar[dict[str, Size]] = {
        "growth_interval": Size(1, "clean steps before the loss scale grows"),
        "hysteresis": Size(1, "overflowing steps tolerated before the loss scale backs off"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.static is not None and self.static <= 0:
            raise ConfigError(f"loss_scale.static must be > 0, got {self.static}")
        if not (self.min_scale > 0 and self.initial >= self.min_scale):
            raise ConfigError(
                f"loss scale needs 0 < min_scale <= initial; got min_scale={self.min_scale}, "
                f"initial={self.initial}"
            )
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ConfigError(
                f"loss scale needs growth_factor > 1 and 0 < backoff_factor < 1; got "
                f"{self.growth_factor} and {self.backoff_factor}"
            )


class LossScaler:
    """The current scale and its update rule."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = config.static if config.static is not None else config.initial
        self._growth = 0
        self._hysteresis = config.hysteresis

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (once hysteresis is used up), grow after
        growth_interval clean steps."""
        c = self.config
        if c.static is not None:
            return
        if found_inf:
            self._growth = 0
            self._hysteresis -= 1
            if self._hysteresis <= 0:
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)
            return
        self._growth += 1
        if self._growth == c.growth_interval:
            self._growth = 0
            self._hysteresis = c.hysteresis
            self.scale *= c.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth": self._growth, "hysteresis": self._hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._growth, self._hysteresis = (
            state["scale"],
            state["growth"],
            state["hysteresis"],
        )
