"""On a CPU (``--cluster local``) the roofline of a matmul loop says little about a training
step: most of a small model's time is the interpreter and autograd around each op. So the
search times the twin itself (fxmeg/planner/profile.py), forward and backward in plain
PyTorch at two micro-batch sizes on one thread, and fits the two numbers the time model
reads: how much slower than the measured rates the ops' FLOPs and bytes run, and the
seconds each op costs on top (docs/planner.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from fxmeg.config import Example
from fxmeg.frontend.variable_shapes import meta_twin
from fxmeg.planner.estimate import op_seconds
from fxmeg.planner.profile import Profile

SIZES = (1, 4)
"""The micro-batch sizes timed: the FLOPs scale with them, the per-op cost does not."""
MAX_ELEMENTS = 50_000_000
"""A twin larger than this is not timed (the device's measured rates stand)."""


def _loss(model: nn.Module, batch: Example) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    if isinstance(out, torch.Tensor):
        return out
    return out.loss if hasattr(out, "loss") else out[0]


def _rows(example: Example, rows: int) -> Example:
    """``rows`` samples like the example's first, on the CPU (token ids kept in range: 0)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        shape = (rows, *t.shape[1:])
        return torch.zeros(shape, dtype=t.dtype) if not t.is_floating_point() else torch.randn(
            shape, dtype=t.dtype)
    if isinstance(example, Mapping):
        return {k: one(t) for k, t in example.items()}
    return tuple(one(t) for t in example)


def time_twin(model: nn.Module, example: Example, rows: int, repeats: int = 3) -> float:
    """Seconds of one forward and backward of ``model`` (materialised on the CPU, random
    weights) on ``rows`` samples, the best of ``repeats`` on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = meta_twin(model).to_empty(device="cpu")
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0.0, 0.02)
        batch = _rows(example, rows)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            _loss(net, batch).backward()
            best = min(best, time.perf_counter() - start)
            net.zero_grad(set_to_none=True)
        return best
    finally:
        torch.set_num_threads(threads)


def fit(model: nn.Module, example: Example, base: Profile, rate: float,
        bandwidth: float) -> tuple[float, float] | None:
    """(slowdown of the roofline, seconds per forward op) that make the time model's
    forward + backward of the twin (3 x forward) match its measured time at ``SIZES``;
    None for a twin too large to time here."""
    if sum(p.numel() for p in model.parameters()) > MAX_ELEMENTS:
        return None
    parts = [base.pre, *base.blocks, base.post]
    ops = [op for p in parts for op in p.ops]
    measured = [time_twin(model, example, rows) for rows in SIZES]
    roof = [3 * op_seconds(ops, rate, bandwidth, 0.0, rows) for rows in SIZES]
    # measured = slow * roof + 3 * len(ops) * per_op, at both sizes
    slow = (measured[1] - measured[0]) / max(roof[1] - roof[0], 1e-12)
    slow = max(slow, 1.0)
    per_op = max((measured[0] - slow * roof[0]) / (3 * len(ops)), 0.0)
    return slow, per_op
