"""The time model of DualPipe's second lane (fxmeg/planner/lanes.py): which units pair, what
the overlap hides, and a layout's prediction with it on a GPU cluster and on one that does
not overlap communication (a CPU's)."""

import dataclasses

import pytest
import torch

from fxmeg.planner import lanes
from fxmeg.planner.cluster import cluster
from fxmeg.planner.search import Layout, Searcher, candidates
from fxmeg.schedule_registry import placement
from tests.planner.test_search import _deepseek


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipev_pairs_the_two_chunks_of_each_rank(pp):
    """Each rank pairs its two chunks both ways (x's forward with y's backward and y's with
    x's), and all but the warmup's and the drain's micro-batches run paired."""
    where = placement("dualpipev", pp=pp, vpp=2)
    shares = {}
    for m in (2 * pp, 2 * pp + 5, 64):
        pairs = dict(lanes.paired(pp, m))
        assert sorted(pairs) == sorted((x, y) for x in range(2 * pp) for y in range(2 * pp)
                                       if x != y and where[x] == where[y])
        assert all(1 - 2 * pp / m <= share <= 1 for share in pairs.values())  # pp a side
        shares[m] = min(pairs.values())
    assert 0 < shares[2 * pp] < shares[2 * pp + 5] < shares[64]


def test_a_pair_takes_the_longest_of_its_lanes_and_engines(monkeypatch):
    """Per pair, what is hidden is the two actions' sum less the longest of: both lanes'
    compute, both all-to-alls, either lane alone; charged to the all-to-alls by their size
    and scaled by the share of micro-batches that run paired."""
    (pair, share), *_ = lanes.paired(2, 64)
    monkeypatch.setattr(lanes, "paired", lambda pp, m: ((pair, share),))  # this pair only
    x, y = pair
    for (c, e_f, e_b), took in (((10.0, 4.0, 4.0), 20.0),  # compute-bound: all hidden
                                ((1.0, 12.0, 4.0), 16.0),  # both all-to-alls on the network
                                ((1.0, 12.0, 1.0), 13.0)):  # the forward lane alone
        f_cost, b_cost = {x: c + e_f}, {y: c + e_b}
        comm_f, comm_b = {x: {"ep": e_f, "tp": 1.0}}, {y: {"ep": e_b, "tp": 1.0}}
        lanes.hide(f_cost, b_cost, comm_f, comm_b, 2, 64)
        hidden = (2 * c + e_f + e_b - took) * share
        assert f_cost[x] == pytest.approx(c + e_f - hidden * e_f / (e_f + e_b))
        assert b_cost[y] == pytest.approx(c + e_b - hidden * e_b / (e_f + e_b))
        assert comm_f[x]["ep"] == pytest.approx(e_f - hidden * e_f / (e_f + e_b))
        assert comm_b[y]["ep"] == pytest.approx(e_b - hidden * e_b / (e_f + e_b))
        assert comm_f[x]["tp"] == comm_b[y]["tp"] == 1.0  # tp's stays exposed


def test_the_overlap_is_searched_and_predicted_where_the_cluster_overlaps():
    """Under dualpipev at ep > 1 the search tries the overlap both ways. On H100s it hides
    ep all-to-all time (a shorter step, less exposed ep); the second lane's pool holds a
    backward's carry more (on both); on a cluster that does not overlap communication with
    compute (a CPU's) the step is the same."""
    from fxmeg.interop.hugging_face import keyword_batch

    pool = list(candidates(4, 4, 8, experts=True, ranks_per_node=8))
    overlapped = [c for c in pool if c.overlap_ep]
    assert overlapped and all(c.schedule == "dualpipev" and c.ep > 1 for c in overlapped)
    assert {dataclasses.replace(c, overlap_ep=False) for c in overlapped} <= set(pool)
    ids = torch.zeros((1, 16), dtype=torch.long, device="meta")
    base = Layout(ep=2, pp=2, vpp=2, schedule="dualpipev", dp=2)
    steps = {}
    for name, found in (("gpu", cluster("h100")),
                        ("cpu", dataclasses.replace(cluster("h100"), overlap=False))):
        s = Searcher(_deepseek(), keyword_batch(ids, ids), cluster=found, global_batch_size=8,
                     precision="fp32")
        off, on = (s.estimate(dataclasses.replace(base, overlap_ep=v)) for v in (False, True))
        assert on.peak > off.peak
        steps[name] = (off, on)
    off, on = steps["gpu"]
    assert on.step < off.step and on.breakdown["comm_ep"] < off.breakdown["comm_ep"]
    off, on = steps["cpu"]
    assert on.step == off.step
