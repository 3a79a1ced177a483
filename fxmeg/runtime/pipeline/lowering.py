"""Lowering: a schedule's compute units become each rank's steps, with the point-to-point
posts between them, DEALLOCs of sent activations and GRAD_SYNCs (``lower``; the
vocabulary is ``fxmeg.runtime.pipeline.actions``, the overview
``fxmeg.runtime.pipeline.schedules``)."""

from __future__ import annotations

import bisect

from fxmeg import schedule_registry
from fxmeg.config_sections import P2P_MODES
from fxmeg.errors import ConfigError
from fxmeg.runtime.pipeline.actions import (
    BACKWARD,
    COMPUTE,
    WEIGHT,
    Action,
    Kind,
    Schedule,
    Step,
    Unit,
    input_of,
    is_send,
    peer_chunk,
)

PAIRED, EAGER = P2P_MODES

EAGER_AHEAD = 4
"""How many units ahead ``p2p="eager"`` posts a receive. A message then moves as soon as
its send is posted, while the receiver computes, rather than once a busy receiver gets to
post for it. On gloo over two shared cores (the bench GPT at pp=2, m=8, docs/performance.md)
it made zbv and dualpipev steps 2-4% shorter and 1f1b, interleaved and zbh1 0-4%. The
price: the received buffers of up to that many units exist before they are read."""


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
        each send right after the compute that made it; the receives of unit k before
        unit k - EAGER_AHEAD, so the data lands while this rank computes.
    Both keep every channel's message order, so they pair up on both ends.

    ``grad_cuts``: cuts c (between chunks c and c+1) across which a gradient flows back;
    default all. ``placement``: each chunk's pipeline rank, default round robin; a cut
    between two chunks of one rank gets no message (the executor hands the tensors
    over). DEALLOC frees sent activations at the next unit; GRAD_SYNC precedes each
    chunk's last weight gradient (its last B or W).
    """
    assert p2p in P2P_MODES, p2p  # PipelineConfig checks it
    default = round_robin(len(schedule), num_chunks)
    where = placement or default
    cuts = frozenset(c for c in range(num_chunks - 1) if where[c] != where[c + 1])
    grads = cuts if grad_cuts is None else cuts & grad_cuts
    ahead = EAGER_AHEAD if p2p == EAGER else 0
    if where == default:  # every channel carries messages in the receiver's order
        return {
            rank: _rank_steps(
                units,
                _ahead(_needs(units, cuts, grads), ahead),
                cuts,
                grads,
                p2p=p2p,
                planned=False,
            )
            for rank, units in schedule.items()
        }
    channels = _channels(schedule, where, cuts, grads)
    lowered = {
        rank: _rank_steps(
            units,
            _lookahead(_needs(units, cuts, grads), channels, rank, ahead),
            cuts,
            grads,
            p2p=p2p,
            planned=True,
        )
        for rank, units in schedule.items()
    }
    return _free_when_received(lowered, where)


def p2p_mode(requested: str, backend: str | None) -> str:
    """The posting mode ``lower`` takes for ``PipelineConfig.p2p`` on a pipeline group of
    ``backend`` (None: no pipeline group): 'auto' is paired under NCCL, eager elsewhere.
    Eager under NCCL is refused, not run: its receives go out units before the sends the
    peer waits for, and NCCL runs a rank pair's messages in order on one stream."""
    if requested == "auto":
        return PAIRED if backend == "nccl" else EAGER
    if requested == EAGER and backend == "nccl":
        raise ConfigError(
            "p2p='eager' posts each receive up to EAGER_AHEAD units before the unit that reads it, "
            "ahead of sends the peer is waiting for; NCCL runs a rank pair's messages in order on "
            "one stream, so the first step would hang. Use p2p='paired' or 'auto' (paired under "
            "NCCL, eager on gloo)"
        )
    return requested


