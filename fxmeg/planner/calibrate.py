"""On a CPU (``--cluster local``) the roofline of a matmul loop says little about a training
step: most of a small model's time is the interpreter, autograd and fxmeg's runtime around
each op. So the search trains the twin itself (fxmeg/planner/profile.py) with fxmeg on one
rank, at three shapes of a step, and fits the two numbers the time model reads: how much
slower than the measured rates the ops' FLOPs and bytes run, and the seconds each op costs
on top (docs/planner.md).
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

MAX_ELEMENTS = 50_000_000
"""A twin larger than this is not timed (the device's measured rates stand)."""


def _rows(example: Example, rows: int) -> Example:
    """``rows`` samples like the example's first, on the CPU (token ids kept in range: 0)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        shape = (rows, *t.shape[1:])
        return torch.zeros(shape, dtype=t.dtype) if not t.is_floating_point() else torch.randn(
            shape, dtype=t.dtype)
    if isinstance(example, Mapping):
        return {k: one(t) for k, t in example.items()}
    return tuple(one(t) for t in example)


def _step_seconds(rank: int, model: nn.Module, example: Example, runs, store: str,
                  out: str) -> None:
    """In a one-rank gloo group: fxmeg's median train step of ``model`` (on meta) for each
    (micro-batch size, micro-batches) of ``runs``, to ``out``."""
    import json
    import os
    import statistics

    import torch.distributed as dist

    import fxmeg

    torch.set_num_threads(1)
    # the initialisation's tiny values turn denormal within a few Adam steps, and a CPU
    # computes those 5-10x slower (measured: 0.1 s -> 0.7 s a step of the bench GPT)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        import resource

        with open("/proc/self/statm") as f:
            base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        found = []
        for rows, m in runs:
            # built on meta: fxmeg makes its values (the model's own initialisation)
            engine = fxmeg.parallelize(meta_twin(model), _rows(example, rows),
                                       global_batch_size=rows * m, seed=0)
            batch = _rows(example, rows * m)
            times = []
            for _ in range(4):
                start = time.perf_counter()
                engine.train_step(batch)
                times.append(time.perf_counter() - start)
            found.append(statistics.median(times[1:]))
            if len(found) == 1:  # the first run's peak: one micro-batch of one sample
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            del engine
        with open(out, "w") as f:
            json.dump({"steps": found, "peak": peak}, f)
    finally:
        dist.destroy_process_group()


def step_times(model: nn.Module, example: Example, runs) -> dict:
    """fxmeg's step of the twin at each (micro-batch size, micro-batches) ('steps'), and
    the peak resident bytes of the first above the process's baseline ('peak'), in a
    fresh process (a process group of its own)."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_step_seconds, args=(meta_twin(model), example, runs,
                                      os.path.join(tmp, "store"), out), nprocs=1)
        with open(out) as f:
            return json.load(f)


def fit(model: nn.Module, example: Example, base: Profile, rate: float,
        bandwidth: float) -> tuple[float, float, int] | None:
    """(slowdown of the roofline, seconds per forward op, bytes reserved) that make the time
    model's step of the twin match fxmeg's measured one: one micro-batch of 1 sample, one of
    4, and 4 of 1. The first two differ by FLOPs and bytes only (the slowdown), the first and
    the last by three micro-batches' work (what each costs besides its ops' roofline, spread
    over its ops). The reserve is the first run's peak over what ``fxmeg.plan`` counts for
    it. None for a twin too large to run here."""
    from fxmeg.diagnostics.layout_plan import plan

    if sum(p.numel() for p in model.parameters()) > MAX_ELEMENTS:
        return None
    parts = [base.pre, *base.blocks, base.post]
    ops = [op for p in parts for op in p.ops]
    found = step_times(model, example, ((1, 1), (4, 1), (1, 4)))
    one, wide, many = found["steps"]
    planned = plan(model, _rows(example, 1), global_batch_size=1).stages[0].total
    roof = [3 * op_seconds(ops, rate, bandwidth, 0.0, rows) for rows in (1, 4)]
    slow = max((wide - one) / max(roof[1] - roof[0], 1e-12), 1.0)
    per_microbatch = (many - one) / 3 - slow * roof[0]
    return slow, max(per_microbatch, 0.0) / (3 * len(ops)), max(found["peak"] - planned, 0)
