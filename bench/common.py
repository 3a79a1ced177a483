"""Helpers shared by the benchmarks: spawning ranks, timing; saved-activation metering
is fxmeg.diagnostics.measured_activations.SavedBytes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(world: int, fn: Callable, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (one thread each)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_child, args=(world, os.path.join(tmp, "store"), fn, args), nprocs=world)


def _child(rank: int, world: int, store: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def timed(step: Callable[[], object]) -> float:
    """Wall time of one step, the slowest rank's (every rank starts together)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def write_gathered(report: dict, out: str) -> None:
    """Every rank's ``report``, in rank order, written by rank 0 to ``out`` as JSON."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, report)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(ranks, f)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    """The benchmarks' shared flags (model shape, micro-batching, steps); ``defaults``
    override their values (None drops a flag), or add flags of their own (e.g. pp=2)."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    flags = (
        dict(m=8, mbs=2, layers=4, hidden=128, seq=128, vocab=2048, steps=10, warmup=2) | defaults
    )
    for name, value in flags.items():
        if value is not None:
            p.add_argument(f"--{name}", type=type(value), default=value)
    return p


def plain_step(model, opt, ids, labels, m: int, mbs: int) -> Callable[[], None]:
    """One step of plain single-process PyTorch over m micro-batches of mbs rows: the
    reference every speedup is measured against."""

    def step() -> None:
        opt.zero_grad()
        for i in range(m):
            rows = slice(i * mbs, (i + 1) * mbs)
            (model(ids[rows], labels[rows]) / m).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step
