"""Optimizer set-up: default parameter groups and the default inner optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Megatron's default groups: weight decay for matrices, none for 1-D parameters
    (biases, norm weights). A factory that wants one group can flatten them:
    ``lambda groups: AdamW([p for g in groups for p in g["params"]])``."""
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (no_decay if p.dim() <= 1 else decay).append(p)
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def default_optimizer(groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW with PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), weight decay 0.01)."""
    return torch.optim.AdamW(groups)
