"""Schedules as data: built, lowered and simulated without processes."""

import itertools

import pytest
from expecttest import TestCase

from fxmeg.errors import ScheduleError
from fxmeg.runtime.pipeline.schedules import (
    Action,
    Kind,
    build,
    compute_actions,
    forward_only,
    lower,
    table,
)
from fxmeg.runtime.pipeline.simulator import simulate


def _name(pp: int, vpp: int) -> str:
    return "none" if pp == 1 else ("1f1b" if vpp == 1 else "interleaved")


GRID = [(pp, vpp, m) for pp, vpp, m in itertools.product(range(1, 5), (1, 2, 3), range(1, 13))
        if pp > 1 or vpp == 1]


@pytest.mark.parametrize("p2p", ["paired", "eager"])
@pytest.mark.parametrize("pp,vpp,m", GRID)
def test_grid_runs_without_deadlock(pp, vpp, m, p2p):
    try:
        sched = build(_name(pp, vpp), pp=pp, vpp=vpp, m=m)
    except ScheduleError as err:  # interleaved refuses some m, with the numbers
        assert vpp > 1 and (m < pp or m % pp) and f"got m={m}" in str(err)
        return
    sim = simulate(lower(sched, num_chunks=pp * vpp, p2p=p2p), pp=pp)
    for rank in range(pp):
        acts = compute_actions(sched, rank)
        chunks = range(rank, pp * vpp, pp)
        # every (chunk, micro-batch) of this rank: one forward, then one backward
        assert sorted((a.chunk, a.mb, a.kind.value) for a in acts) == sorted(
            (c, i, k) for c in chunks for i in range(m) for k in ("F", "B")
        )
        assert sim.peak_in_flight[rank] <= m * vpp
    if vpp == 1 and pp > 1:  # 1F1B: the first stage holds at most pp micro-batches
        assert sim.peak_in_flight[0] == min(pp, m)


@pytest.mark.parametrize("p2p", ["paired", "eager"])
@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 12])
def test_1f1b_bubble_is_the_textbook_value(pp, m, p2p):
    sim = simulate(lower(build("1f1b", pp=pp, vpp=1, m=m), num_chunks=pp, p2p=p2p), pp=pp)
    for rank in range(pp):
        assert abs(sim.bubble(rank) - (pp - 1) / (m + pp - 1)) < 1e-12


@pytest.mark.parametrize(
    "pp,vpp,m", [(pp, vpp, m) for pp, vpp, m in GRID if vpp > 1 and m >= pp and m % pp == 0]
)
def test_interleaved_bubble_is_smaller(pp, vpp, m):
    one = simulate(lower(build("1f1b", pp=pp, vpp=1, m=m), num_chunks=pp), pp=pp)
    # the same model cut into vpp times more chunks: each costs 1 / vpp
    inter = simulate(lower(build("interleaved", pp=pp, vpp=vpp, m=m), num_chunks=pp * vpp),
                     pp=pp, f_cost=1 / vpp, b_cost=1 / vpp)
    assert inter.makespan < one.makespan
    assert all(inter.bubble(r) < one.bubble(r) for r in range(pp))


