"""The schedule simulator: lowered schedules (``schedules.lower``) run as a discrete-event
simulation of the executor, without processes. Every send must meet the matching receive
in the same order on both ranks (NCCL matches point-to-point messages by order, not by
tag), nothing may deadlock, no compute may run before one it depends on; with unit costs
it reports each rank's bubble and peak number of micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxmeg.errors import ScheduleError
from fxmeg.runtime.schedules import (
    BACKWARD,
    COMPUTE,
    Action,
    Kind,
    Step,
    fmt,
    input_of,
    is_send,
    peer_chunk,
)


def _matches(send: Action, recv: Action) -> bool:
    kinds = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
    return kinds[send.kind] is recv.kind and peer_chunk(send) == recv.chunk and send.mb == recv.mb


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: dict[int, float]
    peak_in_flight: dict[int, int]
    """Per rank, the most micro-batches (over all its chunks) forwarded whose input
    gradient (I or B) has not run: the ones holding all their activations."""
    peak_held: dict[int, int]
    """Per rank, the most micro-batches forwarded whose weight gradient (W or B) has not
    run: the ones holding any activation (the same as ``peak_in_flight`` without W)."""
    spans: dict[Action, tuple[float, float]]
    """Start and end of every compute action (each runs on one rank only)."""

    def bubble(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan


def simulate(
    lowered: dict[int, list[Step]],
    *,
    pp: int,
    placement: tuple[int, ...] | None = None,
    f_cost: float = 1.0,
    b_cost: float = 1.0,
    i_cost: float | None = None,
    w_cost: float | None = None,
) -> Simulation:
    """Run lowered schedules as a discrete-event simulation of the executor: posting
    never blocks; a compute waits until the peer has posted the send it reads, DEALLOC
    until the peer has posted the receive of what it frees. Raise ScheduleError on a
    deadlock, an out-of-order message, a compute before one it depends on (a backward
    before its forward, a W before its I, across a same-rank boundary a forward before
    the previous chunk's) or a DEALLOC after its micro-batch's backward. I and W cost
    half a B each unless given. ``placement``: each chunk's rank, default round robin."""
    last = max((a.chunk for steps in lowered.values() for s in steps for a in s), default=0)
    num_chunks = len(placement) if placement else last + 1
    where = placement or tuple(c % pp for c in range(last + 2))  # + a send's peer
    cost = {Kind.F: f_cost, Kind.B: b_cost, Kind.I: b_cost / 2 if i_cost is None else i_cost,
            Kind.W: b_cost / 2 if w_cost is None else w_cost}
    pos = {r: 0 for r in lowered}
    clock = {r: 0.0 for r in lowered}
    busy = {r: 0.0 for r in lowered}
    queues: dict[tuple[str, int, int], list[tuple[Action, float]]] = {}  # (kind, src, dst) FIFO
    where_posted: dict[tuple[int, Action], tuple[tuple[str, int, int], int]] = {}  # posted op -> slot
    done: dict[int, set[Action]] = {r: set() for r in lowered}
    live = {r: [0, 0] for r in lowered}  # (before I, before W)
    peak = {r: [0, 0] for r in lowered}
    spans: dict[Action, tuple[float, float]] = {}

    def slot(rank: int, a: Action) -> tuple[str, int, int]:
        other = where[peer_chunk(a)]
        return ("send", rank, other) if is_send(a) else ("recv", other, rank)

    def counterpart(rank: int, a: Action) -> tuple[Action, float] | None:
        """The peer's matching op, once posted."""
        (side, src, dst), index = where_posted[(rank, a)]
        other = queues.get(("recv" if side == "send" else "send", src, dst), [])
        return other[index] if index < len(other) else None

    def compute(rank: int, a: Action) -> None:
        missing = _missing(a, done[rank], where[:num_chunks], rank)
        if missing:
            raise ScheduleError(f"rank {rank} runs {a} before {missing}")
        done[rank].add(a)
        held = live[rank]
        delta = {Kind.F: (1, 1), Kind.B: (-1, -1), Kind.I: (-1, 0), Kind.W: (0, -1)}[a.kind]
        for k in (0, 1):
            held[k] += delta[k]
            peak[rank][k] = max(peak[rank][k], held[k])
        spans[a] = (clock[rank], clock[rank] + cost[a.kind])
        clock[rank] += cost[a.kind]
        busy[rank] += cost[a.kind]

    def advance(rank: int) -> bool:
        step = lowered[rank][pos[rank]]
        a = step[0]
        if a.kind in COMPUTE:
            needed = input_of(a)
            if (rank, needed) in where_posted:
                match = counterpart(rank, needed)
                if match is None:
                    return False  # the peer has not sent it yet
                clock[rank] = max(clock[rank], match[1])
            compute(rank, a)
        elif a.kind is Kind.DEALLOC:
            if any(Action(a.chunk, k, a.mb) in done[rank] for k in BACKWARD):
                raise ScheduleError(f"rank {rank} frees {a} after the backward of its micro-batch")
            sent = Action(a.chunk, Kind.SEND_F, a.mb)
            if (rank, sent) in where_posted and counterpart(rank, sent) is None:
                return False  # the receiver has not taken it yet
        elif a.kind is not Kind.GRAD_SYNC:
            for op in step:
                queue = queues.setdefault(slot(rank, op), [])
                where_posted[(rank, op)] = (slot(rank, op), len(queue))
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
    return Simulation(max(clock.values()), busy, {r: p[0] for r, p in peak.items()},
                      {r: p[1] for r, p in peak.items()}, spans)


def _missing(a: Action, done: set[Action], where: tuple[int, ...], rank: int) -> str:
    """What compute ``a`` needs that this rank has not run ('' when nothing): its own
    chunk's earlier passes, and the neighbour chunk's on this rank (a V's tip)."""
    c, i = a.chunk, a.mb

    def ran(chunk: int, *kinds: Kind) -> bool:
        return any(Action(chunk, k, i) in done for k in kinds)

    if a.kind is Kind.F:
        if c > 0 and where[c - 1] == rank and not ran(c - 1, Kind.F):
            return f"{Action(c - 1, Kind.F, i)}, which feeds it on this rank"
        return ""
    if a.kind is Kind.W:
        return "" if ran(c, Kind.I) else f"its input gradient {Action(c, Kind.I, i)}"
    if not ran(c, Kind.F):
        return "its forward"
    if c + 1 < len(where) and where[c + 1] == rank and not ran(c + 1, *BACKWARD):
        return f"{Action(c + 1, Kind.I, i)} / {Action(c + 1, Kind.B, i)}, whose gradient it reads on this rank"
    return ""
