"""A cluster as data: one device (memory, FLOP/s per dtype, memory bandwidth, the cost of
launching one op), how many ranks a node holds, and the links inside and between nodes.

``cluster("h100:nodes=128")`` reads a preset and its overrides; ``cluster("local")`` is
this machine, measured once by ``calibrate`` (matmul rate, copy bandwidth, op overhead,
a gloo all-reduce between two processes) and cached. docs/planner.md says what each
number is for and where the presets' numbers come from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field

import torch

from fxmeg.diagnostics.devices import DEVICES, device_bytes
from fxmeg.errors import ConfigError, closest

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class Device:
    """One rank's accelerator."""

    name: str
    memory: int
    """Bytes one rank may hold."""
    flops: dict[str, float]
    """Peak dense matmul FLOP/s per precision ('fp32', 'bf16', 'fp16'): what MFU divides by
    (on ``local``, as measured)."""
    memory_bandwidth: float
    """Bytes/s an elementwise op streams through memory."""
    op_overhead: float = 5e-6
    """Seconds one op costs besides its FLOPs and bytes (launch, dispatch)."""
    efficiency: float = 1.0
    """Share of ``flops`` a training step's matmuls reach."""
    reserved: int = 0
    """Bytes a rank holds besides the model's tensors: the runtime, the libraries' context
    and buffers, the allocator's slack (on ``local``, measured on each model's twin)."""
    split_node_bytes: int = 0
    """Bytes of a rank's memory per node of the program's zero-bubble split graphs (every
    chunk's: the program is rank-free), where that memory is the host's (``local``:
    ``SPLIT_NODE_BYTES``); 0 on a GPU, whose memory does not hold them."""
    memory_error: float = 0.10
    """How far the memory model may be from a measured peak, as a share of the predicted
    one: a layout predicted within it of the cap is "tight" (``search.memory_verdict``),
    neither called fitting nor rejected. 10%: the bar the model meets on ``local``
    (bench/search_check.py, docs/planner.md); unmeasured on GPUs."""

    def peak(self, precision: str) -> float:
        return self.flops.get(precision, self.flops["fp32"])

    def rate(self, precision: str) -> float:
        """Matmul FLOP/s reached in ``precision``."""
        return self.peak(precision) * self.efficiency


@dataclass(frozen=True)
class Link:
    """A link as collectives see it: bytes/s each rank moves, and seconds per message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks, each rank one ``device``."""

    name: str
    device: Device
    ranks_per_node: int
    nodes: int
    intra: Link
    """Between ranks of one node (NVLink; on ``local``, gloo over localhost)."""
    inter: Link
    """Between nodes (InfiniBand / RoCE, per rank)."""
    overlap: bool = True
    """Whether communication runs beside compute (a GPU's copy engines); False on a CPU,
    whose cores do both."""
    notes: tuple[str, ...] = field(default=())

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes

    def link(self, stride: int, size: int) -> Link:
        """The link a group of ``size`` ranks ``stride`` apart crosses (rank order
        tp-cp-dp-pp): inside a node when the group's span fits in one."""
        return self.intra if stride * size <= self.ranks_per_node else self.inter

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _gpu(name: str, memory_key: str, bf16: float, tf32: float, bandwidth: float,
         nvlink: float, network: float, efficiency: float) -> Device:
    return Device(
        name=name, memory=DEVICES[memory_key], memory_bandwidth=bandwidth * 0.8,
        flops={"bf16": bf16, "fp16": bf16, "fp32": tf32}, op_overhead=4e-6,
        efficiency=efficiency, reserved=GPU_RESERVED,
    ), Link(nvlink, 8e-6), Link(network, 15e-6)


GPU_RESERVED = 2 * 2**30
"""A GPU rank's memory outside the model's tensors: the CUDA context, NCCL's buffers, the
caching allocator's slack (an assumption, docs/planner.md; not measured here)."""
EFFICIENCY = 0.62
"""Share of a GPU's dense peak that a training step's matmuls reach, for every GPU preset:
a placeholder, not fitted. bench/published_layouts.py matches Llama 3 405B's published 400
TFLOP/s per H100 with 0.85 (x1.38, its layout under fxmeg's full recompute) and Megatron's
1T run on A100s with 0.68 (x1.10): docs/published-layouts.md."""

