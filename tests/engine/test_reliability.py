"""Guards at world size 1: the loss-spike guard, the consecutive-skip limit, the
determinism check."""

import pytest
import torch
from torch import nn

import fxmeg
from tests.harness.helpers import make_batch
from tests.harness.models import make_model


def test_spike_guard_skips_and_a_run_of_skips_stops():
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), global_batch_size=8,
                               skip_on_grad_norm_above=1e-6, max_consecutive_skips=3)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    for step in range(2):
        r = engine.train_step(make_batch(8, seed=step))
        assert r.skipped and r.skip_reason == "grad_norm" and r.grad_norm > 1e-6
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(
        fxmeg.FxmegError, match="3 steps in a row were skipped \\(last: grad_norm\\)"
    ):
        engine.train_step(make_batch(8, seed=2))


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16)])
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        h = nn.functional.dropout(self.layers[0](self.emb(ids)), p=0.5, training=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_determinism_check_reruns_and_reports():
    steady = fxmeg.parallelize(make_model("llama"), make_batch(2, seed=0), global_batch_size=8)
    r = steady.train_step(make_batch(8, seed=1), check_determinism=True)
    assert r.rerun_mismatch is False
    noisy = fxmeg.parallelize(_Dropout(), make_batch(2, seed=0), global_batch_size=8)
    assert noisy.train_step(make_batch(8, seed=1), check_determinism=True).rerun_mismatch is True
    assert noisy.train_step(make_batch(8, seed=2)).rerun_mismatch is None  # off by default


def test_unknown_option_names_the_nearest():
    with pytest.raises(
        fxmeg.FxmegError, match="unknown option 'on_nonfinit' \\(did you mean 'on_nonfinite'\\?\\)"
    ):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), on_nonfinit="raise")
