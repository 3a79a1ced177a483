"""The time model of DualPipe's overlap (``overlap_moe_expert_parallel_comm``): in each unit
that pairs chunk x's forward with chunk y's backward, the runtime runs the backward in a
second lane (fxmeg/runtime/lanes.py), so that either lane's expert all-to-alls wait while
the other computes.

A pair then takes at least the longest of: the two lanes' compute on the one device
(``cF + cB``), the two lanes' all-to-alls on the one network (``eF + eB``), and each lane
alone (``cF + eF``, ``cB + eB``). The model takes that bound, as DualPipe's schedule is
built to reach it; the rest of the two actions' sum is hidden, charged to the two
all-to-alls in proportion. Only the ep all-to-alls are hidden; tp and cp collectives stay
exposed. Only where the cluster overlaps communication with compute
(``Cluster.overlap``): on this machine's CPU the two lanes share each rank's one core,
and were measured no faster (docs/performance.md, "Hiding the all-to-all").
"""

from __future__ import annotations

import functools
from collections import Counter

from fxmeg.runtime.pipeline import schedules
from fxmeg.runtime.pipeline.schedules import Kind


@functools.cache
def paired(pp: int, m: int) -> tuple[tuple[tuple[int, int], float], ...]:
    """Each (forward's chunk, backward's chunk) that DualPipeV pairs in one unit at ``pp``
    ranks and ``m`` micro-batches, with the share of the forward's chunk's m forwards that
    run in such a pair (the rest, in the warmup and the drain, run alone)."""
    count = Counter(
        (f.chunk, b.chunk)
        for units in schedules.build("dualpipev", pp=pp, vpp=2, m=m).values()
        for f, b in (u for u in units if len(u) == 2)
        if f.kind is Kind.F and b.kind is Kind.B
    )
    return tuple((pair, n / m) for pair, n in sorted(count.items()))


def hide(f_cost: dict, b_cost: dict, comm_f: dict, comm_b: dict, pp: int, m: int) -> None:
    """Take from each chunk's forward and backward seconds (``f_cost``, ``b_cost``, one
    micro-batch's) and from their ep communication (``comm_f[c]['ep']``, ``comm_b``) what
    the second lane hides, averaged over the chunk's micro-batches (module docstring)."""
    for (x, y), share in paired(pp, m):
        e_f, e_b = comm_f[x]["ep"], comm_b[y]["ep"]
        if e_f + e_b <= 0:
            continue
        c_f, c_b = f_cost[x] - e_f, b_cost[y] - e_b
        took = max(c_f + c_b, e_f + e_b, c_f + e_f, c_b + e_b)
        saved = (c_f + e_f + c_b + e_b - took) * share
        for costs, comm, c, e in ((f_cost, comm_f, x, e_f), (b_cost, comm_b, y, e_b)):
            cut = saved * e / (e_f + e_b)
            costs[c] -= cut
            comm[c] = {**comm[c], "ep": comm[c]["ep"] - cut}
