"""The rank layout without processes: Topology's rank <-> coordinate arithmetic, its
groups (each a partition of the world whose members differ only in the group's own
coordinates), tied-weight subgroups, and build_groups / the collective helpers at world
size 1."""

import itertools

import pytest
import torch

from fxmeg.runtime.groups import (
    Groups,
    Topology,
    all_gather_,
    all_reduce,
    build_groups,
    reduce_scatter_,
    shard_of,
    shard_range,
)

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (2, 3, 2), (4, 2, 3), (3, 4, 1)]
KINDS = {  # group kind -> coordinates (tp, dp, pp) that vary within a group
    "tp": {0}, "dp": {1}, "pp": {2}, "mp": {0, 2},
}


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_rank_and_coords_are_inverse(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    assert topo.world_size == tp * pp * dp
    seen = set()
    for t, d, p in itertools.product(range(tp), range(dp), range(pp)):
        r = topo.rank(tp=t, dp=d, pp=p)
        assert 0 <= r < topo.world_size
        assert topo.coords(r) == (t, d, p)
        seen.add(r)
    assert seen == set(range(topo.world_size))


def test_layout_is_tensor_parallel_fastest():
    topo = Topology(tp=2, pp=2, dp=3)
    assert [topo.coords(r) for r in range(4)] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert topo.coords(6) == (0, 0, 1)  # pipeline stage 1 starts after tp * dp ranks
    assert topo.tp_groups()[0] == [0, 1]
    assert topo.dp_groups()[0] == [0, 2, 4]
    assert topo.pp_groups()[0] == [0, 6]


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_groups_partition_the_world(tp, pp, dp, kind):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    groups = getattr(topo, f"{kind}_groups")()
    members = [r for g in groups for r in g]
    assert sorted(members) == list(range(topo.world_size))  # each rank exactly once
    size = {"tp": tp, "dp": dp, "pp": pp, "mp": tp * pp}[kind]
    assert all(len(g) == size for g in groups)
    varying = KINDS[kind]
    for g in groups:
        coords = [topo.coords(r) for r in g]
        for axis in range(3):
            values = {c[axis] for c in coords}
            if axis in varying:
                assert len(values) == (tp, dp, pp)[axis]  # spans the whole axis
            else:
                assert len(values) == 1  # fixed within the group


@pytest.mark.parametrize("tp,pp,dp", SHAPES)
def test_pipeline_groups_are_in_stage_order(tp, pp, dp):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    for g in topo.pp_groups():
        assert [topo.coords(r)[2] for r in g] == list(range(pp))


@pytest.mark.parametrize("tp,pp,dp", [(1, 4, 1), (2, 4, 2), (2, 3, 3)])
@pytest.mark.parametrize("tied", [frozenset({0, 1}), frozenset({0, 2}), frozenset({2, 0, 1})])
def test_tied_subgroups(tp, pp, dp, tied):
    topo = Topology(tp=tp, pp=pp, dp=dp)
    subs = topo.subgroups(tied)
    assert len(subs) == tp * dp
    # together: exactly the ranks on the tied pipeline stages
    members = sorted(r for g in subs for r in g)
    assert members == sorted(r for r in range(topo.world_size) if topo.coords(r)[2] in tied)
    pipelines = [set(g) for g in topo.pp_groups()]
    for g in subs:
        assert [topo.coords(r)[2] for r in g] == sorted(tied)
        assert any(set(g) <= p for p in pipelines)  # within one pipeline: same tp, dp


def test_groups_peers_and_ranks_without_processes():
    topo = Topology(tp=2, pp=3, dp=2)
    g = Groups(topo, rank=topo.rank(tp=1, dp=1, pp=2))
    assert (g.pp_rank, g.dp_rank) == (2, 1)
    assert [g.pp_peer(p) for p in range(3)] == [3, 7, 11]
    assert [g.pp_peer(p) for p in range(3)] == next(p for p in topo.pp_groups() if g.rank in p)


def test_build_groups_at_world_size_one():
    tied = [frozenset({0})]
    g = build_groups(Topology(tp=1, pp=1, dp=1), tied=tied, timeout_s=5.0)
    assert (g.rank, g.pp, g.dp, g.tp, g.mp) == (0, None, None, None, None)
    assert g.tied == {frozenset({0}): None}
    assert (g.pp_rank, g.dp_rank, g.pp_peer(0)) == (0, 0, 0)


def test_collectives_on_a_group_of_one_are_identities():
    flat = torch.arange(6.0)
    all_reduce(flat, None)
    assert torch.equal(flat, torch.arange(6.0))
    assert shard_range(3, 9, None) == (3, 9)
    assert shard_of(flat, None) is flat
    assert reduce_scatter_(flat, None) is None and all_gather_(flat, None) is None
    assert torch.equal(flat, torch.arange(6.0))


CP_SHAPES = [(1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 2, 2), (2, 2, 2, 2), (1, 1, 2, 4), (2, 3, 1, 3)]


@pytest.mark.parametrize("tp,pp,dp,cp", CP_SHAPES)
def test_context_parallel_sits_between_tp_and_dp(tp, pp, dp, cp):
    """Megatron's order tp-cp-dp-pp: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp *
    pp_rank));
    cp groups vary only the cp rank, dp x cp groups the dp and cp ranks (cp fastest)."""
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp)
    assert topo.world_size == tp * cp * pp * dp
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        r = topo.rank(tp=t, cp=c, dp=d, pp=p)
        assert r == t + tp * (c + cp * (d + dp * p))
        assert topo.coords(r) == (t, d, p) and topo.cp_rank(r) == c
    for kind, size, varying in (
        ("cp", cp, "c"),
        ("dp_cp", dp * cp, "cd"),
        ("tp", tp, "t"),
        ("pp", pp, "p"),
    ):
        groups = getattr(topo, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == size for g in groups)
        for g in groups:
            at = [(topo.coords(r)[0], topo.cp_rank(r), *topo.coords(r)[1:]) for r in g]
            for axis, letter in enumerate("tcdp"):
                if letter not in varying:
                    assert len({a[axis] for a in at}) == 1, (kind, g)
    g = Groups(topo, topo.rank(tp=0, cp=cp - 1, dp=dp - 1, pp=0))
    assert g.cp_rank == cp - 1 and g.dp_cp_rank == cp * dp - 1  # place in the sorted dp x cp group
    assert g.pp_peer(pp - 1) == topo.rank(tp=0, cp=cp - 1, dp=dp - 1, pp=pp - 1)


