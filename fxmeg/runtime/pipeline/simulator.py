"""The schedule simulator: lowered schedules (``schedules.lower``) run as a discrete-event
simulation of the executor, without processes. Every send must meet the matching receive
in the same order on both ranks (NCCL matches point-to-point messages by order, not by
tag), nothing may deadlock, no compute may run before one it depends on; with unit costs
it reports each rank's bubble and peak number of micro-batches in flight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxmeg.errors import ScheduleError
from fxmeg.runtime.pipeline.schedules import (
    BACKWARD,
    COMPUTE,
    Action,
    Kind,
    Step,
    fmt,
    input_of,
    is_send,
    peer_chunk,
    round_robin,
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

    def peak_held_by(self, placement: Sequence[int], weights: Mapping[int, float],
                     carry: Mapping[int, float] | None = None) -> dict[int, float]:
        """Per rank, ``peak_held`` with each held micro-batch weighed by its chunk: the most
        ``weights[chunk]`` summed over the micro-batches forwarded whose weight gradient (W
        or B) has not run. Under an interleaved schedule a rank's chunks hold different
        amounts (the one with the head holds its logits), and its peak is not the largest
        chunk's times the most held. ``carry``: what a split chunk's micro-batch holds
        instead from its I until its W (``split_activations``; default: ``weights`` on).
        ``placement``: each chunk's rank; the ranks of the chunks ``weights`` names are
        answered."""
        runs: dict[int, list[tuple[float, Action]]] = {}
        for a, (start, _) in self.spans.items():
            if a.kind in (Kind.F, Kind.B, Kind.I, Kind.W) and a.chunk in weights:
                runs.setdefault(placement[a.chunk], []).append((start, a))
        after_i = carry if carry is not None else weights
        peak = {}
        for rank, actions in runs.items():
            held = best = 0.0
            for _, a in sorted(actions, key=lambda run: run[0]):
                held += {Kind.F: weights[a.chunk], Kind.B: -weights[a.chunk],
                         Kind.I: after_i[a.chunk] - weights[a.chunk],
                         Kind.W: -after_i[a.chunk]}[a.kind]
                best = max(best, held)
            peak[rank] = best
        return peak


def simulate(
    lowered: dict[int, list[Step]],
    *,
    pp: int,
    placement: tuple[int, ...] | None = None,
    f_cost: float = 1.0,
    b_cost: float = 1.0,
    i_cost: float | None = None,
    w_cost: float | None = None,
    costs: dict[tuple[int, Kind], float] | None = None,
    latency: float = 0.0,
) -> Simulation:
    """Run lowered schedules as a discrete-event simulation of the executor: posting
    never blocks; a compute waits until the peer has posted the send it reads, DEALLOC
    until the peer has posted the receive of what it frees. Raise ScheduleError on a
    deadlock, an out-of-order message, a compute before one it depends on (a backward
    before its forward, a W before its I, across a same-rank boundary a forward before
    the previous chunk's) or a DEALLOC after its micro-batch's backward. I and W cost
    half a B each unless given; ``costs`` sets the cost of a (chunk, kind) of its own (say,
    measured: bench/overhead.py), the rest cost as above. ``latency``: a message reaches
    the compute that reads it this long after both ends posted it (gloo moves it once the
    receive is posted). ``placement``: each chunk's rank, default round robin."""
    cost = {Kind.F: f_cost, Kind.B: b_cost, Kind.I: b_cost / 2 if i_cost is None else i_cost,
            Kind.W: b_cost / 2 if w_cost is None else w_cost}
    sim = _Run(lowered, pp, placement, cost, costs or {}, latency)
    progress = True
    while progress:
        progress = False
        for rank in lowered:
            while sim.pos[rank] < len(lowered[rank]) and sim.advance(rank):
                progress = True
    stuck = {r: fmt(lowered[r][sim.pos[r]]) for r in lowered if sim.pos[r] < len(lowered[r])}
    if stuck:
        at = ", ".join(f"rank {r} at {s}" for r, s in stuck.items())
        raise ScheduleError(f"schedule deadlocks: {at}")
    _check_messages(sim.queues)
    return Simulation(max(sim.clock.values()), sim.busy, {r: p[0] for r, p in sim.peak.items()},
                      {r: p[1] for r, p in sim.peak.items()}, sim.spans)


class _Run:
    """The state of one simulation: each rank's position in its steps and clock, the
    messages posted on each (side, src, dst) link in order, what each rank has run."""

    def __init__(
        self,
        lowered: dict[int, list[Step]],
        pp: int,
        placement: tuple[int, ...] | None,
        cost: dict[Kind, float],
        costs: dict[tuple[int, Kind], float],
        latency: float,
    ) -> None:
        last = max((a.chunk for steps in lowered.values() for s in steps for a in s), default=0)
        self.lowered, self.cost, self.costs, self.latency = lowered, cost, costs, latency
        self.num_chunks = len(placement) if placement else last + 1
        self.where = placement or round_robin(pp, last + 2)  # + a send's peer
        self.pos = {r: 0 for r in lowered}
        self.clock = {r: 0.0 for r in lowered}
        self.busy = {r: 0.0 for r in lowered}
        # (side, src, dst) FIFO
        self.queues: dict[tuple[str, int, int], list[tuple[Action, float]]] = {}
        # posted op -> slot
        self.posted: dict[tuple[int, Action], tuple[tuple[str, int, int], int]] = {}
        self.done: dict[int, set[Action]] = {r: set() for r in lowered}
        self.live = {r: [0, 0] for r in lowered}  # micro-batches before their I, before their W
        self.peak = {r: [0, 0] for r in lowered}
        self.spans: dict[Action, tuple[float, float]] = {}

    def slot(self, rank: int, a: Action) -> tuple[str, int, int]:
        other = self.where[peer_chunk(a)]
        return ("send", rank, other) if is_send(a) else ("recv", other, rank)

    def counterpart(self, rank: int, a: Action) -> tuple[Action, float] | None:
        """The peer's matching op, once posted."""
        (side, src, dst), index = self.posted[(rank, a)]
        other = self.queues.get(("recv" if side == "send" else "send", src, dst), [])
        return other[index] if index < len(other) else None

    def compute(self, rank: int, a: Action) -> None:
        missing = _missing(a, self.done[rank], self.where[: self.num_chunks], rank)
        if missing:
            raise ScheduleError(f"rank {rank} runs {a} before {missing}")
        self.done[rank].add(a)
        held, peak = self.live[rank], self.peak[rank]
        delta = {Kind.F: (1, 1), Kind.B: (-1, -1), Kind.I: (-1, 0), Kind.W: (0, -1)}[a.kind]
        for k in (0, 1):
            held[k] += delta[k]
            peak[k] = max(peak[k], held[k])
        cost = self.costs.get((a.chunk, a.kind), self.cost[a.kind])
        self.spans[a] = (self.clock[rank], self.clock[rank] + cost)
        self.clock[rank] += cost
        self.busy[rank] += cost

    def advance(self, rank: int) -> bool:
        """Run this rank's next step if it can; False while it waits for its peer."""
        step = self.lowered[rank][self.pos[rank]]
        a = step[0]
        if a.kind in COMPUTE:
            needed = input_of(a)
            if (rank, needed) in self.posted:
                match = self.counterpart(rank, needed)
                if match is None:
                    return False  # the peer has not sent it yet
                slot, index = self.posted[(rank, needed)]
                both = max(match[1], self.queues[slot][index][1])  # the later of the two posts
                self.clock[rank] = max(self.clock[rank], both + self.latency)
            self.compute(rank, a)
        elif a.kind is Kind.DEALLOC:
            if any(Action(a.chunk, k, a.mb) in self.done[rank] for k in BACKWARD):
                raise ScheduleError(f"rank {rank} frees {a} after the backward of its micro-batch")
            sent = Action(a.chunk, Kind.SEND_F, a.mb)
            if (rank, sent) in self.posted and self.counterpart(rank, sent) is None:
                return False  # the receiver has not taken it yet
        elif a.kind is not Kind.GRAD_SYNC:
            for op in step:
                queue = self.queues.setdefault(self.slot(rank, op), [])
                self.posted[(rank, op)] = (self.slot(rank, op), len(queue))
                queue.append((op, self.clock[rank]))
        self.pos[rank] += 1
        return True


def _check_messages(queues: dict[tuple[str, int, int], list[tuple[Action, float]]]) -> None:
    """Every link's sends meet receives of the same messages, in the same order."""
    for (side, src, dst), ops in sorted(queues.items()):
        if side != "send":
            continue
        received = queues.get(("recv", src, dst), [])
        for (send, _), (recv, _) in zip(ops, received):
            if not _matches(send, recv):
                raise ScheduleError(
                    f"message order mismatch: {send} on rank {src} meets {recv} on rank {dst}"
                )
        if len(ops) != len(received):
            raise ScheduleError(
                f"rank {src} sends {len(ops)} messages to rank {dst}, which receives "
                f"{len(received)}"
            )


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
        return (
            f"{Action(c + 1, Kind.I, i)} / {Action(c + 1, Kind.B, i)}, whose gradient it reads on "
            "this rank"
        )
    return ""