_PRESETS = {
    # peak dense TFLOP/s (bf16, tf32), HBM TB/s, NVLink GB/s per direction, network GB/s per GPU
    "h100": ("NVIDIA H100 SXM", "h100", 989 * TB, 494 * TB, 3.35 * TB, 450 * GB, 50 * GB),
    "h200": ("NVIDIA H200 SXM", "h200", 989 * TB, 494 * TB, 4.8 * TB, 450 * GB, 50 * GB),
    # an H100 with NVLink cut to 400 GB/s both ways (DeepSeek's "Insights into DeepSeek-V3",
    # arXiv 2505.09343); DeepEP measures about 160 GB/s of it
    "h800": ("NVIDIA H800 SXM", "h100", 989 * TB, 494 * TB, 3.35 * TB, 200 * GB, 50 * GB),
    "a100": ("NVIDIA A100 SXM 80GB", "a100-80gb", 312 * TB, 156 * TB, 2.04 * TB, 300 * GB,
             25 * GB),
}
PRESETS = (*_PRESETS, "local")


def preset(name: str, nodes: int = 1) -> Cluster:
    """A named cluster of ``nodes`` 8-GPU nodes (``PRESETS``); 'local' is this machine."""
    key = name.lower()
    if key == "local":
        return local()
    if key not in _PRESETS:
        raise ConfigError(f"unknown cluster preset {name!r}; known: {', '.join(PRESETS)}"
                          + closest(key, PRESETS))
    title, memory, bf16, tf32, hbm, nvlink, network = _PRESETS[key]
    device, intra, inter = _gpu(title, memory, bf16, tf32, hbm, nvlink, network, EFFICIENCY)
    return Cluster(key, device, 8, nodes, intra, inter)


_FIELDS = {
    "nodes": int, "ranks_per_node": int, "memory": device_bytes, "flops": float,
    "bf16_flops": float, "fp32_flops": float, "memory_bandwidth": float, "op_overhead": float,
    "efficiency": float, "reserved": device_bytes, "memory_error": float,
    "split_node_bytes": device_bytes,
    "intra_bandwidth": float, "intra_latency": float, "inter_bandwidth": float,
    "inter_latency": float,
}


def cluster(spec: str) -> Cluster:
    """A cluster from ``--cluster``: 'PRESET[:key=value,...]' ('h100:nodes=128',
    'local:ranks_per_node=2', 'h200:nodes=4,memory=120GiB'), or a JSON file of
    ``Cluster.to_dict``'s form. The keys: ``_FIELDS``."""
    if spec.endswith(".json") and os.path.exists(spec):
        with open(spec) as f:
            return from_dict(json.load(f))
    name, _, rest = spec.partition(":")
    overrides: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _FIELDS:
            raise ConfigError(f"--cluster {spec!r}: {item!r} is not KEY=VALUE with a key among "
                              f"{', '.join(_FIELDS)}" + closest(key, _FIELDS))
        try:
            overrides[key] = _FIELDS[key](value)
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"--cluster {spec!r}: {key}={value!r}: {e}") from None
    base = preset(name, int(overrides.pop("nodes", 1)))
    return with_overrides(base, **overrides) if overrides else base


def with_overrides(c: Cluster, **o) -> Cluster:
    """``c`` with some of ``_FIELDS`` changed (all but nodes)."""
    dev = c.device
    flops = dict(dev.flops)
    if "flops" in o:
        flops = {k: o["flops"] for k in flops}
    for p in ("bf16", "fp32"):
        if f"{p}_flops" in o:
            flops[p] = o[f"{p}_flops"]
            if p == "bf16":
                flops["fp16"] = o["bf16_flops"]
    dev = dataclasses.replace(
        dev, memory=o.get("memory", dev.memory), flops=flops,
        memory_bandwidth=o.get("memory_bandwidth", dev.memory_bandwidth),
        op_overhead=o.get("op_overhead", dev.op_overhead),
        efficiency=o.get("efficiency", dev.efficiency),
        reserved=o.get("reserved", dev.reserved),
        split_node_bytes=o.get("split_node_bytes", dev.split_node_bytes),
        memory_error=o.get("memory_error", dev.memory_error))
    intra = Link(o.get("intra_bandwidth", c.intra.bandwidth), o.get("intra_latency",
                                                                     c.intra.latency))
    inter = Link(o.get("inter_bandwidth", c.inter.bandwidth), o.get("inter_latency",
                                                                     c.inter.latency))
    return dataclasses.replace(c, device=dev, intra=intra, inter=inter,
                               ranks_per_node=o.get("ranks_per_node", c.ranks_per_node))


