"""gloo's sharded collectives: the fused ones against one reduce or broadcast per rank's part
(what fxmeg.runtime.groups runs on gloo). One JSON line.

For each size and world, each way of doing a reduce-scatter and an all-gather of a flat fp32
buffer in place: the median time of a few calls (slowest rank) and the most resident memory
above the tensors during a call (sampled every 0.2 ms on rank 0, glibc's mmap threshold at
64 KiB so freed buffers leave). ``fused`` is ``reduce_scatter_tensor`` / ``all_gather_into_tensor``;
``parts`` is ``groups.reduce_scatter_`` / ``groups.all_gather_``.

    python bench/collectives.py [--mib 4,16,64 --worlds 2,4 --calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import spawn, write_gathered  # noqa: E402
from fxmeg.runtime import groups  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ways(flat: torch.Tensor, world: int, rank: int):
    size = flat.numel() // world
    mine = flat[rank * size :][:size]
    fused_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fused_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    group = dist.group.WORLD
    return {
        "reduce_scatter/fused": lambda: fused_rs(mine, flat),
        "reduce_scatter/parts": lambda: groups.reduce_scatter_(flat, group).wait(),
        "all_gather/fused": lambda: fused_ag(flat, mine.clone()),
        "all_gather/parts": lambda: groups.all_gather_(flat, group).wait(),
    }


def _measure(call, calls: int) -> tuple[float, int]:
    """(median seconds of ``calls`` calls, the slowest rank's; peak bytes above the start)."""
    base, top, stop = rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            top[0] = max(top[0], rss() - base)
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    times = []
    for _ in range(calls):
        dist.barrier()
        t0 = time.perf_counter()
        call()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    stop.set()
    sampler.join()
    return statistics.median(times), top[0]


def run(rank: int, world: int, args, out: str) -> None:
    rows = []
    for mib in args.mib:
        flat = torch.ones(mib * 2**20 // 4)
        for name, call in _ways(flat, world, rank).items():
            call()  # warm: gloo's buffers and pairs exist before measuring
            seconds, extra = _measure(call, args.calls)
            rows.append({"world": world, "mib": mib, "way": name, "ms": round(seconds * 1e3, 2),
                         "peak_above_tensors_mib": round(extra / 2**20, 1)})
    write_gathered({"rank": rank, "rows": rows}, out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", type=lambda s: [int(x) for x in s.split(",")], default=[4, 16, 64])
    p.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = os.path.join(tmp, f"w{world}.json")
            spawn(world, run, args, out)
            with open(out) as f:
                rows += next(r for r in json.load(f) if r["rank"] == 0)["rows"]
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
