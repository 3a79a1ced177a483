"""Timelines: what each rank did in a step, as Chrome / Perfetto trace JSON, the numbers
read from it, and a rank x time chart.

A ``Tracer`` collects spans (name, category, start, end in ns of CLOCK_MONOTONIC, which
processes on one host share; across hosts the tracks are only as aligned as the hosts'
clocks). The executor records every schedule step (forward,
backward, point-to-point exchange, deallocation, grad sync), the data-parallel buffers
their bucket reductions (issue, and the wait for them), the engine finalize and the
optimizer; under expert parallelism the token all-to-alls (``ep_a2a``, inside the
forward and backward spans: runtime/experts.py). Disabled, it costs one ``is None`` test
per schedule step.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

CATEGORY = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad", "D": "dealloc",
            "GS": "grad_sync"}
COMPUTE = ("forward", "backward", "input_grad", "weight_grad")
"""Categories of compute spans (a zero-bubble backward splits into input_grad and weight_grad)."""


class Tracer:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, int]] | None = None

    @property
    def on(self) -> bool:
        return self.events is not None

    def begin_step(self, enabled: bool) -> None:
        self.events = [] if enabled else None

    def add(self, name: str, category: str, start: int, end: int) -> None:
        if self.events is not None:
            self.events.append((name, category, start, end))

    @contextmanager
    def span(self, name: str, category: str):
        if self.events is None:
            yield
            return
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.events.append((name, category, start, time.perf_counter_ns()))


def chrome(per_rank: list[list[tuple]], labels: list[str] | None = None) -> dict:
    """Chrome trace JSON (opens in Perfetto / chrome://tracing): one process per rank."""
    events = []
    for rank, spans in enumerate(per_rank):
        name = labels[rank] if labels else f"rank {rank}"
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": name}}
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
        for label, cat, start, end in spans:
            events.append({"name": label, "cat": cat, "ph": "X", "pid": rank, "tid": 0,
                           "ts": start / 1e3, "dur": max(end - start, 0) / 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(path: str, per_rank: list[list[tuple]], labels: list[str] | None = None) -> None:
    with open(path, "w") as f:
        json.dump(chrome(per_rank, labels), f)


def load(path: str) -> list[list[tuple]]:
    """Spans per rank from a trace file written by ``write``."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ranks = max((e["pid"] for e in events), default=-1) + 1
    out: list[list[tuple]] = [[] for _ in range(ranks)]
    for e in events:
        if e["ph"] == "X":
            start = int(e["ts"] * 1e3)
            out[e["pid"]].append((e["name"], e["cat"], start, start + int(e["dur"] * 1e3)))
    return out


def analyze(per_rank: list[list[tuple]]) -> dict:
    """From one step's spans: per rank, the bubble (share of the schedule's span that is
    not forward / backward compute), the time in point-to-point exchanges and in expert
    all-to-alls (``a2a_s``, part of the compute spans they sit in); and the
    share of data-parallel reduction time hidden behind backward (1 - the wait left for
    the reductions after backward / the time from the first bucket issued to the
    reductions done)."""
    sched = [
        [s for s in spans if s[1] in (*COMPUTE, "p2p", "dealloc", "grad_sync")]
        for spans in per_rank
    ]
    start = min(s[2] for spans in sched for s in spans)
    end = max(s[3] for spans in sched for s in spans)
    makespan = end - start
    out = {"schedule_s": makespan / 1e9, "ranks": []}
    for rank, spans in enumerate(per_rank):
        compute = sum(s[3] - s[2] for s in spans if s[1] in COMPUTE)
        p2p = sum(s[3] - s[2] for s in spans if s[1] == "p2p")
        a2a = sum(s[3] - s[2] for s in spans if s[1] == "ep_a2a")
        issues = [s[2] for s in spans if s[1] == "dp_issue"]
        waits = [s for s in spans if s[1] == "dp_wait"]
        hidden = None
        if issues and waits:
            exposed = sum(w[3] - w[2] for w in waits)
            window = max(w[3] for w in waits) - min(issues)
            hidden = 1.0 - exposed / window if window > 0 else None
        out["ranks"].append({"rank": rank, "bubble": 1.0 - compute / makespan, "p2p_s": p2p / 1e9,
                             "compute_s": compute / 1e9, "a2a_s": a2a / 1e9, "dp_hidden": hidden})
    return out


def plot(per_rank: list[list[tuple]], out: str, title: str = "") -> str:
    """The rank x time chart of a step, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "#4c72b0", "backward": "#dd8452", "input_grad": "#e3a33b",
              "weight_grad": "#64b5cd",
              "p2p": "#c0c0c0", "dealloc": "#8c8c8c", "ep_a2a": "#da8bc3",
              "grad_sync": "#55a868", "dp_wait": "#c44e52", "dp_issue": "#c44e52",
              "optimizer": "#8172b3", "finalize": "#937860"}
    t0 = min(s[2] for spans in per_rank for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1.2))
    for rank, spans in enumerate(per_rank):
        # all-to-alls over their compute
        for name, cat, a, b in sorted(spans, key=lambda s: s[1] == "ep_a2a"):
            if cat == "step":
                continue
            ax.broken_barh([((a - t0) / 1e6, max((b - a) / 1e6, 0.02))], (rank - 0.4, 0.8),
                           color=colors.get(cat, "#cccccc"))
            if cat in COMPUTE and (b - a) / 1e6 > 0.02 * ((max(s[3] for s in spans) - t0) / 1e6):
                ax.text((a + b) / 2e6 - t0 / 1e6, rank, name, ha="center", va="center", fontsize=6,
                        color="white")
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or "schedule")
    shown = [c for c in (*COMPUTE, "p2p", "dp_wait", "finalize", "optimizer", "ep_a2a")
             if c not in ("input_grad", "weight_grad",
                          "ep_a2a") or any(s[1] == c for spans in per_rank for s in spans)]
    labels = {"input_grad": "input grad (I)", "weight_grad": "weight grad (W)",
              "p2p": "send / recv",
              "ep_a2a": "expert all-to-all",
              "dp_wait": "DP wait", "finalize": "finalize grads"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in shown]
    ax.legend(handles, [labels.get(c, c) for c in shown], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def gather(events: list[tuple], label: str) -> tuple[list[list[tuple]], list[str]] | None:
    """Every rank's spans and labels on global rank 0 (None elsewhere); a collective over
    the whole world when torch.distributed is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [list(events)], [label]
    mine = (label, list(events))
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if every is None:
        return None
    return [spans for _, spans in every], [name for name, _ in every]
