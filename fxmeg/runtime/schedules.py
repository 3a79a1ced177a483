"""Pipeline schedules as data.

A schedule is, per pipeline rank, the list of compute actions it runs: ``2F0`` is the
forward of chunk 2 on micro-batch 0, ``2B0`` its whole backward. Zero-bubble schedules
split a backward in two: ``2I0`` the gradient of the chunk's inputs (on the critical
path: the previous chunk waits for it) and ``2W0`` the gradient of its weights (deferred
into the bubble); B = I + W at once. Builders are pure functions that return them in
*units*: runs of compute actions with no communication in between (one action, or the
steady-state (forward, backward) pair of the interleaved schedule and of DualPipeV). ``lower`` adds communication between units, returning per rank a list of
*steps*: a compute action, a group of point-to-point actions posted together and awaited
together (``0SF1+0RB0``: send chunk 0's output of micro-batch 1, receive the gradient
for micro-batch 0), a DEALLOC of sent activations, or a GRAD_SYNC (``0GS3``): from the
chunk's last weight gradient (B or W) on, its gradient buckets are reduced as they
complete. ``fxmeg.runtime.simulator`` runs lowered schedules without processes.

Chunk c lives on pipeline rank ``placement[c]`` (the one rule: ``fxmeg.config.placement``):
round robin (Megatron's interleaving), or a V for ZB-V and DualPipeV, where chunks pp - 1 and pp
share rank pp - 1: that boundary is a hand-off inside the rank, not a message.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from fxmeg import config
from fxmeg.config import P2P_MODES, V_SCHEDULES
from fxmeg.errors import ScheduleError


class Kind(Enum):
    F = "F"
    B = "B"
    I = "I"  # the paper's name: input gradient
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    DEALLOC = "D"
    GRAD_SYNC = "GS"


COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
BACKWARD = (Kind.B, Kind.I)
"""The kinds that compute a chunk's input gradient (read RECV_B, feed SEND_B)."""
WEIGHT = (Kind.B, Kind.W)
"""The kinds that compute (accumulate) a chunk's weight gradient."""
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|GS|F|B|I|W|D)(\d+)$")


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
        return {r: _singles(Action(r, k, i) for k in (Kind.F, Kind.B) for i in range(m)) for r in range(pp)}
    if name == "1f1b":
        return {r: _one_f_one_b(r, pp, m) for r in range(pp)}
    if name == "interleaved":
        return _interleaved(pp, vpp, m)
    if name == "zbh1":
        return {r: _zbh1(r, pp, m) for r in range(pp)}
    if name in V_SCHEDULES:
        if vpp != 2:
            raise ScheduleError(f"schedule {name!r} runs two chunks per rank in a V: vpp=2, got vpp={vpp}")
        if name == "dualpipev" and m < 2 * pp:
            raise ScheduleError(
                f"DualPipeV needs at least 2 * pp = {2 * pp} micro-batches (one per chunk); got "
                f"m={m}. Choose global_batch_size so that m >= {2 * pp}, or schedule='zbv'"
            )
        builder = _zbv if name == "zbv" else _dualpipev
        return {r: builder(r, pp, m) for r in range(pp)}
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


def _zbv(rank: int, pp: int, m: int) -> list[Unit]:
    """ZB-V (the paper's §6; torch's ScheduleZBVZeroBubble): rank r runs chunk a = r on
    the way down and b = 2pp-1-r on the way back. Built for at least 2pp - 1 micro-batches
    (what fills the V), then the missing ones are dropped."""
    a, b, n = rank, 2 * pp - 1 - rank, max(2 * pp - 1, m)
    F, I, W = Kind.F, Kind.I, Kind.W
    o = _Order()
    o.each(*[(a, F)] * (2 * (pp - rank) - 1), *[(b, F), (a, F)] * rank, *[(b, F), (b, I), (b, W)] * (pp - rank))
    while o.count[b, F] < o.count[a, F] or o.count[a, F] < n:  # steady
        if o.count[a, F] < n:
            o.each((a, F))
        o.each((a, I), (a, W), (b, F), (b, I), (b, W))
    o.each(*[(a, I), (b, I)] * rank, *[(a, I), (a, W)] * (pp - rank))  # cooldown: Is first
    o.each(*[(b, W)] * (o.count[b, I] - o.count[b, W]), *[(a, W)] * (o.count[a, I] - o.count[a, W]))
    return [u for u in o.units if u[0].mb < m]


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


