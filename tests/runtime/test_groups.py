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
    """Megatron's order tp-cp-dp-pp: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank));
    cp groups vary only the cp rank, dp x cp groups the dp and cp ranks (cp fastest)."""
    topo = Topology(tp=tp, pp=pp, dp=dp, cp=cp)
    assert topo.world_size == tp * cp * pp * dp
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        r = topo.rank(tp=t, cp=c, dp=d, pp=p)
        assert r == t + tp * (c + cp * (d + dp * p))
        assert topo.coords(r) == (t, d, p) and topo.cp_rank(r) == c
    for kind, size, varying in (("cp", cp, "c"), ("dp_cp", dp * cp, "cd"), ("tp", tp, "t"), ("pp", pp, "p")):
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
