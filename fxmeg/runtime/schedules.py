"""Pipeline schedules as data.

A schedule is, per pipeline rank, the list of compute actions it runs: ``2F0`` is the
forward of chunk 2 on micro-batch 0, ``2B0`` its backward. Builders are pure functions
that return them in *units*: runs of compute actions with no communication in between
(one action, or Megatron's steady-state (forward, backward) pair of the interleaved
schedule). ``lower`` adds communication between units, returning per rank a list of
*steps*: a compute action, a group of point-to-point actions posted together and awaited
together (``0SF1+0RB0``: send chunk 0's output of micro-batch 1, receive the gradient
for micro-batch 0), a DEALLOC of sent activations, or a GRAD_SYNC (``0GS3``): from the
chunk's last backward on, its gradient buckets are reduced as they complete.
``simulate`` runs lowered schedules without processes: every send must meet the matching
receive in the same order on both ranks (NCCL matches point-to-point messages by order,
not by tag), nothing may deadlock, and with unit costs it reports each rank's bubble and
peak number of micro-batches in flight.

Chunk c lives on pipeline rank c % pp (Megatron's interleaved placement).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from fxmeg.config import P2P_MODES
from fxmeg.errors import ScheduleError


class Kind(Enum):
    F = "F"
    B = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    DEALLOC = "D"
    GRAD_SYNC = "GS"


COMPUTE = (Kind.F, Kind.B)
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|GS|F|B|D)(\d+)$")


@dataclass(frozen=True)
class Action:
    chunk: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.mb}"

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION.match(text)
        if not m:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0' or '0SF1')")
        return Action(int(m[1]), Kind(m[2]), int(m[3]))


Step = tuple[Action, ...]


def fmt(step: Step) -> str:
    return "+".join(map(str, step))


# ---------------------------------------------------------------- builders


Unit = tuple[Action, ...]
Schedule = dict[int, list[Unit]]
Lowering = Callable[[Schedule], dict[int, list[Step]]]
"""A schedule's lowering for one Program (RankContext.lower)."""


def build(name: str, *, pp: int, vpp: int, m: int) -> Schedule:
    """Compute units per pipeline rank for schedule ``name``."""
    if name == "none":
        assert pp == 1 and vpp == 1
        return {0: _singles(a for i in range(m) for a in (Action(0, Kind.F, i), Action(0, Kind.B, i)))}
    if name == "gpipe":
        return {r: _singles(Action(r, k, i) for k in COMPUTE for i in range(m)) for r in range(pp)}
    if name == "1f1b":
        return {r: _one_f_one_b(r, pp, m) for r in range(pp)}
    if name == "interleaved":
        return _interleaved(pp, vpp, m)
    raise ScheduleError(f"unknown schedule {name!r}")


def forward_only(schedule: Schedule) -> Schedule:
    """The same schedule without backward (evaluation)."""
    return {
        r: [(a,) for unit in units for a in unit if a.kind is Kind.F] for r, units in schedule.items()
    }


def compute_actions(schedule: Schedule, rank: int) -> list[Action]:
    return [a for unit in schedule[rank] for a in unit]