# ---------------------------------------------------------------- lowering

PAIRED, EAGER = P2P_MODES


def lower(
    schedule: Schedule,
    *,
    num_chunks: int,
    grad_cuts: frozenset[int] | None = None,
    p2p: str = PAIRED,
    placement: tuple[int, ...] | None = None,
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
    default all. ``placement``: each chunk's pipeline rank, default round robin; a cut
    between two chunks of one rank gets no message (the executor hands the tensors
    over). DEALLOC frees sent activations at the next unit; GRAD_SYNC precedes each
    chunk's last weight gradient (its last B or W).
    """
    assert p2p in P2P_MODES, p2p  # EngineConfig checks it
    default = round_robin(len(schedule), num_chunks)
    where = placement or default
    cuts = frozenset(c for c in range(num_chunks - 1) if where[c] != where[c + 1])
    grads = cuts if grad_cuts is None else cuts & grad_cuts
    if where == default:  # every channel carries messages in the receiver's order
        return {rank: _rank_steps(units, _needs(units, cuts, grads), cuts, grads, p2p=p2p, planned=False)
                for rank, units in schedule.items()}
    channels = _channels(schedule, where, cuts, grads)
    lowered = {rank: _rank_steps(units, _lookahead(_needs(units, cuts, grads), channels, rank), cuts, grads,
                                 p2p=p2p, planned=True) for rank, units in schedule.items()}
    return _free_when_received(lowered, where)


def round_robin(pp: int, num_chunks: int) -> tuple[int, ...]:
    """The placement of callers that name none (tests, a single rank): the rule
    ``fxmeg.config.placement`` for a schedule that is not a V (chunk c on rank c % pp),
    over the first ``num_chunks`` chunks."""
    return config.placement("interleaved", pp=pp, vpp=-(-num_chunks // pp))[:num_chunks]


def _needs(units: list[Unit], cuts: frozenset[int], grads: frozenset[int]) -> list[list[Action]]:
    """The receives each unit reads, then an empty list (after the last unit)."""
    return [[r for a in unit for r in _recvs_before(a, cuts, grads)] for unit in units] + [[]]


def _rank_steps(
    units: list[Unit], recvs: list[list[Action]], cuts: frozenset[int], grads: frozenset[int], *,
    p2p: str, planned: bool,
) -> list[Step]:
    """One rank's steps. ``recvs[k]``: the receives unit k reads (eager posts them one
    unit ahead), or with ``planned`` the receives to post before unit k (``_lookahead``,
    a V placement: its DEALLOCs then come from ``_free_when_received``, not at the next
    unit)."""
    if p2p == PAIRED:
        return _paired(units, recvs, cuts, grads, free_sent=not planned)
    if planned:
        return _eager(units, recvs, cuts, grads, first=[], free_sent=False)
    return _eager(units, recvs[1:], cuts, grads, first=recvs[0], free_sent=True)


def _paired(units: list[Unit], recvs: list[list[Action]], cuts: frozenset[int], grads: frozenset[int], *,
            free_sent: bool) -> list[Step]:
    """Megatron's pairing: before unit k, one group of the previous unit's sends and the
    receives of unit k (send_forward_recv_backward, ...)."""
    steps: list[Step] = []
    pending: list[Action] = []  # sends waiting for the next group
    sent: list[Action] = []  # forward activations sent, to free at the next unit
    last_weight = _last_weights(units)
    for k, unit in enumerate(units):
        _post(steps, pending + recvs[k])
        _free(steps, sent)
        pending, sent = [], []
        for a in unit:
            sends = _compute(steps, a, last_weight, cuts, grads)
            pending += sends
            sent += _activations(sends) if free_sent else []
    _post(steps, pending)
    _free(steps, sent)
    return steps


def _eager(units: list[Unit], recvs: list[list[Action]], cuts: frozenset[int], grads: frozenset[int], *,
           first: list[Action], free_sent: bool) -> list[Step]:
    """Each send posted right after its compute; ``first`` before everything, then
    ``recvs[k]`` before unit k."""
    steps: list[Step] = []
    sent: list[Action] = []  # forward activations sent, to free at the next unit
    last_weight = _last_weights(units)
    _post(steps, first)
    for k, unit in enumerate(units):
        _post(steps, recvs[k])
        _free(steps, sent)
        sent = []
        for a in unit:
            sends = _compute(steps, a, last_weight, cuts, grads)
            _post(steps, sends)
            sent += _activations(sends) if free_sent else []
    _free(steps, sent)
    return steps


def _last_weights(units: list[Unit]) -> dict[int, Action]:
    """Each chunk's last weight-gradient action (B or W): its GRAD_SYNC goes before it."""
    return {a.chunk: a for unit in units for a in unit if a.kind in WEIGHT}


