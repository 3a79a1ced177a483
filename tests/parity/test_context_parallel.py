"""Context parallelism on real gloo ranks vs plain single-device PyTorch, GPT (learned
positions, tied embedding) and Llama (rotary tables, GQA): cp=2; cp=4; cp=2 composed with
dp=2 and the distributed optimizer, pp=2 (1F1B, interleaved, ZB-H1: the pipeline sends
local sequence slices), tp=2 (with sequence parallelism), recompute, overlapped parameter
gathers and layer-wise sharding (Muon). Every batch ignores a different number of leading
labels per sample, so cp ranks count different tokens (some none). Also the attention
ops themselves (``fxmeg::cp_gather`` + ``cp_causal_mask``) against full causal attention,
values and gradients, with GQA (``enable_gqa``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxmeg.ops import cp_positions
from tests.distributed import run_worlds
from tests.parity.scenarios import Scenario, check_parity, train_each

MODELS = ("gpt", "llama")
DIST_OPT = (("distributed_optimizer", True),)
PARITY = [Scenario(m, cp=2) for m in MODELS] + [
    Scenario(m, cp=2, dp=2, options=DIST_OPT) for m in MODELS
] + [Scenario(m, cp=4) for m in MODELS] + [
    Scenario("gpt", cp=2, pp=2, schedule="1f1b"),
    Scenario("gpt", cp=2, pp=2, vpp=2),
    Scenario("llama", cp=2, pp=2, schedule="zbh1"),
    Scenario("gpt", cp=2, tp=2, options=(("sequence_parallel", True),)),
    Scenario("llama", cp=2, tp=2),
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
        y = F.scaled_dot_product_attention(
            ql, ops.cp_gather(kl, 2, cp, group), ops.cp_gather(vl, 2, cp, group),
            ops.cp_causal_mask(ql, 2, cp, group), enable_gqa=gqa)
        y.backward(torch.ones_like(y))
        out[gqa] = {name: (a, b[:, :, mine]) for name, a, b in (
            ("out", y, full), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad), ("dv", vl.grad, v.grad))}
    return out


def run(rank: int, scenarios: list[Scenario]) -> dict:
    out = train_each(rank, scenarios)
    if dist.get_world_size() == 2:
        out["attention"] = attention(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_worlds(run, PARITY, sorted({s.world for s in PARITY}))


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_matches_single_device(results, sc):
    check_parity([r[sc.id] for r in results[sc.world]], sc)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_attention_ops_match_full_causal_attention(results, gqa):
    for r in results[2]:
        for name, (got, want) in r["attention"][gqa].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)

