"""Spawn real gloo ranks on localhost for a test and collect what each rank returns.

One spawn is expensive here (seconds: every rank imports torch), so a test module runs
all its scenarios for one world size in one spawn (``run_worlds``) and its tests read
the results from a module-scoped fixture.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 300  # a hang fails the test instead of stalling CI


def run_world(world: int, fn, *args, deadline_s: float = DEADLINE_S) -> list:
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is imported by name in the children).
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _child, args=(world, tmp, fn.__module__, fn.__name__, args),
            nprocs=world, join=False, start_method="spawn",
        )
        end = time.monotonic() + deadline_s
        while not ctx.join(timeout=max(0.0, end - time.monotonic())):
            if time.monotonic() >= end:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world}-rank run of {fn.__name__} exceeded {deadline_s}s")
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]


def run_worlds(fn, scenarios, worlds) -> dict[int, list]:
    """One spawn per world size in ``worlds``: ``fn(rank, [the scenarios of that world])``
    (scenarios with a ``world`` attribute); {world size: the per-rank results}."""
    return {w: run_world(w, fn, [s for s in scenarios if s.world == w]) for w in worlds}


def _child(rank: int, world: int, tmp: str, module: str, name: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        result = getattr(importlib.import_module(module), name)(rank, *args)
        torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
