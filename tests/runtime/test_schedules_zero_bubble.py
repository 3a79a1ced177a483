"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) as data: split backwards (I, W), the V
placement, lowering and the unit-cost simulator (F = I = W = 1, B = 2), without processes."""

import gc
import itertools
import weakref

import pytest
import torch
from expecttest import TestCase
from torch import fx

from fxmeg.config import placement
from fxmeg.errors import ConfigError, ScheduleError
from fxmeg.runtime.pipeline.executor import _pairs, _streamed
from fxmeg.runtime.pipeline.lowering import EAGER_AHEAD, p2p_mode
from fxmeg.runtime.pipeline.schedules import (
    COMPUTE,
    Action,
    Kind,
    build,
    compute_actions,
    forward_only,
    input_of,
    lower,
    table,
)
from fxmeg.runtime.pipeline.simulator import simulate

ZERO_BUBBLE = {"zbh1": 1, "zbv": 2, "dualpipev": 2}  # name -> vpp
UNIT = {"f_cost": 1, "b_cost": 2, "i_cost": 1, "w_cost": 1}


def _run(name: str, pp: int, m: int, p2p: str = "paired", pending: int | None = None):
    """(compute schedule, lowered, unit-cost simulation) of ``name`` at pp, m (at most
    ``pending`` Ws deferred)."""
    vpp = ZERO_BUBBLE.get(name, 2 if name == "interleaved" else 1)
    where = placement(name, pp=pp, vpp=vpp)
    sched = build(name, pp=pp, vpp=vpp, m=m, max_pending_w=pending)
    lowered = lower(sched, num_chunks=pp * vpp, p2p=p2p, placement=where)
    return sched, lowered, simulate(lowered, pp=pp, placement=where, **UNIT)


def _bubble(sim, pp: int) -> float:
    return max(sim.bubble(r) for r in range(pp))


GRID = list(itertools.product(ZERO_BUBBLE, range(2, 5), range(1, 17)))


@pytest.mark.parametrize("p2p", ["paired", "eager"])
@pytest.mark.parametrize("name,pp,m", GRID)
def test_grid_runs_every_pass_once_in_order(name, pp, m, p2p):
    try:
        sched, _, sim = _run(name, pp, m, p2p)
    except ScheduleError as err:  # DualPipeV needs a micro-batch per chunk
        assert name == "dualpipev" and m < 2 * pp and f"got m={m}" in str(err)
        return
    vpp = ZERO_BUBBLE[name]
    where = placement(name, pp=pp, vpp=vpp)
    for rank in range(pp):
        mine = {c for c in range(pp * vpp) if where[c] == rank}
        # every (chunk, micro-batch) of this rank: F, I and W once each (B is I + W at once)
        passes = sorted((a.chunk, a.mb, k) for a in compute_actions(sched, rank)
                        for k in ({"B": "IW"}.get(a.kind.value, a.kind.value)))
        assert passes == sorted((c, i, k) for c in mine for i in range(m) for k in "FIW")
        assert sim.peak_held[rank] <= m * vpp
    if name != "dualpipev":  # ZB-H1 and ZB-V split every backward
        assert not any(a.kind is Kind.B for r in sched for a in compute_actions(sched, r))
    start = {a: s for a, (s, _) in sim.spans.items()}
    end = {a: e for a, (_, e) in sim.spans.items()}
    for c, i in itertools.product(range(pp * vpp), range(m)):
        f, grad = Action(c, Kind.F, i), _input_grad(end, c, i)
        w = Action(c, Kind.W, i) if Action(c, Kind.W, i) in end else grad
        assert end[f] <= start[grad] and end[grad] <= end[w]  # F, then I, then W
        if c + 1 < pp * vpp:  # forwards down the chunks, input gradients back up
            assert start[Action(c + 1, Kind.F, i)] >= end[f]
            assert start[grad] >= end[_input_grad(end, c + 1, i)]


def _most_pending(actions) -> int:
    """The most micro-batches between their I and their W in one rank's ``actions``."""
    pending, most = set(), 0
    for a in actions:
        if a.kind is Kind.I:
            pending.add((a.chunk, a.mb))
        elif a.kind is Kind.W:
            pending.remove((a.chunk, a.mb))
        most = max(most, len(pending))
    return most


@pytest.mark.parametrize("name,pp,m", [(n, pp, m) for n in ZERO_BUBBLE for pp in (2, 3, 4)
                                       for m in (2 * pp, 2 * pp + 3)])