@pytest.mark.parametrize("p2p", ["paired", "eager"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_latency_delays_each_message_on_the_critical_path(pp, p2p):
    """One micro-batch is a chain: pp forwards and pp backwards (cost 1 each), with
    pp - 1 messages each way between them, and nothing to hide their latency behind."""
    lowered = lower(build("1f1b", pp=pp, vpp=1, m=1), num_chunks=pp, p2p=p2p)
    for latency in (0.0, 0.25, 3.0):
        sim = simulate(lowered, pp=pp, latency=latency)
        assert sim.makespan == pytest.approx(2 * pp + 2 * (pp - 1) * latency)


@pytest.mark.parametrize("pp", [2, 3])
def test_eager_posts_hide_latency_that_paired_posts_expose(pp):
    """A message moves once both ends posted it. Paired posts a receive right before the
    compute that reads it, so in the steady state each one waits the whole latency;
    eager posts it units ahead, and the latency overlaps their compute."""
    paired, eager = (
        lower(build("1f1b", pp=pp, vpp=1, m=8), num_chunks=pp, p2p=p2p)
        for p2p in ("paired", "eager")
    )
    assert simulate(paired, pp=pp).makespan == simulate(eager, pp=pp).makespan
    assert (
        simulate(paired, pp=pp, latency=0.5).makespan > simulate(eager, pp=pp, latency=0.5).makespan
    )


def test_gpipe_and_forward_only():
    sim = simulate(lower(build("gpipe", pp=2, vpp=1, m=3), num_chunks=2), pp=2)
    assert sim.peak_in_flight == {0: 3, 1: 3} and abs(sim.bubble(0) - 1 / 4) < 1e-12
    fwd = forward_only(build("interleaved", pp=2, vpp=2, m=4))
    assert all(a.kind is Kind.F for r in fwd for a in compute_actions(fwd, r))
    simulate(lower(fwd, num_chunks=4), pp=2)


def test_actions_print_and_parse():
    for text in ("2F0", "0B13", "1SF3", "3RB0", "0D2", "1GS3"):
        assert str(Action.parse(text)) == text
    assert Action.parse("1SF3") == Action(1, Kind.SEND_F, 3)
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("F2")


def test_simulator_finds_a_deadlock():
    # rank 0 sends its activation only after its backward, which needs rank 1's
    # gradient; rank 1 needs that activation first: neither can move.
    bad = {0: [(Action(0, Kind.RECV_B, 0),), (Action(0, Kind.F, 0),), (Action(0, Kind.B, 0),),
               (Action(0, Kind.SEND_F, 0),)],
           1: [(Action(1, Kind.RECV_F, 0),), (Action(1, Kind.F, 0),), (Action(1, Kind.B, 0),),
               (Action(1, Kind.SEND_B, 0),)]}
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0B0, rank 1 at 1F0"):
        simulate(bad, pp=2)
    # a send nobody receives: freeing the activation waits forever
    lost = {
        0: [(Action(0, Kind.F, 0),), (Action(0, Kind.SEND_F, 0),), (Action(0, Kind.DEALLOC, 0),)],
        1: [],
    }
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0D0"):
        simulate(lost, pp=2)
    unread = {0: [(Action(0, Kind.F, 0),), (Action(0, Kind.SEND_F, 0),)], 1: []}
    with pytest.raises(ScheduleError, match="rank 0 sends 1 messages to rank 1, which receives 0"):
        simulate(unread, pp=2)


def test_simulator_finds_out_of_order_messages():
    bad = {
        0: [
            (Action(0, Kind.F, 0),),
            (Action(0, Kind.F, 1),),
            (Action(0, Kind.SEND_F, 1), Action(0, Kind.SEND_F, 0)),
        ],
        1: [(Action(1, Kind.RECV_F, 0), Action(1, Kind.RECV_F, 1))],
    }
    with pytest.raises(ScheduleError, match="order mismatch: 0SF1 on rank 0 meets 1RF0 on rank 1"):
        simulate(bad, pp=2)


class Tables(TestCase):
    def test_1f1b_pp2_m4(self):
        self.assertExpectedInline(
            table(lower(build("1f1b", pp=2, vpp=1, m=4), num_chunks=2)),
            """\
rank 0: 0F0       0SF0      0D0       0F1       0SF1+0RB0 0D1       0B0       0F2       0SF2+0RB1 0D2       0B1       0F3       0SF3+0RB2 0D3       0B2       0RB3      0GS3      0B3
rank 1: 1RF0      1F0       1B0       1SB0+1RF1 1F1       1B1       1SB1+1RF2 1F2       1B2       1SB2+1RF3 1F3       1GS3      1B3       1SB3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_1f1b_pp4_m4(self):
        self.assertExpectedInline(
            table(lower(build("1f1b", pp=4, vpp=1, m=4), num_chunks=4)),
            """\
rank 0: 0F0       0SF0      0D0       0F1       0SF1      0D1       0F2       0SF2      0D2       0F3       0SF3+0RB0 0D3       0B0       0RB1      0B1       0RB2      0B2       0RB3      0GS3      0B3
rank 1: 1RF0      1F0       1SF0+1RF1 1D0       1F1       1SF1+1RF2 1D1       1F2       1SF2+1RB0 1D2       1B0       1SB0+1RF3 1F3       1SF3+1RB1 1D3       1B1       1SB1+1RB2 1B2       1SB2+1RB3 1GS3      1B3       1SB3
rank 2: 2RF0      2F0       2SF0+2RF1 2D0       2F1       2SF1+2RB0 2D1       2B0       2SB0+2RF2 2F2       2SF2+2RB1 2D2       2B1       2SB1+2RF3 2F3       2SF3+2RB2 2D3       2B2       2SB2+2RB3 2GS3      2B3       2SB3
rank 3: 3RF0      3F0       3B0       3SB0+3RF1 3F1       3B1       3SB1+3RF2 3F2       3B2       3SB2+3RF3 3F3       3GS3      3B3       3SB3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_interleaved_pp2_vpp2_m4(self):
        self.assertExpectedInline(
            table(lower(build("interleaved", pp=2, vpp=2, m=4), num_chunks=4)),
            """\
rank 0: 0F0                 0SF0                0D0                 0F1                 0SF1+2RF0           0D1                 2F0                 2SF0+2RF1           2D0                 2F1                 2SF1+2RB0           2D1                 0F2                 2B0                 0SF2+2SB0+2RB1      0D2                 0F3                 2B1                 0SF3+2SB1+2RF2+0RB0 0D3                 2F2                 0B0                 2SF2+2RF3+0RB1      2D2                 2F3                 0B1                 2SF3+2RB2           2D3                 2B2                 2SB2+2RB3           2GS3                2B3                 2SB3+0RB2           0B2                 0RB3                0GS3                0B3
rank 1: 1RF0                1F0                 1SF0+1RF1           1D0                 1F1                 1SF1+3RF0           1D1                 3F0                 3B0                 3SB0+3RF1           3F1                 3B1                 3SB1+1RF2+1RB0      1F2                 1B0                 1SF2+1SB0+1RF3+1RB1 1D2                 1F3                 1B1                 1SF3+1SB1+3RF2      1D3                 3F2                 3B2                 3SB2+3RF3           3F3                 3GS3                3B3                 3SB3+1RB2           1B2                 1SB2+1RB3           1GS3                1B3                 1SB3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_eager_1f1b_pp2_m4(self):
        # each send right after its compute; each receive EAGER_AHEAD (4) units before the unit that
        # reads it
        self.assertExpectedInline(
            table(lower(build("1f1b", pp=2, vpp=1, m=4), num_chunks=2, p2p="eager")),
            """\
rank 0: 0RB0+0RB1      0F0            0SF0           0D0            0F1            0SF1           0RB2           0D1            0B0            0RB3           0F2            0SF2           0D2            0B1            0F3            0SF3           0D3            0B2            0GS3           0B3
rank 1: 1RF0+1RF1+1RF2 1F0            1B0            1SB0           1RF3           1F1            1B1            1SB1           1F2            1B2            1SB2           1F3            1GS3           1B3            1SB3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_eager_interleaved_pp2_vpp2_m4(self):
        self.assertExpectedInline(
            table(lower(build("interleaved", pp=2, vpp=2, m=4), num_chunks=4, p2p="eager")),
            """\
rank 0: 2RF0+2RF1+2RB0                0F0                           0SF0                          2RB1                          0D0                           0F1                           0SF1                          2RF2+0RB0                     0D1                           2F0                           2SF0                          2RF3+0RB1                     2D0                           2F1                           2SF1                          2RB2                          2D1                           0F2                           0SF2                          2B0                           2SB0                          2RB3                          0D2                           0F3                           0SF3                          2B1                           2SB1                          0RB2                          0D3                           2F2                           2SF2                          0B0                           0RB3                          2D2                           2F3                           2SF3                          0B1                           2D3                           2B2                           2SB2                          2GS3                          2B3                           2SB3                          0B2                           0GS3                          0B3
rank 1: 1RF0+1RF1+3RF0+3RF1+1RF2+1RB0 1F0                           1SF0                          1RF3+1RB1                     1D0                           1F1                           1SF1                          3RF2                          1D1                           3F0                           3B0                           3SB0                          3RF3                          3F1                           3B1                           3SB1                          1RB2                          1F2                           1SF2                          1B0                           1SB0                          1RB3                          1D2                           1F3                           1SF3                          1B1                           1SB1                          1D3                           3F2                           3B2                           3SB2                          3F3                           3GS3                          3B3                           3SB3                          1B2                           1SB2                          1GS3                          1B3                           1SB3""",  # noqa: E501 (expected text, compared whole)
        )


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (2, 1, 4), (2, 2, 4), (4, 2, 8)])
def test_grad_sync_precedes_each_chunks_last_backward(pp, vpp, m):
    lowered = lower(build(_name(pp, vpp), pp=pp, vpp=vpp, m=m), num_chunks=pp * vpp)
    for rank, steps in lowered.items():
        syncs = [i for i, s in enumerate(steps) if s[0].kind is Kind.GRAD_SYNC]
        assert len(syncs) == vpp  # one per chunk of this rank
        for i in syncs:
            gs, nxt = steps[i][0], steps[i + 1][0]
            assert nxt == Action(gs.chunk, Kind.B, m - 1)
            assert not any(
                a.kind is Kind.B and a.chunk == gs.chunk for s in steps[i + 1 + 1 :] for a in s
            )
    fwd = lower(forward_only(build(_name(pp, vpp), pp=pp, vpp=vpp, m=m)), num_chunks=pp * vpp)
    assert not any(s[0].kind is Kind.GRAD_SYNC for steps in fwd.values() for s in steps)


def test_held_bytes_weigh_each_micro_batch_by_its_chunk():
    """Interleaved pp=2 x vpp=2 with m = pp = 2: Megatron runs every forward before the first
    backward then, so rank 0 holds at once both micro-batches of chunk 0 and of chunk 2:
    2 x 1 + 2 x 10 when chunk 2 keeps ten times chunk 0; the largest chunk times the most
    held would say 40. Rank 1 (chunks 1 and 3, the head's) likewise 2 x 1 + 2 x 100. Under
    1F1B every chunk of a rank is one chunk: weights of 5 give 5 x the most held."""
    sched = build("interleaved", pp=2, vpp=2, m=2)
    sim = simulate(lower(sched, num_chunks=4), pp=2)
    assert sim.peak_held == {0: 4, 1: 4}
    place = (0, 1, 0, 1)
    assert sim.peak_held_by(place, {0: 1.0, 2: 10.0}) == {0: 22.0}
    assert sim.peak_held_by(place, {1: 1.0, 3: 100.0}) == {1: 202.0}
    one = simulate(lower(build("1f1b", pp=2, vpp=1, m=4), num_chunks=2), pp=2)
    assert one.peak_held_by((0, 1), {0: 5.0, 1: 5.0}) == {r: 5.0 * one.peak_held[r] for r in (0, 1)}
