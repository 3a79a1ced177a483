"""Tokens per expert on real gloo ranks (fxmeg/runtime/load.py), in one 2-rank spawn: at
ep=2 (dp=2, each rank routing its own micro-batches) and over a pipeline (pp=2, each
stage holding one of the two layers), every rank reports each layer's counts over the
global batch: those of the model's own routing in one process."""

from __future__ import annotations

import pytest

import fxmeg
from tests.distributed import run_world
from tests.helpers import make_batch, tiny_moe
from tests.test_expert_load import hand_counts

GBS, MBS = 8, 2
LAYOUTS = {"dp2-ep2": dict(ep=2), "pp2": dict(pp=2)}


def _batches():
    return [make_batch(GBS, seed=10 + s, vocab=96) for s in range(2)]


def run(rank: int) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        batches = _batches()
        engine = fxmeg.parallelize(tiny_moe("mixtral"), tuple(t[:MBS] for t in batches[0]), global_batch_size=GBS,
                                   **layout)
        out[name] = [engine.train_step(b).expert_load for b in batches]
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_reports_the_global_batchs_counts(results, layout):
    want = hand_counts(tiny_moe("mixtral"), _batches()[0][0])
    first = results[0][layout][0]
    assert {k: list(v) for k, v in first.items()} == want
    assert all(r[layout] == results[0][layout] for r in results)
