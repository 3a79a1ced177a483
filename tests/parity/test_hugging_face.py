"""Unmodified Hugging Face models (built from a config, no download) on real gloo ranks vs
single-device training of the same model: Llama and Qwen2 at pp=2, tp=2, dp=2 x pp=2 and tp=2 x pp=2
x dp=2; GPT-2 (Conv1D, fused QKV, tied embedding) at pp=2 and tp=2; Mistral at pp=2 x tp=2 and, with
a pad token on either vocabulary shard, at tp=2; Llama with eager attention, Gemma-2 (eager,
softcapping), Phi-3 (fused qkv_proj / gate_up_proj) and OLMo-2 (q/k norms over the whole projection)
at tp=2; Mixtral (batched_mm experts) at pp=2 and tp=2 x pp=2 with its router loss; DeepSeek-V3
at tp=2 x ep=2 x pp=2 (dp=2) under DualPipeV (latent attention and each expert split over tp)."""

from __future__ import annotations

import pytest

from fxmeg.ir.layouts import is_split
from tests.harness.distributed import run_worlds
from tests.parity.scenarios import Scenario, check_parity, check_router_loss, train_each

PARITY = [
    Scenario(f"hf-{kind}", **layout)
    for kind in ("llama", "qwen2")
    for layout in (dict(pp=2), dict(tp=2), dict(dp=2, pp=2), dict(tp=2, pp=2, dp=2))
] + [Scenario("hf-gpt2", pp=2), Scenario("hf-gpt2", tp=2), Scenario("hf-mistral", pp=2, tp=2)] + [
    # a pad token: the embedding's padding_idx row, on either vocabulary shard, gets no gradient
    Scenario("hf-mistral", tp=2, model_args=(("pad_token_id", pad),)) for pad in (0, 100)
] + [
    # eager attention (matmuls over head-split q, k, v), Phi-3's fused qkv_proj sliced by
    # blocks, OLMo-2's q/k norms over the whole split projection (all-reduced statistic)
    Scenario("hf-llama", tp=2, model_args=(("attn_implementation", "eager"),)),
    Scenario("hf-phi3", tp=2), Scenario("hf-olmo2", tp=2),
    Scenario("hf-gemma2", tp=2),  # eager by default, softcapped attention and tied head
] + [
    # DeepSeek-V3 the way it trains, in the 8-rank spawn: latent attention and each expert split
    # over tp, experts over ep (folded over dp), DualPipeV splitting the experts' backward
    Scenario("moe-deepseek_v3", tp=2, pp=2, vpp=2, dp=2, schedule="dualpipev",
             options=(("ep", 2),)),
]
# tp: the router stays whole, each expert split
MIXTRAL = [Scenario("hf-mixtral", pp=2), Scenario("hf-mixtral", tp=2, pp=2)]


@pytest.fixture(scope="module")
def results():
    return run_worlds(train_each, PARITY + MIXTRAL, (2, 4, 8))


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize("sc", MIXTRAL, ids=lambda s: s.id)
def test_mixtral_router_loss_is_weighted_per_micro_batch(results, sc):
    """Reference: token-weighted cross-entropy over the global batch plus each
    micro-batch's router loss weighted 1 / (micro-batches), as Megatron's AutoScaler.
    At tp=2 the router (and the experts) stay whole, attention is split."""
    ranks = [r[sc.id] for r in results[sc.world]]
    if sc.tp > 1:
        specs = ranks[0]["tp_specs"]
        assert not is_split(specs["model.layers.0.mlp.gate.weight"])
        assert not is_split(specs["model.layers.0.mlp.experts.gate_up_proj"])
        assert is_split(specs["model.layers.0.self_attn.q_proj.weight"])
    check_router_loss(ranks, sc)
