"""Data parallelism on real gloo ranks vs plain single-device PyTorch.

dp=2; dp=2 x pp=2 (1F1B); dp=2 x pp=2 x vpp=2 (interleaved), both reference models,
ranks seeing different numbers of ignored labels. The event log of every rank shows the
bucketed reductions: one per bucket per step, none before the last micro-batch, the
first one issued before any gradient of the last bucket exists.
"""

from __future__ import annotations

import pytest

from tests.harness.distributed import run_worlds
from tests.harness.helpers import assert_overlapped
from tests.parity.scenarios import MBS, Scenario, check_parity, train_each

SMALL_BUCKETS = (("bucket_size", 3000),)
PARITY = (
    [Scenario(model, dp=2, options=SMALL_BUCKETS) for model in ("gpt", "llama")]
    + [
        Scenario(model, dp=2, pp=2, schedule="1f1b", options=SMALL_BUCKETS)
        for model in ("gpt", "llama")
    ]
    + [Scenario(model, dp=2, pp=2, vpp=2, schedule="interleaved") for model in ("gpt", "llama")]
    + [
        Scenario("gpt", dp=2, options=(("overlap_grad_reduce", False),)),
    ]
)


@pytest.fixture(scope="module")
def results():
    return run_worlds(train_each, PARITY, (2, 4))


def test_ranks_see_different_token_counts():
    ids, labels = Scenario("gpt", dp=2).batches()[0]
    per_rank = [sum(int((labels[(i * 2 + r) * MBS : (i * 2 + r + 1) * MBS] != -100).sum())
                    for i in range(4)) for r in range(2)]
    assert per_rank[0] != per_rank[1]


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize(
    "sc", [s for s in PARITY if s.options == SMALL_BUCKETS], ids=lambda s: s.id
)
def test_reductions_overlap_backward(results, sc):
    for rank in results[sc.world]:
        r = rank[sc.id]
        for log in r["events"]:  # every step
            for chunk, (layout,) in r["layouts"].items():
                assert_overlapped(log, layout, chunk)