def round_robin(pp: int, num_chunks: int) -> tuple[int, ...]:
    """The placement of callers that name none (tests, a single rank): the rule
    ``fxmeg.schedule_registry.placement`` for a schedule that is not a V (chunk c on rank c % pp),
    over the first ``num_chunks`` chunks."""
    return schedule_registry.placement("interleaved", pp=pp, vpp=-(-num_chunks // pp))[:num_chunks]


def _needs(units: list[Unit], cuts: frozenset[int], grads: frozenset[int]) -> list[list[Action]]:
    """The receives each unit reads, then an empty list (after the last unit)."""
    return [[r for a in unit for r in _recvs_before(a, cuts, grads)] for unit in units] + [[]]


def _ahead(needs: list[list[Action]], ahead: int) -> list[list[Action]]:
    """The receives to post before each unit when each is posted ``ahead`` units before
    the unit that reads it (the first ones before the first unit), in the units' order."""
    first = [r for unit in needs[: ahead + 1] for r in unit]
    return [first] + [
        needs[k + ahead] if k + ahead < len(needs) else [] for k in range(1, len(needs))
    ]


def _rank_steps(
    units: list[Unit], recvs: list[list[Action]], cuts: frozenset[int], grads: frozenset[int], *,
    p2p: str, planned: bool,
) -> list[Step]:
    """One rank's steps. ``recvs[k]``: the receives to post before unit k (paired groups
    them with the previous unit's sends). With ``planned`` (a V placement, ``_lookahead``)
    the DEALLOCs come from ``_free_when_received``, not at the next unit."""
    if p2p == PAIRED:
        return _paired(units, recvs, cuts, grads, free_sent=not planned)
    return _eager(units, recvs, cuts, grads, free_sent=not planned)


def _paired(
    units: list[Unit],
    recvs: list[list[Action]],
    cuts: frozenset[int],
    grads: frozenset[int],
    *,
    free_sent: bool,
) -> list[Step]:
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


def _eager(
    units: list[Unit],
    recvs: list[list[Action]],
    cuts: frozenset[int],
    grads: frozenset[int],
    *,
    free_sent: bool,
) -> list[Step]:
    """Each send posted right after its compute; ``recvs[k]`` before unit k."""
    steps: list[Step] = []
    sent: list[Action] = []  # forward activations sent, to free at the next unit
    last_weight = _last_weights(units)
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


def _free_when_received(
    lowered: dict[int, list[Step]], where: tuple[int, ...]
) -> dict[int, list[Step]]:
    """The lowered steps of a V placement with its DEALLOCs, each where the receive of
    what it frees is surely posted, so that waiting for the send never waits on a rank
    that waits on this one: after this rank read a message that the receiver sent once
    it had posted that receive. None where that comes only after the backward of the
    same micro-batch, which frees the activation anyway."""
    frees: dict[int, dict[int, list[Step]]] = {r: {} for r in lowered}  # rank -> before step i
    index = _Index(lowered, where)
    for rank, steps in lowered.items():
        for i, send in (
            (i, a) for i, step in enumerate(steps) for a in step if a.kind is Kind.SEND_F
        ):
            q = index.reply_read(_receive_of(send), rank)  # this rank reads the reply
            j = index.next_compute(rank, max(i, q) + 1)
            first_backward = min(index.head_of[rank].get(Action(send.chunk, k, send.mb),
                                                         len(steps)) for k in BACKWARD)
            if first_backward < j:  # its backward, which frees the activation anyway
                continue
            frees[rank].setdefault(j, []).append((Action(send.chunk, Kind.DEALLOC, send.mb),))
    return {r: [s for i, step in enumerate(steps) for s in (*frees[r].get(i, []), step)]
            + frees[r].get(len(steps), []) for r, steps in lowered.items()}


class _Index:
    """Where things are in lowered steps, found once: the scans ``_free_when_received``
    made per send were quadratic in the micro-batches (the layout search lowers dualpipev
    at pp 64 with 512 of them)."""

    def __init__(self, lowered: dict[int, list[Step]], where: tuple[int, ...]) -> None:
        self.lowered, self.where = lowered, where
        self.step_of: dict[int, dict[Action, int]] = {}  # the first step holding an action
        self.head_of: dict[int, dict[Action, int]] = {}  # ... as the step's first
        self.reader: dict[int, dict[Action, int]] = {}  # the compute reading a receive
        self.sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}  # (peer, to) -> sends
        self.computes: dict[int, list[int]] = {}
        for rank, steps in lowered.items():
            first, head, reads, computes = {}, {}, {}, []
            for i, step in enumerate(steps):
                head.setdefault(step[0], i)
                for a in step:
                    first.setdefault(a, i)
                    if is_send(a):
                        self.sends.setdefault((rank, where[peer_chunk(a)]), []).append((i, a))
                if step[0].kind in COMPUTE:
                    computes.append(i)
                    reads.setdefault(input_of(step[0]), i)
            self.step_of[rank], self.head_of[rank] = first, head
            self.reader[rank], self.computes[rank] = reads, computes

    def next_compute(self, rank: int, start: int) -> int:
        """The first compute step of ``rank`` at or after ``start`` (len of the steps when
        none)."""
        computes = self.computes[rank]
        k = bisect.bisect_left(computes, start)
        return computes[k] if k < len(computes) else len(self.lowered[rank])

    def reply_read(self, recv: Action, rank: int) -> int:
        """The index of ``rank``'s compute that reads the first message to ``rank`` that
        the owner of ``recv`` posts from ``recv``'s post on (len of the steps when none)."""
        peer = self.where[recv.chunk]
        posted = self.step_of[peer][recv]
        sends = self.sends.get((peer, rank), [])
        k = bisect.bisect_left(sends, posted, key=lambda s: s[0])
        if k == len(sends):
            return len(self.lowered[rank])
        return self.reader[rank][_receive_of(sends[k][1])]


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
    needs: list[list[Action]], channels: dict[tuple[int, int], list[Action]], rank: int, ahead: int
) -> list[list[Action]]:
    """The receives to post before each unit when a channel's order is not the
    receiver's (the V: one rank pair carries forward activations one way and gradients
    of the other leg, interleaved as the sender computes them): each channel's receives
    in the sender's order, the next one posted as soon as the last posted one is read,
    or earlier when a unit at most ``ahead`` units on needs it. Receives of unit k are
    in ``needs[k]``."""
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
        for r in (r for soon in needs[k : k + ahead + 1] for r in soon):
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
