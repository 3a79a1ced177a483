"""Pipeline schedules as data.

A schedule is, per pipeline rank, the list of compute actions it runs: ``2F0`` is the
forward of chunk 2 on micro-batch 0, ``2B0`` its backward. Builders are pure functions
that return them in *units*: runs of compute actions with no communication in between
(one action, or Megatron's steady-state (forward, backward) pair of the interleaved
schedule). ``lower`` adds communication between units, returning per rank a list of
*steps*: a compute action, a group of point-to-point actions posted together and awaited
together (``0SF1+0RB0``: send chunk 0's output of micro-batch 1, receive the gradient
for micro-batch 0), a DEALLOC of sent activations, or a GRAD_SYNC (``0GS3``): from the
chunk's last backward on, its gradient buckets are reduced as they complete. ``simulate`` runs lowered schedules without processes:
every send must meet the matching receive in the same order on both ranks (NCCL matches
point-to-point messages by order, not by tag), nothing may deadlock, and with unit costs
it reports each rank's bubble and peak number of micro-batches in flight.

Chunk c lives on pipeline rank c % pp (Megatron's interleaved placement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

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
_LOCAL = (Kind.DEALLOC, Kind.GRAD_SYNC)  # steps that involve no peer


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


def lower(
    schedule: Schedule, *, num_chunks: int, grad_cuts: frozenset[int] | None = None
) -> dict[int, list[Step]]:
    """Insert communication: between two units, the sends of the first and the receives
    of the second form one group (Megatron's send_forward_recv_backward,
    send_backward_recv_forward, send_forward_backward_recv_forward_backward), so
    neighbouring ranks never wait on each other's sends.

    ``grad_cuts``: cuts c (between chunks c and c+1) across which a gradient flows back;
    default all. DEALLOC follows the group that sent a forward activation; GRAD_SYNC
    precedes each chunk's last backward.
    """
    grads = frozenset(range(num_chunks - 1)) if grad_cuts is None else grad_cuts
    lowered = {}
    for rank, units in schedule.items():
        last_backward = {a.chunk: a for unit in units for a in unit if a.kind is Kind.B}
        steps: list[Step] = []
        pending: list[Action] = []
        for unit in units:
            _flush(steps, pending + [r for a in unit for r in _recvs_before(a, grads)])
            for a in unit:
                if last_backward.get(a.chunk) == a:
                    steps.append((Action(a.chunk, Kind.GRAD_SYNC, a.mb),))
                steps.append((a,))
            pending = [s for a in unit for s in _sends_after(a, num_chunks, grads)]
        _flush(steps, pending)
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


def _flush(steps: list[Step], group: list[Action]) -> None:
    if group:
        steps.append(tuple(group))
        steps.extend((Action(a.chunk, Kind.DEALLOC, a.mb),) for a in group if a.kind is Kind.SEND_F)


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
    """Run lowered schedules as a discrete-event simulation; raise ScheduleError on a
    deadlock, an out-of-order message, or a backward before its forward."""
    pos = {r: 0 for r in lowered}
    clock = {r: 0.0 for r in lowered}
    busy = {r: 0.0 for r in lowered}
    posted: dict[tuple[int, int], list[int]] = {}  # (rank, step index) -> op ids, once posted
    sends: dict[tuple[int, int], list[tuple[Action, float]]] = {}  # (src, dst) FIFO
    recvs: dict[tuple[int, int], list[tuple[Action, float]]] = {}
    done_f: dict[int, set[tuple[int, int]]] = {r: set() for r in lowered}
    live: dict[int, int] = {r: 0 for r in lowered}
    peak: dict[int, int] = {r: 0 for r in lowered}

    def channel(rank: int, a: Action) -> tuple[int, int]:
        other = peer_chunk(a) % pp
        return (rank, other) if is_send(a) else (other, rank)

    def advance(rank: int) -> bool:
        step = lowered[rank][pos[rank]]
        a = step[0]
        if a.kind in COMPUTE:
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
        elif a.kind not in _LOCAL:
            if (rank, pos[rank]) not in posted:
                posted[(rank, pos[rank])] = []
                for op in step:
                    queue = (sends if is_send(op) else recvs).setdefault(channel(rank, op), [])
                    posted[(rank, pos[rank])].append(len(queue))
                    queue.append((op, clock[rank]))
            finish = clock[rank]
            for op, idx in zip(step, posted[(rank, pos[rank])]):
                other = (recvs if is_send(op) else sends).get(channel(rank, op), [])
                if idx >= len(other):
                    return False  # the peer has not posted its side yet
                peer_op, t = other[idx]
                send, recv = (op, peer_op) if is_send(op) else (peer_op, op)
                if not _matches(send, recv):
                    raise ScheduleError(
                        f"message order mismatch: {send} on rank {channel(rank, op)[0]} "
                        f"meets {recv} on rank {channel(rank, op)[1]}"
                    )
                finish = max(finish, t)
            clock[rank] = finish
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
        where = ", ".join(f"rank {r} at {s}" for r, s in stuck.items())
        raise ScheduleError(f"schedule deadlocks: {where}")
    return Simulation(max(clock.values()), busy, peak)


def table(lowered: dict[int, list[Step]]) -> str:
    """Rank x step grid, one row per rank."""
    rows = {r: [fmt(s) for s in steps] for r, steps in sorted(lowered.items())}
    width = max((len(c) for cells in rows.values() for c in cells), default=1)
    return "\n".join(
        f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip() for r, cells in rows.items()
    )
