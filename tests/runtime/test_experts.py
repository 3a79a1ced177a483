"""The expert all-to-all exchange (fxmeg/runtime/experts.py) on 2 real gloo ranks: rows
reach the rank holding their expert and come back, gradients the reverse way, and a
traced step records each all-to-all as an ``ep_a2a`` span (nothing when tracing is off)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fxmeg.runtime import experts
from fxmeg.runtime.timelines import Tracer
from tests.harness.distributed import run_world

E = 4  # experts, 2 per rank


def exchange_rows(rank: int) -> dict:
    group = dist.new_group([0, 1])
    ex = experts.RankExperts(tracer=Tracer()).exchange(group.group_name)
    out = {}
    for traced in (False, True):
        ex.tracer.begin_step(traced)
        # rows per expert
        counts = torch.tensor([1, 2, 0, 3]) if rank == 0 else torch.tensor([2, 0, 1, 1])
        rows = (
            (torch.arange(int(counts.sum()), dtype=torch.float32) + 10 * rank)
            .unsqueeze(1)
            .requires_grad_()
        )
        got, per_expert, state = ex.dispatch(rows, counts)
        back = ex.combine(got * 2, state)
        back.sum().backward()
        out[traced] = dict(got=got.detach().flatten().tolist(), per_expert=per_expert.tolist(),
                           back=back.detach().flatten().tolist(), grad=rows.grad.flatten().tolist(),
                           spans=[(name, cat) for name, cat, _, _ in ex.tracer.events or []])
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_world(2, exchange_rows)


def test_rows_go_to_their_expert_and_back(ranks):
    r0, r1 = ranks[0][True], ranks[1][True]
    # rank 0 holds experts 0, 1: rank 0's rows 0 (e0), 1-2 (e1); rank 1's rows 10-11 (e0)
    assert r0["got"] == [0.0, 10.0, 11.0, 1.0, 2.0] and r0["per_expert"] == [3, 2]
    # rank 1 holds experts 2, 3: rank 0's rows 3-5 (e3); rank 1's rows 12 (e2), 13 (e3)
    assert r1["got"] == [12.0, 3.0, 4.0, 5.0, 13.0] and r1["per_expert"] == [1, 4]
    for r, rank in ((r0, 0), (r1, 1)):
        n = len(r["back"])
        # each row back where it came from
        assert r["back"] == [2 * (i + 10 * rank) for i in range(n)]
        assert r["grad"] == [2.0] * n


def test_each_all_to_all_is_a_span_when_traced(ranks):
    for r in ranks:
        assert r[False]["spans"] == []
        names = [name for name, cat in r[True]["spans"] if cat == "ep_a2a"]
        assert sorted(names) == [
            "ep combine",
            "ep combine grad",
            "ep counts",
            "ep dispatch",
            "ep dispatch grad",
        ]