def test_max_pending_w_runs_the_backwards_past_it_whole(name, pp, m):
    """At most ``max_pending_w`` micro-batches wait for their W on a rank; past it an I
    runs as its whole B (``cap_pending``): every pass still runs once and in order, peak
    memory does not grow, the bubble does not shrink, and a cap the schedule never reaches
    changes nothing."""
    free, _, open_sim = _run(name, pp, m)
    most = max(_most_pending(compute_actions(free, r)) for r in range(pp))
    assert most >= 1
    assert _run(name, pp, m, pending=most)[0] == free
    vpp = ZERO_BUBBLE[name]
    where = placement(name, pp=pp, vpp=vpp)
    for cap in range(most):
        sched, _, sim = _run(name, pp, m, pending=cap)  # the simulator checks the order
        for rank in range(pp):
            actions = compute_actions(sched, rank)
            assert _most_pending(actions) <= cap
            mine = {c for c in range(pp * vpp) if where[c] == rank}
            passes = sorted((a.chunk, a.mb, k) for a in actions
                            for k in ({"B": "IW"}.get(a.kind.value, a.kind.value)))
            assert passes == sorted((c, i, k) for c in mine for i in range(m) for k in "FIW")
            assert sim.peak_held[rank] <= open_sim.peak_held[rank]
        assert _bubble(sim, pp) >= _bubble(open_sim, pp)
    no_w, _, sim = _run(name, pp, m, pending=0)
    assert not any(a.kind in (Kind.I, Kind.W) for r in no_w for a in compute_actions(no_w, r))
    assert sim.peak_held == sim.peak_in_flight  # no micro-batch held from an I to a W


@pytest.mark.parametrize("name", ["1f1b", "interleaved", *ZERO_BUBBLE])
@pytest.mark.parametrize("pp", [2, 4])
def test_eager_posts_each_receive_units_before_it_is_read(name, pp):
    """Eager posts a receive EAGER_AHEAD units before the unit that reads it (all of the
    first ones before the first unit), round robin or V; paired at the latest right
    before it. Counted in units: the schedule's units a rank had begun when it posted."""
    for p2p, ahead in (("eager", EAGER_AHEAD), ("paired", 0)):
        sched, lowered, _ = _run(name, pp, 8, p2p)
        for rank, steps in lowered.items():
            unit_of = {a: u for u, unit in enumerate(sched[rank]) for a in unit}
            begun, posted_at, reads = 0, {}, 0
            for step in steps:
                a = step[0]
                if a.kind in COMPUTE:
                    begun = max(begun, unit_of[a] + 1)
                    r = input_of(a)
                    if r in posted_at:
                        reads += 1
                        assert unit_of[a] - posted_at[r] >= min(ahead, unit_of[a]), (p2p, rank, a)
                else:
                    posted_at.update(
                        (r, begun) for r in step if r.kind in (Kind.RECV_F, Kind.RECV_B)
                    )
            assert reads == sum(
                r.kind in (Kind.RECV_F, Kind.RECV_B) for step in steps for r in step
            )


def test_p2p_mode_by_backend():
    """auto: paired under NCCL (one stream per rank pair, in order), eager elsewhere;
    eager under NCCL would post receives before the sends the peer waits for: refused."""
    assert [p2p_mode("auto", b) for b in ("nccl", "gloo", None)] == ["paired", "eager", "eager"]
    assert p2p_mode("paired", "nccl") == "paired" and p2p_mode("eager", "gloo") == "eager"
    with pytest.raises(ConfigError, match=r"p2p='eager' .* NCCL .* Use p2p='paired' or 'auto'"):
        p2p_mode("eager", "nccl")


def _input_grad(end: dict, c: int, i: int) -> Action:
    """The action computing chunk c's input gradient of micro-batch i: its I or its B."""
    return Action(c, Kind.I, i) if Action(c, Kind.I, i) in end else Action(c, Kind.B, i)


@pytest.mark.parametrize("pp,m", itertools.product(range(2, 5), range(1, 17)))
def test_zbh1_holds_1f1b_memory_at_a_third_of_its_bubble(pp, m):
    *_, one = _run("1f1b", pp, m)
    *_, zb = _run("zbh1", pp, m)
    assert zb.peak_in_flight == one.peak_in_flight  # micro-batches before their I: 1F1B's
    assert max(zb.peak_held.values()) == max(one.peak_held.values())  # before W: 1F1B's peak
    assert _bubble(zb, pp) <= _bubble(one, pp) / 3 + 1 / m
    if m >= pp:  # enough Ws to fill it: idle (pp-1)(F + I - W) instead of (pp-1)(F + B)
        assert zb.makespan - 3 * m == pytest.approx((one.makespan - 3 * m) / 3)


