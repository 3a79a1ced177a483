"""Pipeline schedules as data.

A schedule is, per pipeline rank, the list of compute actions it runs: ``2F0`` is the
forward of chunk 2 on micro-batch 0, ``2B0`` its whole backward. Zero-bubble schedules
split a backward in two: ``2I0`` the gradient of the chunk's inputs (on the critical
path: the previous chunk waits for it) and ``2W0`` the gradient of its weights (deferred
into the bubble); B = I + W at once. Builders are pure functions that return them in
*units*: runs of compute actions with no communication in between (one action, or the
steady-state (forward, backward) pair of the interleaved schedule and of DualPipeV).
``lower`` adds communication between units, returning per rank a list of
*steps*: a compute action, a group of point-to-point actions posted together and awaited
together (``0SF1+0RB0``: send chunk 0's output of micro-batch 1, receive the gradient
for micro-batch 0), a DEALLOC of sent activations, or a GRAD_SYNC (``0GS3``): from the
chunk's last weight gradient (B or W) on, its gradient buckets are reduced as they
complete. ``fxmeg.runtime.pipeline.simulator`` runs lowered schedules without processes.

Three files: the vocabulary (``fxmeg.runtime.pipeline.actions``), the builders (here) and the
lowering (``fxmeg.runtime.pipeline.lowering``); this module re-exports the other two, so the rest
of the runtime and the tests read schedules from one place.

Chunk c lives on pipeline rank ``placement[c]`` (the one rule:
``fxmeg.schedule_registry.placement``): round robin (Megatron's interleaving), or a V for ZB-V and
DualPipeV, where chunks pp - 1 and pp share rank pp - 1: that boundary is a hand-off inside the
rank, not a message.

Which schedules exist, their rules on vpp, pp and m, and which builder here makes each:
``fxmeg.schedule_registry.SPECS`` (a new schedule is a row there plus its builder here).
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Callable

from fxmeg import schedule_registry
from fxmeg.errors import ScheduleError
from fxmeg.runtime.pipeline.actions import (
    BACKWARD,
    COMPUTE,
    WEIGHT,
    Action,
    Kind,
    Lowering,
    Schedule,
    Step,
    Unit,
    fmt,
    input_of,
    is_send,
    peer_chunk,
    table,
)
from fxmeg.runtime.pipeline.lowering import EAGER, PAIRED, lower, p2p_mode, round_robin

__all__ = [  # the vocabulary and the lowering, read from here by the rest of the runtime
    "BACKWARD",
    "COMPUTE",
    "EAGER",
    "PAIRED",
    "WEIGHT",
    "Action",
    "Kind",
    "Lowering",
    "Schedule",
    "Step",
    "Unit",
    "build",
    "cap_pending",
    "compute_actions",
    "fmt",
    "forward_only",
    "input_of",
    "is_send",
    "lower",
    "p2p_mode",
    "peer_chunk",
    "round_robin",
    "table",
]


# ---------------------------------------------------------------- builders


def build(name: str, *, pp: int, vpp: int, m: int, max_pending_w: int | None = None) -> Schedule:
    """Compute units per pipeline rank for schedule ``name`` ('auto' resolved), by the
    builder its ``fxmeg.schedule_registry`` row names, after that row's checks; with
    ``max_pending_w``, no rank holds more split backwards waiting for their W
    (``cap_pending``)."""
    name = schedule_registry.resolve(name, pp=pp, vpp=vpp)
    refusal = schedule_registry.layout_refusal(
        name, pp=pp, vpp=vpp
    ) or schedule_registry.batch_refusal(name, pp=pp, m=m)
    if refusal:
        raise ScheduleError(refusal)
    built = _BUILDERS[schedule_registry.SPECS[name].builder](pp, vpp, m)
    if max_pending_w is None:
        return built
    return {rank: cap_pending(units, max_pending_w) for rank, units in built.items()}


def cap_pending(units: list[Unit], cap: int) -> list[Unit]:
    """A rank's ``units`` with at most ``cap`` micro-batches between their I and their W
    at any point (the zero-bubble paper's pending Ws; ``max_pending_w``). Requires: each
    I's W later in ``units``. Ensures: an I that would make ``cap`` + 1 pending runs as
    its whole backward B instead (B numbers its micro-batch as the I did) and its W is
    dropped; every other action keeps its place. A W fills a bubble while others' inputs'
    gradients travel, so the rank saves what those micro-batches hold from I until W and
    loses that filling: the bubble grows by the Ws that became part of Bs."""
    pending: set[tuple[int, int]] = set()
    whole: set[tuple[int, int]] = set()
    capped: list[Unit] = []
    for unit in units:
        kept = []
        for a in unit:
            key = (a.chunk, a.mb)
            if a.kind is Kind.I and len(pending) >= cap:
                whole.add(key)
                a = Action(a.chunk, Kind.B, a.mb)
            elif a.kind is Kind.I:
                pending.add(key)
            elif a.kind is Kind.W and key in whole:
                continue
            elif a.kind is Kind.W:
                pending.discard(key)
            kept.append(a)
        if kept:
            capped.append(tuple(kept))
    return capped


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward (evaluation)."""
    return {
        r: [(a,) for unit in units for a in unit if a.kind is Kind.F]
        for r, units in schedule.items()
    }


def compute_actions(schedule: Schedule, rank: int) -> list[Action]:
    return [a for unit in schedule[rank] for a in unit]


def _singles(actions) -> list[Unit]:
    return [(a,) for a in actions]


def _none(pp: int, vpp: int, m: int) -> Schedule:
    """No pipeline: each micro-batch's forward, then its backward."""
    return {0: _singles(a for i in range(m) for a in (Action(0, Kind.F, i), Action(0, Kind.B, i)))}


def _gpipe(pp: int, vpp: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward."""
    return {
        r: _singles(Action(r, k, i) for k in (Kind.F, Kind.B) for i in range(m)) for r in range(pp)
    }


def _each_rank(
    rank_units: Callable[[int, int, int], list[Unit]],
) -> Callable[[int, int, int], Schedule]:
    """The builder ``(pp, vpp, m) -> Schedule`` of a per-rank one ``(rank, pp, m) -> units``."""

    @functools.wraps(rank_units)
    def builder(pp: int, vpp: int, m: int) -> Schedule:
        return {r: rank_units(r, pp, m) for r in range(pp)}

    return builder


@_each_rank
def _one_f_one_b(rank: int, pp: int, m: int) -> list[Unit]:
    """Megatron's 1F1B: warmup forwards, then one forward one backward, then cooldown."""
    warmup = min(pp - rank - 1, m)
    fwd = [Action(rank, Kind.F, i) for i in range(m)]
    bwd = [Action(rank, Kind.B, i) for i in range(m)]
    steady = [a for i in range(m - warmup) for a in (fwd[warmup + i], bwd[i])]
    return _singles(fwd[:warmup] + steady + bwd[m - warmup :])


def _interleaved(pp: int, vpp: int, m: int, group: int | None = None) -> Schedule:
    """Megatron's interleaved 1F1B over ``vpp`` chunks per rank.

    Micro-batches run in groups of ``group`` (default pp) per chunk: virtual step k runs
    micro-batch ``table[k][0]`` on this rank's model chunk ``table[k][1]``. Requires m >= pp
    and a last group of at least pp (``build`` refuses other m for group = pp).
    """
    group = group or pp
    assert m >= pp and not (m % group and m % group < pp), (m, pp, group)
    table = []  # (micro-batch, model chunk) per virtual step
    for start in range(0, m, group):
        end = m if start + group >= m else start + group
        table += [(i, j) for j in range(vpp) for i in range(start, end)]
    total = m * vpp
    out = {}
    for rank in range(pp):
        warmup = total if m == pp else min(2 * (pp - rank - 1) + (vpp - 1) * group, total)
        fwd = [Action(j * pp + rank, Kind.F, i) for i, j in table]
        bwd = [Action((vpp - 1 - j) * pp + rank, Kind.B, i) for i, j in table]
        # steady (forward, backward) pairs exchange with neighbours once per pair
        steady = [(fwd[warmup + k], bwd[k]) for k in range(total - warmup)]
        out[rank] = _singles(fwd[:warmup]) + steady + _singles(bwd[total - warmup :])
    return out


# ---------------------------------------------------------------- zero bubble
# Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): with F = I = W, ZB-H1 cuts
# 1F1B's bubble to a third at the same peak memory; ZB-V (two chunks per rank in a V)
# to near zero at 1F1B's memory. DualPipeV is DeepSeek's DualPipe (DeepSeek-V3 report)
# folded onto the same V.


class _Order:
    """A rank's compute units in order; each (chunk, kind) numbers its own micro-batches
    (a whole backward B counts as an I and a W). Split backwards' Ws wait in ``deferred``."""

    def __init__(self) -> None:
        self.units: list[Unit] = []
        self.count: Counter[tuple[int, Kind]] = Counter()
        self.deferred: deque[Action] = deque()

    def unit(self, *pairs: tuple[int, Kind]) -> None:
        """One unit of (chunk, kind) computes."""
        self.units.append(tuple(self._next(c, k) for c, k in pairs))

    def each(self, *pairs: tuple[int, Kind]) -> None:
        """Each (chunk, kind) as a unit of its own."""
        for pair in pairs:
            self.unit(pair)

    def oldest_weight(self) -> None:
        """The W of the oldest split backward whose W has not run, if any."""
        if self.deferred:
            self.units.append((self.deferred.popleft(),))

    def _next(self, chunk: int, kind: Kind) -> Action:
        a = Action(chunk, kind, self.count[chunk, Kind.I if kind is Kind.B else kind])
        for k in {Kind.B: (Kind.I, Kind.W)}.get(kind, (kind,)):
            self.count[chunk, k] += 1
        if kind is Kind.I:
            self.deferred.append(Action(chunk, Kind.W, a.mb))
        elif kind is Kind.W:
            self.deferred.remove(a)
        return a


@_each_rank
def _zbh1(rank: int, pp: int, m: int) -> list[Unit]:
    """ZB-H1: 1F1B with each backward split, rank r deferring its W by r steady steps so
    the Ws fill the cooldown. Rank r holds 1F1B's pp - r micro-batches before their I,
    and at most pp (the first rank's 1F1B peak) before their W."""
    warmup = min(pp - rank - 1, m)
    order = [Action(rank, Kind.F, i) for i in range(warmup)]
    for k in range(m):
        if warmup + k < m:
            order.append(Action(rank, Kind.F, warmup + k))
        order.append(Action(rank, Kind.I, k))
        if k >= rank:
            order.append(Action(rank, Kind.W, k - rank))
    order += [Action(rank, Kind.W, i) for i in range(max(m - rank, 0), m)]
    return _singles(order)


@_each_rank
def _zbv(rank: int, pp: int, m: int) -> list[Unit]:
    """ZB-V (the paper's §6; torch's ScheduleZBVZeroBubble): rank r runs chunk a = r on
    the way down and b = 2pp-1-r on the way back. Built for at least 2pp - 1 micro-batches
    (what fills the V), then the missing ones are dropped."""
    a, b, n = rank, 2 * pp - 1 - rank, max(2 * pp - 1, m)
    F, I, W = Kind.F, Kind.I, Kind.W
    o = _Order()
    o.each(
        *[(a, F)] * (2 * (pp - rank) - 1),
        *[(b, F), (a, F)] * rank,
        *[(b, F), (b, I), (b, W)] * (pp - rank),
    )
    while o.count[b, F] < o.count[a, F] or o.count[a, F] < n:  # steady
        if o.count[a, F] < n:
            o.each((a, F))
        o.each((a, I), (a, W), (b, F), (b, I), (b, W))
    o.each(*[(a, I), (b, I)] * rank, *[(a, I), (a, W)] * (pp - rank))  # cooldown: Is first
    o.each(*[(b, W)] * (o.count[b, I] - o.count[b, W]), *[(a, W)] * (o.count[a, I] - o.count[a, W]))
    return [u for u in o.units if u[0].mb < m]


@_each_rank
def _dualpipev(rank: int, pp: int, m: int) -> list[Unit]:
    """DualPipeV (deepseek-ai/DualPipe; torch's ScheduleDualPipeV), for m >= 2pp: rank r
    runs chunk a = r and b = 2pp-1-r. Its steady state runs a forward of one chunk
    together with the whole backward of the other (one unit: DualPipe overlaps the two);
    the warmup and the drain split backwards and run the Ws in the gaps."""
    a, b = rank, 2 * pp - 1 - rank
    F, B, I = Kind.F, Kind.B, Kind.I
    o = _Order()
    o.each(*[(a, F)] * (2 * (pp - rank - 1)), *[(a, F), (b, F)] * (rank + 1))
    for _ in range(pp - rank - 1):
        o.each((b, I))
        o.oldest_weight()
        o.each((b, F))
    for i in range(m - 2 * pp + rank + 1):  # steady: F of one chunk with B of the other
        if i == 0 and rank == pp - 1:  # the V's tip: not overlapped, a shorter bubble
            o.each((a, F), (b, B))
        else:
            o.unit((a, F), (b, B))
        o.unit((b, F), (a, B))
    for _ in range(pp - rank - 1):
        o.each((b, B))
        o.unit((b, F), (a, B))
    split, half = False, (rank + 1) // 2
    for i in range(rank + 1):  # drain: from the middle on, split backwards
        split |= i == half and rank % 2 == 1
        o.each((b, I if split else B))
        split |= i == half and rank % 2 == 0
        o.each((a, I if split else B))
    for _ in range(pp - rank - 1):
        o.oldest_weight()
        o.each((a, I if split else B))
    for _ in range(rank + 1):
        o.oldest_weight()
    assert not o.deferred, o.deferred
    return o.units


_BUILDERS = {
    f.__name__: f for f in (_none, _gpipe, _one_f_one_b, _interleaved, _zbh1, _zbv, _dualpipev)
}
"""Each builder by the name its ``fxmeg.schedule_registry.Spec`` gives it: a new builder
joins this list (tests/config/test_schedule_registry.py checks every row names one here)."""
