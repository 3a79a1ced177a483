"""On a CPU (``--cluster local``) the roofline of a matmul loop says little about a training
step: most of a small model's time is the interpreter, autograd and fxmeg's runtime around
each op, and a layout's kernels differ (context parallelism's attention runs another
kernel than one rank's). So the search times the twin's transformed graphs themselves
(fxmeg/planner/profile.py): for every intra-layer layout (``Key``) it will visit, fxmeg
trains the twin on the cluster's ranks (the key's tp x cp, the rest data parallel) at
three shapes of a step, and the time model is fitted to them (docs/planner.md):

- one micro-batch of 1 sample, 4 of them, and 2 of 2 samples give each key's forward and
  backward of a micro-batch at 1 and 2 samples (communication included) and what a step
  costs besides them;
- the twin with each block twice, at 1 and 4 micro-batches, tells the blocks' seconds from
  the rest's (embedding, head, loss), which the real model holds in other proportions;
- the first key's (no tp, cp or ep) set the roofline's slowdown and each op's overhead,
  and the rank's memory reserve (its peak over the time model's count).

The measurements are cached per model, example and key (``cache_path``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fxmeg.config import Example
from fxmeg.frontend.variable_shapes import meta_twin
from fxmeg.planner.profile import Key

MAX_ELEMENTS = 50_000_000
"""A twin larger than this is not timed (the device's measured rates stand)."""
RUNS = ((1, 1), (1, 4), (2, 2))
"""The twin's step shapes timed per key: (samples per micro-batch, micro-batches) per
replica."""
DEEPER_RUNS = ((1, 1), (1, 4))
"""The same for the twin with each block twice (``profile.deeper``)."""
SHARDED_RUNS = ((1, 1), (1, 4))
"""The same at zero=2 for the first key (no tp, cp, ep) when it has data parallelism:
sharded gradients are reduced every micro-batch, at what this machine's link makes of it."""
STEPS = 8
"""Steps per shape; the first is not counted (its first call's allocations). Two ranks
on two cores time a step within about 5% (their communication threads share the cores),
and a micro-batch's seconds are differences of steps: the median of seven, and shapes
three micro-batches apart."""


@dataclass(frozen=True)
class Timing:
    """The twin's measured step under one key, on ``world`` ranks."""

    microbatch: tuple[float, float]
    """Seconds of one micro-batch's forward and backward, of 1 and of 2 samples."""
    fixed: float
    """Seconds of a step besides its micro-batches (optimizer, gradient norm, the
    data-parallel reduction, the loop)."""
    deeper: float
    """One micro-batch of 1 sample of the twin with each block twice: past ``microbatch[0]``,
    the seconds of the twin's blocks once more."""
    sharded: float | None
    """What a micro-batch takes more at zero=2 (its gradients reduced); the first key's."""
    peak: int
    """The first shape's peak resident bytes above the rank's baseline (the first key's
    only: later keys run in the same process)."""

    def per_microbatch(self, samples: int) -> float:
        """One micro-batch of ``samples``, linear in them."""
        one, two = self.microbatch
        return one + (two - one) * (samples - 1)

    @property
    def split(self) -> tuple[float, float] | None:
        """(seconds of the twin's blocks, of the rest) in a micro-batch of 1 sample; None
        when the measurements contradict (noise: a block costs nothing, or everything)."""
        blocks = self.deeper - self.microbatch[0]
        rest = self.microbatch[0] - blocks
        return (blocks, rest) if blocks > 0 and rest > 0 else None

    @classmethod
    def of(cls, steps: list[float], peak: int) -> Timing:
        """From the median step of each of ``RUNS``, ``DEEPER_RUNS`` and, where run,
        ``SHARDED_RUNS``."""
        one, many, wide, deep_one, deep_many = steps[:5]
        per = (many - one) / 3
        fixed = one - per
        sharded = (steps[6] - steps[5]) / 3 - per if len(steps) == 7 else None
        return cls((per, (wide - fixed) / 2), fixed, (deep_many - deep_one) / 3, sharded,
                   peak)


def _rows(example: Example, rows: int) -> Example:
    """``rows`` samples like the example's first, on the CPU (token ids kept in range: 0)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        shape = (rows, *t.shape[1:])
        return torch.zeros(shape, dtype=t.dtype) if not t.is_floating_point() else torch.randn(
            shape, dtype=t.dtype)
    if isinstance(example, Mapping):
        return {k: one(t) for k, t in example.items()}
    return tuple(one(t) for t in example)


def torch_baseline() -> int:
    """Resident bytes of a fresh interpreter that imported torch: the baseline a rank's
    peak is measured above (what fxmeg loads lazily, torch's compiler stack among it, about
    90 MiB, then counts, whatever the parent's main module imported first)."""
    import subprocess

    code = ("import os, torch; print(int(open('/proc/self/statm').read().split()[1]) * "
            "os.sysconf('SC_PAGE_SIZE'))")
    return int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True).stdout)