def test_expert_groups_fold_over_dp():
    """tp=2, dp=4, ep=2: each tp rank's dp group [0, 2, 4, 6] / [1, 3, 5, 7] is cut into runs
    of ep consecutive ranks (ep groups); the expert-data-parallel groups take every ep-th."""
    topo = Topology(tp=2, pp=1, dp=4, cp=1, ep=2)
    assert topo.dp_cp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.edp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]


def test_expert_groups_fold_over_cp():
    """cp=2, dp=2, ep=2: q = cp_rank + cp * dp_rank, so an ep group is the two cp ranks of one
    dp rank and an edp group the same cp rank of the two dp ranks."""
    topo = Topology(tp=2, pp=1, dp=2, cp=2, ep=2)
    assert topo.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert topo.edp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for g in topo.ep_groups():
        assert [topo.cp_rank(r) for r in g] == [0, 1] and len({topo.coords(r) for r in g}) == 1
    for g in topo.edp_groups():
        assert len({topo.cp_rank(r) for r in g}) == 1 and [topo.coords(r)[1] for r in g] == [0, 1]
    assert Topology(tp=1, pp=1, dp=2, cp=2, ep=4).ep_groups() == [[0, 1, 2, 3]]


EP_SHAPES = [
    (2, 1, 4, 1, 2),
    (2, 1, 2, 2, 2),
    (1, 2, 4, 1, 4),
    (2, 2, 3, 2, 3),
    (1, 1, 2, 3, 6),
    (1, 2, 6, 1, 2),
    (2, 1, 2, 2, 1),
    (1, 1, 4, 2, 4),
]


@pytest.mark.parametrize("tp,pp,dp,cp,ep", EP_SHAPES)
def test_expert_groups_partition_each_dp_cp_group(tp, pp, dp, cp, ep):
    """Every rank is in one ep group (size ep) and one edp group (size dp * cp / ep); within a
    dp x cp group, each ep group meets each edp group in exactly one rank, so ep groups x edp
    groups = the dp x cp group; Groups' ep_rank / edp_rank are the places in them, by the
    folding q = cp_rank + cp * dp_rank, ep_rank = q % ep, edp_rank = q // ep."""
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    eps, edps = topo.ep_groups(), topo.edp_groups()
    for groups, size in ((eps, ep), (edps, dp * cp // ep)):
        # each rank once
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == size for g in groups)
    for dc in topo.dp_cp_groups():
        inside_ep = [g for g in eps if set(g) <= set(dc)]
        inside_edp = [g for g in edps if set(g) <= set(dc)]
        assert len(inside_ep) == dp * cp // ep and len(inside_edp) == ep
        assert all(len(set(e) & set(d)) == 1 for e in inside_ep for d in inside_edp)
        assert {r for e in inside_ep for r in e} == set(dc)
    for r in range(topo.world_size):
        g = Groups(topo, r)
        q = topo.cp_rank(r) + cp * topo.coords(r)[1]
        assert (g.dp_cp_rank, g.ep_rank, g.edp_rank, g.edp_size) == (
            q,
            q % ep,
            q // ep,
            dp * cp // ep,
        )
        assert next(e for e in eps if r in e).index(r) == g.ep_rank
        assert next(d for d in edps if r in d).index(r) == g.edp_rank
