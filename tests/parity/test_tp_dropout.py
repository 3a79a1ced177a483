"""Dropout masks at tp=2 on real gloo ranks (one spawn): replicated-region masks are the
same on both ranks, masks on split values (attention heads; the residual stream's sequence
slice under sequence parallelism) are independent per rank, and recompute='full' replays
them (the same gradients as without recompute). Values cannot match one device once
dropout is on, so the masks themselves are compared."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import make_batch
from tests.passes.test_tp_dropout import DropoutAttention

aten = torch.ops.aten


class _Masks(fx.Interpreter):
    """Runs a bound chunk graph and keeps each dropout's mask (by owning module)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.masks = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.target == aten.dropout.default:
            self.masks[n.meta["fxmeg"]["module"]] = (out != 0)
        return out


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.1)


def _engine(**kw):
    torch.manual_seed(0)
    ids, labels = make_batch(2, seed=0)
    return fxmeg.parallelize(DropoutAttention(), (ids, labels), tp=2, global_batch_size=2,
                             optimizer=_sgd, **kw)


def run(rank: int) -> dict:
    out = {}
    ids, labels = make_batch(2, seed=1)
    for sp in (False, True):
        engine = _engine(sequence_parallel=sp)
        (gm,) = engine.context.chunks.values()
        torch.manual_seed(123)  # the same default stream on every rank
        rec = _Masks(gm)
        with torch.no_grad():
            rec.run(ids, labels)
        out[f"masks_sp{int(sp)}"] = rec.masks
        # default stream after a step
        out[f"after_sp{int(sp)}"] = int(torch.randint(0, 2**30, (1,)))
    for rc in ("none", "full", "selective"):
        engine = _engine(sequence_parallel=True, recompute=rc)
        torch.manual_seed(7)
        engine.train_step((ids, labels))
        out[f"state_{rc}"] = engine.full_state_dict()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


def _agreement(a, b) -> float:
    return float((a == b).float().mean())


@pytest.mark.parametrize("sp", [0, 1])
def test_attention_masks_are_independent_per_rank(results, sp):
    a, b = (r[f"masks_sp{sp}"]["layers.0.attn_drop"] for r in results)
    assert a.shape == b.shape == (2, 2, 16, 16)  # this rank's 2 of 4 heads
    assert not torch.equal(a, b)
    assert 0.4 < _agreement(a, b) < 0.6  # p=0.5: independent masks agree half the time
    assert 0.4 < float(a.float().mean()) < 0.6



def test_residual_masks_equal_without_sequence_parallelism(results):
    a, b = (r["masks_sp0"]["layers.0.resid_drop"] for r in results)
    assert a.shape == (2, 16, 16) and torch.equal(a, b)


def test_residual_masks_independent_under_sequence_parallelism(results):
    a, b = (r["masks_sp1"]["layers.0.resid_drop"] for r in results)
    assert a.shape == (2, 8, 16)  # this rank's half of the sequence
    assert not torch.equal(a, b) and 0.4 < _agreement(a, b) < 0.6


def test_default_stream_advances_alike_on_every_rank(results):
    assert results[0]["after_sp0"] == results[1]["after_sp0"]
    assert results[0]["after_sp1"] == results[1]["after_sp1"]


@pytest.mark.parametrize("rc", ["full", "selective"])
def test_recompute_replays_the_masks(results, rc):
    """The per-rank masks recomputed in backward are the forward's: one SGD step gives the
    weights of the run without recompute (a mask drawn anew changes the gradients)."""
    for r in results:
        none, again = r["state_none"], r[f"state_{rc}"]
        assert none.keys() == again.keys()
        for k in none:
            torch.testing.assert_close(again[k], none[k], rtol=0, atol=1e-6, msg=k)
    start = _engine_free_initial()
    moved = [k for k in start if not torch.equal(start[k], results[0]["state_none"][k])]
    assert moved  # the step did train (the comparison above is not vacuous)


def _engine_free_initial() -> dict:
    torch.manual_seed(0)
    return DropoutAttention().state_dict()