def _singles(actions) -> list[Unit]:
    return [(a,) for a in actions]


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
    micro-batch ``table[k][0]`` on this rank's model chunk ``table[k][1]``.
    """
    group = group or pp
    if m < pp or (m % group and m % group < pp):
        raise ScheduleError(
            f"the interleaved schedule needs the micro-batch count m to be a multiple of "
            f"{group} (or leave a remainder >= pp={pp}); got m={m}. Choose "
            f"global_batch_size so that m is one of {[group * i for i in (1, 2, 3)]}"
        )
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


# ---------------------------------------------------------------- lowering

PAIRED, EAGER = P2P_MODES


def lower(
    schedule: Schedule, *, num_chunks: int, grad_cuts: frozenset[int] | None = None, p2p: str = PAIRED
) -> dict[int, list[Step]]:
    """Insert communication. Every point-to-point step only *posts* its messages; the
    executor waits for a received tensor right before the compute that reads it, and for
    a sent one before it is freed (DEALLOC) or at the end of the step.

    ``p2p`` places the posts:
      * ``"paired"`` (Megatron): between two units, the sends of the first and the
        receives of the second form one group (send_forward_recv_backward, ...), matched
        by the same group on the neighbour. NCCL needs this: it runs a pair's messages in
        order on one stream and a send holds that stream until the peer receives it.
      * ``"eager"`` (host backends such as gloo, whose sends never hold anything back):
        each send right after the compute that made it; the receives of the next unit
        before this unit's compute, so the data lands while this rank computes.
    Both keep every channel's message order, so they pair up on both ends.

    ``grad_cuts``: cuts c (between chunks c and c+1) across which a gradient flows back;
    default all. DEALLOC frees sent activations at the next unit; GRAD_SYNC precedes
    each chunk's last backward.
    """
    assert p2p in P2P_MODES, p2p  # EngineConfig checks it
    grads = frozenset(range(num_chunks - 1)) if grad_cuts is None else grad_cuts
    lowered = {}
    for rank, units in schedule.items():
        last_backward = {a.chunk: a for unit in units for a in unit if a.kind is Kind.B}
        recvs = [[r for a in unit for r in _recvs_before(a, grads)] for unit in units] + [[]]
        steps: list[Step] = []
        pending: list[Action] = []  # paired: sends waiting for the next group
        sent: list[Action] = []  # forward activations sent, to free at the next unit
        if p2p == EAGER:
            _post(steps, recvs[0])
        for k, unit in enumerate(units):
            if p2p == PAIRED:
                _post(steps, pending + recvs[k])
            else:
                _post(steps, recvs[k + 1])  # pre-post the next unit's receives
            steps.extend((Action(a.chunk, Kind.DEALLOC, a.mb),) for a in sent)
            sent = []
            pending = []
            for a in unit:
                if last_backward.get(a.chunk) == a:
                    steps.append((Action(a.chunk, Kind.GRAD_SYNC, a.mb),))
                steps.append((a,))
                sends = _sends_after(a, num_chunks, grads)
                if p2p == EAGER:
                    _post(steps, sends)
                else:
                    pending += sends
                sent += [s for s in sends if s.kind is Kind.SEND_F]
        _post(steps, pending)
        steps.extend((Action(a.chunk, Kind.DEALLOC, a.mb),) for a in sent)
        lowered[rank] = steps
    return lowered


def _recvs_before(a: Action, grads: frozenset[int]) -> list[Action]:
    if a.kind is Kind.F and a.chunk > 0:
        return [Action(a.chunk, Kind.RECV_F, a.mb)]
    if a.kind is Kind.B and a.chunk in grads:
        return [Action(a.chunk, Kind.RECV_B, a.mb)]
    return []


def _sends_after(a: Action, num_chunks: int, grads: frozenset[int]) -> list[Action]:
    if a.kind is Kind.F and a.chunk < num_chunks - 1:
        return [Action(a.chunk, Kind.SEND_F, a.mb)]
    if a.kind is Kind.B and a.chunk - 1 in grads:
        return [Action(a.chunk, Kind.SEND_B, a.mb)]
    return []


def _post(steps: list[Step], group: list[Action]) -> None:
    if group:
        steps.append(tuple(group))


def input_of(a: Action) -> Action | None:
    """The receive whose tensor compute action ``a`` reads, if it reads one."""
    kind = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}.get(a.kind)
    return None if kind is None else Action(a.chunk, kind, a.mb)


# ---------------------------------------------------------------- peers


def peer_chunk(a: Action) -> int:
    """The chunk at the other end of a point-to-point action."""
    return a.chunk + (1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


def is_send(a: Action) -> bool:
    return a.kind in (Kind.SEND_F, Kind.SEND_B)


def _matches(send: Action, recv: Action) -> bool:
    kinds = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
    return kinds[send.kind] is recv.kind and peer_chunk(send) == recv.chunk and send.mb == recv.mb


# ---------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: dict[int, float]
    peak_in_flight: dict[int, int]
    """Per rank, the most micro-batches (over all its chunks) forwarded but not yet backwarded."""

    def bubble(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan


def simulate(
    lowered: dict[int, list[Step]], *, pp: int, f_cost: float = 1.0, b_cost: float = 1.0
) -> Simulation:
    """Run lowered schedules as a discrete-event simulation of the executor: posting
    never blocks; a compute waits until the peer has posted the send it reads, DEALLOC
    until the peer has posted the receive of what it frees. Raise ScheduleError on a
    deadlock, an out-of-order message, or a backward before its forward."""
    pos = {r: 0 for r in lowered}
    clock = {r: 0.0 for r in lowered}
    busy = {r: 0.0 for r in lowered}
    queues: dict[tuple[str, int, int], list[tuple[Action, float]]] = {}  # (kind, src, dst) FIFO
    where: dict[tuple[int, Action], tuple[tuple[str, int, int], int]] = {}  # posted op -> slot
    done_f: dict[int, set[tuple[int, int]]] = {r: set() for r in lowered}
    live: dict[int, int] = {r: 0 for r in lowered}
    peak: dict[int, int] = {r: 0 for r in lowered}

    def slot(rank: int, a: Action) -> tuple[str, int, int]:
        other = peer_chunk(a) % pp
        return ("send", rank, other) if is_send(a) else ("recv", other, rank)

    def counterpart(rank: int, a: Action) -> tuple[Action, float] | None:
        """The peer's matching op, once posted."""
        (side, src, dst), index = where[(rank, a)]
        other = queues.get(("recv" if side == "send" else "send", src, dst), [])
        return other[index] if index < len(other) else None

    def advance(rank: int) -> bool:
        step = lowered[rank][pos[rank]]
        a = step[0]
        if a.kind in COMPUTE:
            needed = input_of(a)
            if (rank, needed) in where:
                match = counterpart(rank, needed)
                if match is None:
                    return False  # the peer has not sent it yet
                clock[rank] = max(clock[rank], match[1])
            key = (a.chunk, a.mb)
            if a.kind is Kind.B:
                if key not in done_f[rank]:
                    raise ScheduleError(f"rank {rank} runs {a} before its forward")
                live[rank] -= 1
            else:
                done_f[rank].add(key)
                live[rank] += 1
                peak[rank] = max(peak[rank], live[rank])
            cost = f_cost if a.kind is Kind.F else b_cost
            clock[rank] += cost
            busy[rank] += cost
        elif a.kind is Kind.DEALLOC:
            sent = Action(a.chunk, Kind.SEND_F, a.mb)
            if (rank, sent) in where and counterpart(rank, sent) is None:
                return False  # the receiver has not taken it yet
        elif a.kind is not Kind.GRAD_SYNC:
            for op in step:
                queue = queues.setdefault(slot(rank, op), [])
                where[(rank, op)] = (slot(rank, op), len(queue))
                queue.append((op, clock[rank]))
        pos[rank] += 1
        return True

    progress = True
    while progress:
        progress = False
        for rank in lowered:
            while pos[rank] < len(lowered[rank]) and advance(rank):
                progress = True
    stuck = {r: fmt(lowered[r][pos[r]]) for r in lowered if pos[r] < len(lowered[r])}
    if stuck:
        at = ", ".join(f"rank {r} at {s}" for r, s in stuck.items())
        raise ScheduleError(f"schedule deadlocks: {at}")
    for (side, src, dst), ops in sorted(queues.items()):
        if side != "send":
            continue
        received = queues.get(("recv", src, dst), [])
        for (send, _), (recv, _) in zip(ops, received):
            if not _matches(send, recv):
                raise ScheduleError(f"message order mismatch: {send} on rank {src} meets {recv} on rank {dst}")
        if len(ops) != len(received):
            raise ScheduleError(f"rank {src} sends {len(ops)} messages to rank {dst}, which receives {len(received)}")
    return Simulation(max(clock.values()), busy, peak)


def table(lowered: dict[int, list[Step]]) -> str:
    """Rank x step grid, one row per rank."""
    rows = {r: [fmt(s) for s in steps] for r, steps in sorted(lowered.items())}
    width = max((len(c) for cells in rows.values() for c in cells), default=1)
    return "\n".join(
        f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip() for r, cells in rows.items()
    )
