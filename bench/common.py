"""Helpers shared by the benchmarks: spawning ranks, timing, saved-activation metering."""

from __future__ import annotations

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


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class SavedBytes:
    """Peak bytes of activations autograd saves for backward (parameters excluded),
    counting each storage once. CPU has no allocator statistics; this is the memory a
    pipeline schedule changes."""

    def __init__(self, params) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return _Handle(t, None, self)
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Handle(t, (key, storage.nbytes()), self)

    def release(self, key: tuple[int, int]) -> None:
        self.refs[key[0]] -= 1
        if self.refs[key[0]] == 0:
            self.live -= key[1]


class _Handle:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter.release(self.key)
