"""Start real gloo ranks on localhost for a test and collect what each rank returns.

Ranks fork from a multiprocessing fork server that imported torch, fxmeg and transformers
once per pytest process: a spawned rank spends about 5 CPU seconds importing them (the suite
took 42 minutes with spawn, 32 with the fork server). The server only imports (no process
group, no device), so a rank forked from it starts as clean as a spawned one.
``FXMEG_TEST_START_METHOD=spawn`` brings back spawn, which tools/test_cpu.py needs (it
counts the CPU time of reaped children, and the fork server's children are not the test
process's).

The ranks of a start share each transform (tests/harness/shared_transform.py): the first rank to
transform a model writes the Program and the others load it, bound to their own model
(a transform was about half of a rank's time). Whichever rank transforms runs
``FXMEG_VERIFY``'s pass checks.

A start is still not free, so a test module runs all its scenarios for one world size in
one start (``run_worlds``) and its tests read the results from a module-scoped fixture.
"""

from __future__ import annotations

import gc
import importlib
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness import shared_transform

DEADLINE_S = 300  # a hang fails the test instead of stalling CI
START_METHOD = os.environ.get("FXMEG_TEST_START_METHOD", "forkserver")
PRELOAD = [
    "torch",
    "torch.distributed",
    "fxmeg",
    "fxmeg.train.trainer",
    "tests.harness.helpers",
    "tests.harness.shared_transform",
    "transformers",
]

mp.set_forkserver_preload(PRELOAD)  # a module the server cannot import is skipped there


def run_world(world: int, fn, *args, deadline_s: float = DEADLINE_S) -> list:
    """Run ``fn(rank, *args)`` on ``world`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is imported by name in the children).
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _child, args=(world, tmp, fn.__module__, fn.__name__, args),
            nprocs=world, join=False, start_method=START_METHOD,
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
    gc.freeze()  # the server's imports are never garbage: collections (one per engine) skip them
    os.environ["OMP_NUM_THREADS"] = "1"
    # one transform per spawn, not one per rank
    shared_transform.install(os.path.join(tmp, "programs"))
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        result = getattr(importlib.import_module(module), name)(rank, *args)
        torch.save(result, os.path.join(tmp, f"{rank}.pt"))
    finally:
        if dist.is_initialized():  # the test may have destroyed it (tests/runtime/test_exit.py)
            dist.destroy_process_group()