def from_dict(d: dict) -> Cluster:
    dev = Device(**d["device"])
    return Cluster(d["name"], dev, d["ranks_per_node"], d["nodes"], Link(**d["intra"]),
                   Link(**d["inter"]), d.get("overlap", True), tuple(d.get("notes", ())))


# ---------------------------------------------------------------- this machine


def cache_path() -> str:
    """Where ``local`` keeps its calibration (FXMEG_CACHE or ~/.cache/fxmeg)."""
    root = os.environ.get("FXMEG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "fxmeg")
    key = f"{platform.node()}-{os.cpu_count()}-torch{torch.__version__}".replace("/", "_")
    return os.path.join(root, f"cluster-local-{key}.json")


def local(refresh: bool = False) -> Cluster:
    """This machine: one node of as many ranks as cores, each one thread (as the
    launcher's OMP_NUM_THREADS=1), measured by ``calibrate`` once and cached."""
    path = cache_path()
    if not refresh and os.path.exists(path):
        with open(path) as f:
            found = from_dict(json.load(f))
    else:
        found = calibrate()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(found.to_dict(), f, indent=1)
    return dataclasses.replace(found, device=dataclasses.replace(
        found.device, split_node_bytes=SPLIT_NODE_BYTES))


SPLIT_NODE_BYTES = 11 * 1024
"""Host bytes a rank holds per node of the zero-bubble split graphs, measured here: one
process transforming the bench GPT and the tiny Mixtral at pp2 zbh1 held 6.5 and 13.7 MiB
more than at 1F1B without recompute (722 and 1,593 split nodes: 9 KiB a node), 10.4 and
22.4 MiB with full recompute (784 and 1,816 nodes: 13 KiB): the traced graphs, their fake
values and what tracing them left in the heap."""


def _rate(fn, work: float, seconds: float = 0.3) -> float:
    """``work`` per call of ``fn``, per second, over about ``seconds`` (best of 3)."""
    fn()
    best = float("inf")
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while (took := time.perf_counter() - start) < seconds / 3 or calls == 0:
            fn()
            calls += 1
        best = min(best, took / calls)
    return work / best


def calibrate() -> Cluster:
    """Measure this machine on one thread: matmul FLOP/s (fp32, bf16), the bandwidth of a
    large copy, the time of a tiny op, and gloo's all-reduce between two processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 256
        a, b = torch.randn(n, n), torch.randn(n, n)
        fp32 = _rate(lambda: a @ b, 2 * n**3)
        a16, b16 = a.bfloat16(), b.bfloat16()
        bf16 = _rate(lambda: a16 @ b16, 2 * n**3)
        x = torch.randn(4 << 20)
        y = torch.empty_like(x)
        bandwidth = _rate(lambda: y.copy_(x), 2 * x.numel() * 4)
        tiny = torch.ones(8)
        overhead = 1 / _rate(lambda: tiny.add(tiny), 1.0)
    finally:
        torch.set_num_threads(threads)
    latency, link_bw = _gloo_allreduce()
    cores = os.cpu_count() or 1
    memory = _memory_bytes() // cores
    dev = Device("local CPU core", memory, {"fp32": fp32, "bf16": bf16, "fp16": bf16},
                 bandwidth, overhead)
    link = Link(link_bw, latency)
    return Cluster("local", dev, cores, 1, link, link, overlap=False,
                   notes=(f"calibrated {time.strftime('%Y-%m-%d %H:%M')}",))


def _memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30


def _gloo_allreduce() -> tuple[float, float]:
    """(seconds of a 1-element all-reduce, bytes/s of a 4 MiB one) between two gloo
    processes on this machine."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_gloo_child, args=(os.path.join(tmp, "store"), out), nprocs=2)
        with open(out) as f:
            found = json.load(f)
    return found["latency"], found["bandwidth"]


def _gloo_child(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        small, big = torch.ones(1), torch.ones(1 << 20)

        def timed(t: torch.Tensor, reps: int) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(t)
            return (time.perf_counter() - start) / reps

        timed(big, 2)
        latency = timed(small, 50)
        per = timed(big, 10)
        # ring all-reduce moves 2 (n - 1) / n = 1 x the bytes per rank at n = 2
        bandwidth = big.numel() * 4 / max(per - latency, 1e-9)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"latency": latency, "bandwidth": bandwidth}, f)
    finally:
        dist.destroy_process_group()