@pytest.mark.parametrize(
    "pp,m", [(pp, m) for pp, m in itertools.product(range(2, 5), range(1, 17)) if m % pp == 0]
)
def test_zbv_bubble_is_below_interleaved(pp, m):
    *_, inter = _run("interleaved", pp, m)
    *_, zbv = _run("zbv", pp, m)
    assert all(zbv.bubble(r) < inter.bubble(r) for r in range(pp))
    # two chunks of half the size, so twice 1F1B's count: the same activation memory
    assert max(zbv.peak_in_flight.values()) <= 2 * pp


@pytest.mark.parametrize("p2p", ["paired", "eager"])
def test_the_second_lane_pairs_dualpipevs_units_of_one_forward_and_another_backward(p2p):
    """overlap_moe_expert_parallel_comm: the executor pairs exactly the units of one chunk's
    F and another chunk's B (not two single units that happen to be neighbours, such as the
    V's tip), and no compute runs between the two in the lowered steps."""
    for pp, m in ((2, 4), (2, 9), (4, 8), (4, 13)):
        sched, lowered, _ = _run("dualpipev", pp, m, p2p)
        for rank, steps in lowered.items():
            pairs = _pairs(steps, sched[rank], set(range(2 * pp)))
            got = {(steps[i][0], steps[j][0]) for i, j in pairs.items()}
            want = {u for u in sched[rank] if [a.kind for a in u] == [Kind.F, Kind.B]}
            assert got == want and want
            assert all(steps[k][0].kind not in COMPUTE
                       for i, j in pairs.items() for k in range(i + 1, j))
            assert not _pairs(steps, sched[rank], set())  # unsplit backwards are never paired
    # the V's tip: rank pp-1 runs its first steady F and B as two units, left unpaired
    sched, lowered, _ = _run("dualpipev", 2, 4, p2p)
    units, steps = sched[1], lowered[1]
    singles = {(u[0], v[0]) for u, v in zip(units, units[1:]) if len(u) == len(v) == 1
               and (u[0].kind, v[0].kind) == (Kind.F, Kind.B) and u[0].chunk != v[0].chunk}
    got = {(steps[i][0], steps[j][0]) for i, j in _pairs(steps, units, {0, 1, 2, 3}).items()}
    assert singles and not singles & got