def _compute(steps: list[Step], a: Action, last_weight: dict[int, Action], cuts: frozenset[int],
             grads: frozenset[int]) -> list[Action]:
    """Append compute ``a`` (after its chunk's GRAD_SYNC if it is the last weight
    gradient); return the sends of what it made."""
    if last_weight.get(a.chunk) == a:
        steps.append((Action(a.chunk, Kind.GRAD_SYNC, a.mb),))
    steps.append((a,))
    return _sends_after(a, cuts, grads)


def _activations(sends: list[Action]) -> list[Action]:
    return [s for s in sends if s.kind is Kind.SEND_F]


def _free(steps: list[Step], sent: list[Action]) -> None:
    steps.extend((Action(a.chunk, Kind.DEALLOC, a.mb),) for a in sent)


def _free_when_received(lowered: dict[int, list[Step]], where: tuple[int, ...]) -> dict[int, list[Step]]:
    """The lowered steps of a V placement with its DEALLOCs, each where the receive of
    what it frees is surely posted, so that waiting for the send never waits on a rank
    that waits on this one: after this rank read a message that the receiver sent once
    it had posted that receive. None where that comes only after the backward of the
    same micro-batch, which frees the activation anyway."""
    frees: dict[int, dict[int, list[Step]]] = {r: {} for r in lowered}  # rank -> before step i
    for rank, steps in lowered.items():
        for i, send in ((i, a) for i, step in enumerate(steps) for a in step if a.kind is Kind.SEND_F):
            q = _reply_read(lowered, where, _receive_of(send), rank)  # this rank reads the reply
            j = next((k for k in range(max(i, q) + 1, len(steps)) if steps[k][0].kind in COMPUTE), len(steps))
            backward = [Action(send.chunk, k, send.mb) for k in BACKWARD]
            if any(step[0] in backward for step in steps[:j]):
                continue
            frees[rank].setdefault(j, []).append((Action(send.chunk, Kind.DEALLOC, send.mb),))
    return {r: [s for i, step in enumerate(steps) for s in (*frees[r].get(i, []), step)]
            + frees[r].get(len(steps), []) for r, steps in lowered.items()}


def _reply_read(lowered: dict[int, list[Step]], where: tuple[int, ...], recv: Action, rank: int) -> int:
    """The index of ``rank``'s compute that reads the first message to ``rank`` that the
    owner of ``recv`` posts from ``recv``'s post on (len of the steps when none)."""
    peer, mine = where[recv.chunk], lowered[rank]
    posted = next(i for i, step in enumerate(lowered[peer]) if recv in step)
    reply = next((a for step in lowered[peer][posted:] for a in step
                  if is_send(a) and where[peer_chunk(a)] == rank), None)
    if reply is None:
        return len(mine)
    wanted = _receive_of(reply)
    return next(i for i, step in enumerate(mine) if step[0].kind in COMPUTE and input_of(step[0]) == wanted)


