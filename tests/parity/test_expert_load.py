"""Tokens per expert on real gloo ranks (fxmeg/runtime/expert_load.py), in one 2-rank spawn: at
ep=2 (dp=2, each rank routing its own micro-batches) and over a pipeline (pp=2, each
stage holding one of the two layers), every rank reports each layer's counts over the
global batch: those of the model's own routing in one process. Loss-free balancing at
ep=2 (DeepSeek-V3, ``moe_router_bias_update_rate``) trains as the plain single-device
loop of tests/runtime/test_expert_load.py, the router bias included; under bf16 the bias
stays fp32 on every rank (fxmeg/frontend/router_bias.py), each update made in fp32."""

from __future__ import annotations

import pytest
import torch

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import assert_losses_close, assert_weights_close, make_batch, optimizer
from tests.harness.models import tiny_moe
from tests.runtime.test_expert_load import BIAS, RATE, balancing_reference, hand_counts

GBS, MBS = 8, 2
LAYOUTS = {"dp2-ep2": dict(ep=2), "pp2": dict(pp=2)}


def _batches(n: int = 2):
    return [make_batch(GBS, seed=10 + s, vocab=96) for s in range(n)]


def _engine(model, **options):
    return fxmeg.parallelize(
        model, tuple(t[:MBS] for t in _batches()[0]), global_batch_size=GBS, **options
    )


def run(rank: int) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        engine = _engine(tiny_moe("mixtral"), **layout)
        out[name] = [engine.train_step(b).expert_load for b in _batches()]
    engine = _engine(
        tiny_moe("deepseek_v3"), ep=2, moe_router_bias_update_rate=RATE, optimizer=optimizer
    )
    out["balancing"] = [engine.train_step(b) for b in _batches(3)]
    state = engine.full_state_dict()
    out["state"] = state if rank == 0 else None
    out["bias"] = state[BIAS]
    engine = _engine(tiny_moe("deepseek_v3"), ep=2, precision="bf16",
                     moe_router_bias_update_rate=RATE, optimizer=optimizer)
    loads = [engine.train_step(b).expert_load for b in _batches(3)]
    out["bf16"] = dict(loads=loads, held=dict(engine.context.load.biases),
                       saved=engine.full_state_dict()[BIAS])
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


def test_loss_free_balancing_at_ep2_equals_plain_pytorch(results):
    losses, counts, ref = balancing_reference(tiny_moe("deepseek_v3"), _batches(3), RATE)
    steps = results[0]["balancing"]
    assert all([s.loss for s in r["balancing"]] == [s.loss for s in steps] for r in results)
    assert_losses_close([s.loss for s in steps], losses)
    assert [{k: list(v) for k, v in s.expert_load.items()} for s in steps] == counts
    assert_weights_close(results[0]["state"], ref.state_dict())
    # every rank, the same update
    assert all(torch.equal(r["bias"], ref.get_buffer(BIAS)) for r in results)


def test_the_router_bias_stays_fp32_under_bf16(results):
    """Megatron keeps expert_bias fp32 in any precision: after three bf16 steps at ep=2 each
    rank's bias (held and saved) is fp32 and equals RATE * sign(mean - counts) summed in
    fp32 over the measured counts of each step. In bf16 the first update alone would
    round (0.05 is 0.0500488)."""
    layer = BIAS.removesuffix("gate.e_score_correction_bias") + "experts"
    loads = results[0]["bf16"]["loads"]
    want = torch.zeros(4, dtype=torch.float32)
    for step in loads:
        counts = torch.tensor(step[layer], dtype=torch.float32)
        want += RATE * torch.sign(counts.mean() - counts)
    assert want.abs().sum() > 0 and not torch.equal(want.bfloat16().float(), want)
    for r in results:
        assert r["bf16"]["loads"] == loads
        assert list(r["bf16"]["held"]) == [layer]
        for bias in (r["bf16"]["held"][layer], r["bf16"]["saved"]):
            assert bias.dtype == torch.float32 and torch.equal(bias, want), bias