def test_v_placement_hands_off_inside_a_rank():
    assert placement("zbv", pp=4, vpp=2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement("dualpipev", pp=2, vpp=2) == (0, 1, 1, 0)
    assert placement("interleaved", pp=2, vpp=2) == (0, 1, 0, 1) and placement(
        "zbh1", pp=3, vpp=1
    ) == (0, 1, 2)
    for name in ("zbv", "dualpipev"):
        _, lowered, _ = _run(name, 4, 8)
        p2p = {
            a
            for steps in lowered.values()
            for s in steps
            for a in s
            if a.kind.value in ("SF", "RF", "SB", "RB")
        }
        # chunks 3 and 4 share rank 3: no message crosses between them
        assert not {
            a
            for a in p2p
            if (a.chunk, a.kind.value) in {(3, "SF"), (4, "RF"), (4, "SB"), (3, "RB")}
        }
        assert {a.chunk for a in p2p if a.kind is Kind.SEND_F} == {0, 1, 2, 4, 5, 6}
    # evaluation runs the same placement forward only
    where = placement("zbv", pp=2, vpp=2)
    simulate(lower(forward_only(build("zbv", pp=2, vpp=2, m=4)), num_chunks=4, placement=where),
             pp=2, placement=where)


@pytest.mark.parametrize("name", ZERO_BUBBLE)
def test_grad_sync_precedes_each_chunks_last_weight_gradient(name):
    m = 8
    _, lowered, _ = _run(name, 4, m)
    for steps in lowered.values():
        syncs = [i for i, s in enumerate(steps) if s[0].kind is Kind.GRAD_SYNC]
        assert len(syncs) == ZERO_BUBBLE[name]
        for i in syncs:
            c, nxt = steps[i][0].chunk, steps[i + 1][0]
            assert nxt.chunk == c and nxt.kind in (Kind.W, Kind.B)
            later = [
                a for s in steps[i + 2 :] for a in s if a.chunk == c and a.kind in (Kind.W, Kind.B)
            ]
            assert not later
            # every input gradient of the chunk has run by then: only weights are left
            assert not [a for s in steps[i + 1:] for a in s if a.chunk == c and a.kind is Kind.I]


def test_split_actions_print_and_parse():
    for text in ("2I0", "0W13"):
        assert str(Action.parse(text)) == text
    assert Action.parse("1I3") == Action(1, Kind.I, 3) and Action.parse("1W3").kind is Kind.W


def test_simulator_refuses_a_weight_gradient_before_its_input_gradient():
    bad = {0: [(Action(0, Kind.F, 0),), (Action(0, Kind.W, 0),), (Action(0, Kind.I, 0),)]}
    with pytest.raises(ScheduleError, match="rank 0 runs 0W0 before its input gradient 0I0"):
        simulate(bad, pp=1)


def test_simulator_refuses_a_wrong_order_inside_a_rank():
    # chunks 0 and 1 on one rank: 1F0 reads 0F0's output, 0I0 reads 1I0's gradient
    where = (0, 0)
    ahead = {0: [(Action(1, Kind.F, 0),), (Action(0, Kind.F, 0),)]}
    with pytest.raises(ScheduleError, match="runs 1F0 before 0F0, which feeds it on this rank"):
        simulate(ahead, pp=1, placement=where)
    early = {
        0: [
            (Action(0, Kind.F, 0),),
            (Action(1, Kind.F, 0),),
            (Action(0, Kind.I, 0),),
            (Action(1, Kind.I, 0),),
        ]
    }
    with pytest.raises(ScheduleError, match="runs 0I0 before 1I0 / 1B0"):
        simulate(early, pp=1, placement=where)


def test_simulator_refuses_freeing_an_activation_after_its_backward():
    late = {0: [(Action(0, Kind.F, 0),), (Action(0, Kind.SEND_F, 0),), (Action(0, Kind.RECV_B, 0),),
                (Action(0, Kind.I, 0),), (Action(0, Kind.DEALLOC, 0),), (Action(0, Kind.W, 0),)],
            1: [(Action(1, Kind.RECV_F, 0),), (Action(1, Kind.F, 0),), (Action(1, Kind.B, 0),),
                (Action(1, Kind.SEND_B, 0),)]}
    with pytest.raises(
        ScheduleError, match="rank 0 frees 0D0 after the backward of its micro-batch"
    ):
        simulate(late, pp=2)


def test_dualpipev_needs_a_micro_batch_per_chunk():
    """The builder refuses with the configuration's words (fxmeg/schedule_registry.py)."""
    with pytest.raises(
        ScheduleError,
        match=r"^the dualpipev schedule needs at least 2 \* pp = 8 micro-batches; got m=7\. ",
    ):
        build("dualpipev", pp=4, vpp=2, m=7)
    with pytest.raises(
        ScheduleError,
        match=r"^schedule='zbv' runs two chunks per pipeline rank in a V: it needs vpp=2 "
        r"and pp > 1; got vpp=3, pp=2",
    ):
        build("zbv", pp=2, vpp=3, m=4)


class Tables(TestCase):
    def test_zbh1_pp2_m4(self):
        self.assertExpectedInline(
            table(_run("zbh1", 2, 4)[1]),
            """\
rank 0: 0F0       0SF0      0D0       0F1       0SF1+0RB0 0D1       0I0       0W0       0F2       0SF2+0RB1 0D2       0I1       0W1       0F3       0SF3+0RB2 0D3       0I2       0W2       0RB3      0I3       0GS3      0W3
rank 1: 1RF0      1F0       1I0       1SB0+1RF1 1F1       1I1       1SB1      1W0       1RF2      1F2       1I2       1SB2      1W1       1RF3      1F3       1I3       1SB3      1W2       1GS3      1W3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_zbv_pp2_m4(self):
        self.assertExpectedInline(
            table(_run("zbv", 2, 4)[1]),
            """\
rank 0: 3RF0      0F0       0SF0      0F1       0SF1      0F2       0SF2      3F0       3RF1      0D0       0D1       3I0       3SB0      3W0       3F1       0RB0      0D2       3I1       3SB1      3W1       0F3       0SF3      0I0       3RF2      0W0       3F2       0RB1      3I2       3SB2      3W2       0I1       3RF3      0D3       0W1       3F3       0RB2      3I3       3SB3      3GS3      3W3       0I2       0RB3      0W2       0I3       0GS3      0W3
rank 1: 1RF0      1F0       1RF1      2F0       2SF0      2D0       1F1       1RF2      2F1       2SF1+2RB0 2I0       2RB1      2D1       2W0       1F2       1I0       1SB0      1W0       2F2       2SF2      2I1       1RF3      2W1       1F3       2RB2      1I1       1SB1      1W1       2F3       2SF3      2I2       2RB3      2W2       1I2       1SB2      2I3       1I3       1SB3      1W2       2GS3      2W3       1GS3      1W3""",  # noqa: E501 (expected text, compared whole)
        )

    def test_dualpipev_pp2_m4(self):
        self.assertExpectedInline(
            table(_run("dualpipev", 2, 4)[1]),
            """\
rank 0: 3RF0           0F0            0SF0           0F1            0SF1           0F2            0SF2           3F0            3RF1           0D0            0D1            3I0            3SB0           3W0            3F1            3RF2           0D2            0F3            3B1            0SF3+3SB1+0RB0 3F2            0D3            0B0            3RF3           3B2            3SB2+0RB1      3F3            0B1            0RB2           3GS3           3B3            3SB3           0I2            0RB3           0W2            0I3            0GS3           0W3
rank 1: 1RF0           1F0            1RF1           2F0            2SF0           2D0            1F1            1RF2           2F1            2SF1           1F2            2RB0           2B0            1RF3           2D1            2F2            1B0            2SF2+1SB0+2RB1 1F3            2D2            2B1            2RB2           2F3            1B1            2SF3+1SB1      2B2            2RB3           2D3            1B2            1SB2           2I3            1I3            1SB3           2GS3           2W3            1GS3           1W3""",  # noqa: E501 (expected text, compared whole)
        )


def test_measured_costs_per_chunk_set_the_makespan():
    """``costs`` prices a (chunk, kind) of its own (bench/overhead.py passes measured
    times): each rank is busy for exactly the sum of its actions' costs, and a ZB-V whose
    rank 0 holds the dearer chunks runs longer than one with unit costs."""
    _, lowered, unit = _run("zbv", 2, 8)
    where = placement("zbv", pp=2, vpp=2)
    dear = {(3, kind): 2.0 * cost for kind, cost in ((Kind.F, 1), (Kind.I, 1), (Kind.W, 1))}
    sim = simulate(lowered, pp=2, placement=where, **UNIT, costs=dear)
    assert sim.busy == {0: unit.busy[0] + 8 * 3, 1: unit.busy[1]}
    assert sim.makespan >= sim.busy[0] > unit.makespan
    for a, (start, end) in sim.spans.items():
        assert end - start == dear.get((a.chunk, a.kind), UNIT[f"{a.kind.value.lower()}_cost"])


def test_a_held_micro_batch_weighs_its_carry_from_its_i_to_its_w():
    """``peak_held_by``'s carry: a micro-batch weighs its chunk's ``weights`` from F until
    I and its ``carry`` from I until W. A carry equal to the weights is the old count (every
    micro-batch whose W has not run, ``peak_held``); a carry of nothing counts only those
    whose I has not run (``peak_in_flight``, the simulator's own counter)."""
    *_, sim = _run("zbh1", 4, 8)
    where = placement("zbh1", pp=4, vpp=1)
    one = {c: 1.0 for c in range(4)}
    held = {r: float(sim.peak_held[r]) for r in range(4)}
    assert sim.peak_held_by(where, one, one) == sim.peak_held_by(where, one) == held
    assert sim.peak_held_by(where, one, dict.fromkeys(one, 0.0)) == {
        r: float(sim.peak_in_flight[r]) for r in range(4)}
    assert sim.peak_in_flight != sim.peak_held  # W deferred: the two counts differ


def test_the_weight_graph_hands_each_gradient_on_before_making_the_next():
    """The eager W step calls back with each gradient as soon as it is made, and the
    generated code drops it then: when the second gradient arrives, the first is freed
    (before, W returned all of a chunk's gradients together, a transient as large as the
    chunk's weights: 17 MiB of 246 on the bench GPT's first stage)."""
    def weights(x, g):  # W-like: each gradient from the carry
        return (x.t() @ g, (x * 2).t() @ g, g.sum(0))

    gm = fx.symbolic_trace(weights)
    streamed = _streamed(gm)
    x, g = torch.randn(8, 4), torch.randn(8, 3)
    seen, alive = [], []

    def sink(i, grad):
        gc.collect()
        alive.append([r() is not None for _, r in seen])
        seen.append((i, weakref.ref(grad)))
        assert torch.equal(grad, gm(x, g)[i])

    assert streamed(sink, x, g) == ()
    assert [i for i, _ in seen] == [0, 1, 2]
    assert alive == [[], [False], [False, False]]
