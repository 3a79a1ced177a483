"""Context parallelism on real gloo ranks vs plain single-device PyTorch, GPT (learned
positions, tied embedding) and Llama (rotary tables, GQA): cp=2; cp=4; cp=2 composed with
dp=2 and the distributed optimizer, pp=2 (1F1B, interleaved, ZB-H1: the pipeline sends
local sequence slices), tp=2 (with sequence parallelism), recompute, overlapped parameter
gathers and layer-wise sharding (Muon); and Hugging Face's Llama at cp=2 in sdpa (a causal
mask built from positions, labels shifted inside the model) and eager attention (matmul,
softmax, matmul; also at cp2 x tp2). Every batch ignores a different number of leading
labels per sample, so cp ranks count different tokens (some none). Also
``fxmeg::cp_attention`` itself against full causal attention, values and gradients, with
GQA (``enable_gqa``); Engine.verify at cp=2; and the activations each rank saves."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxmeg
from fxmeg.ops import cp_positions
from fxmeg.report import SavedBytes
from tests.distributed import run_worlds
from tests.helpers import make_batch, make_model, optimizer
from tests.parity.scenarios import Scenario, check_parity, train_each

MODELS = ("gpt", "llama")
DIST_OPT = (("distributed_optimizer", True),)
EAGER = (("attn_implementation", "eager"),)
PARITY = [Scenario(m, cp=2) for m in (*MODELS, "hf-llama")] + [Scenario("hf-llama", cp=2, model_args=EAGER)] + [
    Scenario(m, cp=2, dp=2, options=DIST_OPT) for m in MODELS
] + [Scenario(m, cp=4) for m in MODELS] + [
    Scenario("gpt", cp=2, pp=2, schedule="1f1b"),
    Scenario("gpt", cp=2, pp=2, vpp=2),
    Scenario("llama", cp=2, pp=2, schedule="zbh1"),
    Scenario("gpt", cp=2, tp=2, options=(("sequence_parallel", True),)),
    Scenario("llama", cp=2, tp=2),
    Scenario("hf-llama", cp=2, tp=2, model_args=EAGER),
    Scenario("gpt", cp=2, dp=2, options=(*DIST_OPT, ("overlap_param_gather", True), ("recompute", "full"))),
    Scenario("llama", cp=2, dp=2, opt="muon",
             options=(*DIST_OPT, ("optimizer_sharding", "layerwise"), ("recompute", "selective"))),
]


def attention(rank: int) -> dict:
    """cp-parallel causal attention of this rank's rows vs full attention on one rank."""
    import fxmeg.runtime.collectives  # noqa: F401  (registers the kernels)

    ops, group, cp = torch.ops.fxmeg, dist.group.WORLD.group_name, dist.get_world_size()
    out = {}
    for gqa in (False, True):
        torch.manual_seed(0)
        kv_heads = 2 if gqa else 4
        q = torch.randn(2, 4, 16, 8, requires_grad=True)
        k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
        v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        full.backward(torch.ones_like(full))
        mine = torch.tensor(cp_positions(16, cp, rank))
        ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        y = ops.cp_attention(ql, kl, vl, None, gqa, cp, group)
        y.backward(torch.ones_like(y))
        out[gqa] = {name: (a, b[:, :, mine]) for name, a, b in (
            ("out", y, full), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad), ("dv", vl.grad, v.grad))}
    return out


def saved_bytes(cp: int) -> int:
    """Peak bytes autograd saves on this rank in one step of a 2-layer GPT on sequences
    of 64, micro-batches of 2, at cp=cp (the rest of the two ranks data-parallel)."""
    batches = [make_batch(8, seed=100, seq=64)]
    engine = fxmeg.parallelize(make_model("gpt", n_layer=2, seq_len=64), tuple(t[:2] for t in batches[0]),
                               cp=cp, global_batch_size=8, optimizer=optimizer)
    meter = SavedBytes(engine.named_parameters.values())
    with meter.hooks():
        engine.train_step(batches[0])
    return meter.peak


def run(rank: int, scenarios: list[Scenario]) -> dict:
    out = train_each(rank, scenarios)
    if dist.get_world_size() == 2:
        out["attention"] = attention(rank)
        sc = PARITY[1]  # llama at cp=2: Engine.verify against the single-device graph
        out["verify"] = sc.engine().verify(sc.batches()[0])
        out["saved"] = {cp: saved_bytes(cp) for cp in (1, 2)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_worlds(run, PARITY, sorted({s.world for s in PARITY}))


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_matches_single_device(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


def test_activations_per_rank_shrink_with_cp(results):
    """Each rank saves its 1/cp of the activations, plus the gathered keys and values of
    every layer: at most 0.6x of cp=1's for the same model and micro-batch."""
    for r in results[2]:
        assert r["saved"][2] <= 0.6 * r["saved"][1], r["saved"]


def test_verify_agrees_with_single_device(results):
    for r in results[2]:
        assert r["verify"].ok, r["verify"]


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_attention_ops_match_full_causal_attention(results, gqa):
    for r in results[2]:
        for name, (got, want) in r["attention"][gqa].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)