def _receive_of(send: Action) -> Action:
    kind = Kind.RECV_F if send.kind is Kind.SEND_F else Kind.RECV_B
    return Action(peer_chunk(send), kind, send.mb)


def _channels(
    schedule: Schedule, where: tuple[int, ...], cuts: frozenset[int], grads: frozenset[int]
) -> dict[tuple[int, int], list[Action]]:
    """Per (sender, receiver) rank pair, the receives of its messages in the sender's order."""
    out: dict[tuple[int, int], list[Action]] = {}
    for rank, units in schedule.items():
        for a in (a for unit in units for a in unit):
            for send in _sends_after(a, cuts, grads):
                recv = _receive_of(send)
                out.setdefault((rank, where[recv.chunk]), []).append(recv)
    return out


def _lookahead(
    needs: list[list[Action]], channels: dict[tuple[int, int], list[Action]], rank: int
) -> list[list[Action]]:
    """The receives to post before each unit when a channel's order is not the
    receiver's (the V: one rank pair carries forward activations one way and gradients
    of the other leg, interleaved as the sender computes them): each channel's receives
    in the sender's order, the next one posted as soon as the last posted one is read,
    or earlier when a unit needs it. Receives of unit k are in ``needs[k]``."""
    mine = {src: msgs for (src, dst), msgs in channels.items() if dst == rank}
    index = {r: (src, j) for src, msgs in mine.items() for j, r in enumerate(msgs)}
    posted = dict.fromkeys(mine, 0)
    plan: list[list[Action]] = [[] for _ in needs]

    def upto(src: int, j: int, k: int) -> None:
        while posted[src] <= min(j, len(mine[src]) - 1):
            plan[k].append(mine[src][posted[src]])
            posted[src] += 1

    for src in mine:
        upto(src, 0, 0)
    for k, unit in enumerate(needs[:-1]):
        for r in unit:
            upto(*index[r], k)
        for r in unit:
            src, j = index[r]
            upto(src, j + 1, k + 1)
    return plan


def _recvs_before(a: Action, cuts: frozenset[int], grads: frozenset[int]) -> list[Action]:
    if a.kind is Kind.F and a.chunk - 1 in cuts:
        return [Action(a.chunk, Kind.RECV_F, a.mb)]
    if a.kind in BACKWARD and a.chunk in grads:
        return [Action(a.chunk, Kind.RECV_B, a.mb)]
    return []


def _sends_after(a: Action, cuts: frozenset[int], grads: frozenset[int]) -> list[Action]:
    if a.kind is Kind.F and a.chunk in cuts:
        return [Action(a.chunk, Kind.SEND_F, a.mb)]
    if a.kind in BACKWARD and a.chunk - 1 in grads:
        return [Action(a.chunk, Kind.SEND_B, a.mb)]
    return []


def _post(steps: list[Step], group: list[Action]) -> None:
    if group:
        steps.append(tuple(group))


def input_of(a: Action) -> Action | None:
    """The receive whose tensor compute action ``a`` reads, if it reads one."""
    kind = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}.get(a.kind)
    return None if kind is None else Action(a.chunk, kind, a.mb)


# ---------------------------------------------------------------- peers and printing


def peer_chunk(a: Action) -> int:
    """The chunk at the other end of a point-to-point action."""
    return a.chunk + (1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else -1)


def is_send(a: Action) -> bool:
    return a.kind in (Kind.SEND_F, Kind.SEND_B)


def table(lowered: dict[int, list[Step]]) -> str:
    """Rank x step grid, one row per rank."""
    rows = {r: [fmt(s) for s in steps] for r, steps in sorted(lowered.items())}
    width = max((len(c) for cells in rows.values() for c in cells), default=1)
    return "\n".join(
        f"rank {r}: " + " ".join(c.ljust(width) for c in cells).rstrip() for r, cells in rows.items()
    )