def _time_keys(rank: int, world: int, model: nn.Module, deep: nn.Module, example: Example,
               keys: list[Key], options: dict, base: int, store: str, out: str,
               say: bool) -> None:
    """In a gloo group of ``world``: each key's median step of ``model`` (on meta) and of
    ``deep`` at each of ``RUNS`` and ``DEEPER_RUNS`` (and ``SHARDED_RUNS``), the slowest
    rank's, and the first
    run's peak resident bytes above ``base``, written by rank 0 to ``out``."""
    import torch.distributed as dist

    import fxmeg
    from fxmeg.diagnostics.devices import peak_resident

    torch.set_num_threads(1)
    # the initialisation's tiny values turn denormal within a few Adam steps, and a CPU
    # computes those 5-10x slower (measured: 0.1 s -> 0.7 s a step of the bench GPT)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        found = []
        for i, key in enumerate(keys):
            if say and rank == 0:
                print(f"timing the twin at {key} ({i + 1}/{len(keys)})",
                      file=sys.stderr, flush=True)
            dp = world // (key.tp * key.cp)
            steps, peak = [], 0
            runs = [(model, *r, 0) for r in RUNS] + [(deep, *r, 0) for r in DEEPER_RUNS]
            if key == Key() and dp > 1:
                runs += [(model, *r, 2) for r in SHARDED_RUNS]
            for net, rows, m, zero in runs:
                # built on meta: fxmeg makes its values (the model's own initialisation)
                engine = fxmeg.parallelize(
                    meta_twin(net), _rows(example, rows), global_batch_size=rows * m * dp,
                    seed=0, dp=dp, zero=zero, **options, **key.options())
                batch = _rows(example, rows * m * dp)
                times = []
                for _ in range(STEPS):
                    dist.barrier()
                    start = time.perf_counter()
                    engine.train_step(batch)
                    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    times.append(float(took))
                steps.append(statistics.median(times[1:]))
                if not found and not peak:
                    peak = peak_resident() - base
                del engine
            found.append({"steps": steps, "peak": peak})
        if rank == 0:
            with open(out, "w") as f:
                json.dump(found, f)
    finally:
        dist.destroy_process_group()


def cache_path(model: nn.Module, example: Example, options: dict, world: int) -> str:
    """The file of this twin's timings: the model's class and every parameter's name, shape
    and dtype, the example's shapes, the shared options, the ranks, torch's version and
    the shapes timed."""
    from fxmeg.config import example_tensors
    from fxmeg.planner.cluster import cache_path as cluster_cache

    text = repr((type(model).__name__, [(n, tuple(p.shape), str(p.dtype))
                                        for n, p in model.named_parameters()],
                 [(tuple(t.shape), str(t.dtype)) for t in example_tensors(example)],
                 sorted(options.items()), world, torch.__version__, RUNS, DEEPER_RUNS,
                 SHARDED_RUNS, "VmHWM"))  # peaks read as the process's own (not ru_maxrss)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(cluster_cache()), f"twin-{digest}.json")


def time_keys(model: nn.Module, deep: nn.Module, example: Example, keys: list[Key],
              world: int, *, options: dict | None = None,
              progress: Callable[[str], None] | None = None) -> dict[Key, Timing] | None:
    """Each key's ``Timing`` of the twin ``model`` (and ``deep``, it with each block twice)
    on ``world`` ranks, those not cached
    measured in one start of ``world`` processes (the first key first: its peak is the
    fresh process's). None for a twin too large to run here."""
    import tempfile

    import torch.multiprocessing as mp

    if sum(p.numel() for p in model.parameters()) > MAX_ELEMENTS:
        return None
    options = dict(options or {})
    path = cache_path(model, example, options, world)
    cached: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
    # the first key first: its process's peak is the one read
    todo = sorted((k for k in keys if repr(k) not in cached), key=lambda k: k != keys[0])
    if todo:
        (progress or (lambda line: None))(
            f"timing the twin on this machine: {len(todo)} layouts of a layer, {world} ranks "
            "(cached after)")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.spawn(_time_keys, args=(world, meta_twin(model), meta_twin(deep), example, todo,
                                       options, torch_baseline(), os.path.join(tmp, "store"),
                                       out, progress is not None), nprocs=world)
            with open(out) as f:
                measured = json.load(f)
        cached |= {repr(key): m for key, m in zip(todo, measured)}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cached, f)
    return {k: Timing.of(cached[repr(k)]["steps"], cached[repr(k)]["peak"])
            for k in keys}
