"""Learning-rate and weight-decay schedules counted in samples
(docs/megatron-semantics.md §2.2, §2.3.3; Megatron's OptimizerParamScheduler).

Counting samples, not iterations, keeps a schedule continuous when the global batch size
changes mid-run. The engine advances it by the global batch after every successful step
(a skipped step does not advance it); the lr of step k is the schedule's value at the
samples consumed before it, so a warmup from 0 trains its first step with lr 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fxmeg.errors import ConfigError
from fxmeg.sizes import Size, check_numbers

LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's schedule, in samples."""

    max_lr: float
    """Peak learning rate (reached at the end of warmup)."""
    min_lr: float = 0.0
    """Floor the decay ends at."""
    warmup_samples: int = 0
    """Linear warmup from init_lr to max_lr over this many samples."""
    init_lr: float = 0.0
    """Learning rate at sample 0 of the warmup."""
    decay_samples: int | None = None
    """Samples by the end of decay (warmup included); required unless style='constant'."""
    style: str = "linear"
    """One of constant, linear, cosine, inverse-square-root, WSD."""
    wsd_decay_samples: int | None = None
    """WSD: length of the final annealing phase, ending at decay_samples."""
    wsd_style: str = "exponential"
    """WSD annealing shape: linear, cosine, exponential or minus_sqrt."""
    start_wd: float | None = None
    """Weight decay at sample 0; None leaves the optimizer's weight decay alone."""
    end_wd: float | None = None
    """Weight decay after wd_incr_samples."""
    wd_incr_samples: int | None = None
    """Samples over which weight decay moves from start_wd to end_wd (default decay_samples)."""
    wd_style: str = "constant"
    """constant, linear or cosine."""

    SIZES: ClassVar[dict[str, Size]] = {
        "warmup_samples": Size(0, "learning-rate warmup in samples"),
        "decay_samples": Size(1, "samples by the end of the decay", "only with style='constant'"),
        "wsd_decay_samples": Size(1, "samples of the WSD anneal", "without WSD"),
        "wd_incr_samples": Size(1, "samples of the weight-decay ramp", "decay_samples"),
    }
    """The rule of each integer field (``fxmeg.sizes.check_numbers``)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.style not in LR_STYLES:
            raise ConfigError(f"lr_schedule.style={self.style!r} is not one of {LR_STYLES}")
        if self.wsd_style not in WSD_STYLES:
            raise ConfigError(
                f"lr_schedule.wsd_style={self.wsd_style!r} is not one of {WSD_STYLES}"
            )
        if self.wd_style not in WD_STYLES:
            raise ConfigError(f"lr_schedule.wd_style={self.wd_style!r} is not one of {WD_STYLES}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ConfigError(
                f"lr_schedule needs 0 <= min_lr <= max_lr; got {self.min_lr}, {self.max_lr}"
            )
        if self.style != "constant":
            if self.decay_samples is None or self.decay_samples <= self.warmup_samples:
                raise ConfigError(
                    f"lr_schedule.style={self.style!r} needs decay_samples > warmup_samples "
                    f"= {self.warmup_samples}; got {self.decay_samples}"
                )
        if self.style == "WSD" and not (
            0 < (self.wsd_decay_samples or 0) <= self.decay_samples - self.warmup_samples
        ):
            raise ConfigError(
                f"lr_schedule.style='WSD' needs 0 < wsd_decay_samples <= decay_samples - "
                f"warmup_samples; got {self.wsd_decay_samples}"
            )
        if (self.start_wd is None) != (self.end_wd is None):
            raise ConfigError("lr_schedule.start_wd and end_wd go together")
        if (
            self.wd_style != "constant"
            and self.start_wd is not None
            and not (self.wd_incr_samples or self.decay_samples)
        ):
            raise ConfigError(
                f"wd_style={self.wd_style!r} moves weight decay over wd_incr_samples (default "
                "decay_samples), but neither is set: set wd_incr_samples"
            )
        if self.wd_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError(
                f"wd_style='constant' needs start_wd == end_wd; got {self.start_wd}, {self.end_wd}"
            )

    def lr(self, samples: int) -> float:
        """Megatron's get_lr at ``samples`` consumed samples."""
        if self.warmup_samples > 0 and samples <= self.warmup_samples:
            return self.init_lr + (self.max_lr - self.init_lr) * samples / self.warmup_samples
        if self.style == "constant":
            return self.max_lr
        if samples > self.decay_samples:
            return self.min_lr
        if self.style == "inverse-square-root":
            warmup, s = max(self.warmup_samples, 1), max(samples, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warmup) / math.sqrt(s))
        ratio = (samples - self.warmup_samples) / (self.decay_samples - self.warmup_samples)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd(samples)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd(self, samples: int) -> float:
        anneal_start = self.decay_samples - self.wsd_decay_samples
        if samples <= anneal_start:
            return 1.0
        r = (samples - anneal_start) / self.wsd_decay_samples
        return {
            "linear": 1.0 - r,
            "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
            "exponential": 2.0 * 0.5**r - 1.0,
            "minus_sqrt": 1.0 - math.sqrt(r),
        }[self.wsd_style]

    def weight_decay(self, samples: int) -> float | None:
        """Megatron's get_wd at ``samples``; None when the schedule leaves it alone."""
        if self.start_wd is None:
            return None
        incr = self.wd_incr_samples or self.decay_samples or 0
        if samples > incr or self.wd_style == "constant":
            return self.end_wd
        ratio = samples / incr
        coeff = (
            ratio if self.wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        )
        return self.start_wd + coeff * (self.end_wd - self.start_wd)


class ParamScheduler:
    """Applies an LRSchedule to an optimizer's parameter groups as samples are consumed."""

    def __init__(self, schedule: LRSchedule, optimizer: torch.optim.Optimizer) -> None:
        self.schedule, self.optimizer = schedule, optimizer
        self.samples = 0
        self.step(0)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and set every group's lr and weight decay."""
        self.samples += increment
        lr, wd = self.schedule.lr(self.samples), self.schedule.weight_decay(self.samples)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            if wd is not None:
                group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = 0
        self.step(state["samples"])
