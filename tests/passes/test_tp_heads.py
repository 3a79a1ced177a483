"""Attention layouts of fxmeg/passes/tp/heads.py through the tensor-parallel pass, in one
process: key/value heads fewer than tp ranks (Falcon's and gpt_bigcode's multi-query
fused projections, Hugging Face llama with one key/value head) are replicated while the
query heads split; Falcon's ``x @ w.T`` linears split; a per-head interleaved fused
QKV (bloom's layout) splits by whole heads; what stays whole is warned about and shown
by ``plan``. Training parity: tests/parity/test_zoo.py (falcon, gpt_bigcode-mqa)."""

import logging

import pytest
import torch
from torch import nn

import fxmeg
from fxmeg.errors import PassError
from fxmeg.ir.layouts import Replicate, Shard
from tests.harness.helpers import graph_after, make_batch
from tests.parity.test_zoo import hf

aten = torch.ops.aten


def _layouts(gm) -> dict:
    return {
        n.target: n.meta["fxmeg"]["tp"] for n in gm.graph.nodes if "tp" in n.meta.get("fxmeg", {})
    }


def _local(gm, target) -> list:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target == target]


def _tp(model, caplog, **kw):
    with caplog.at_level(logging.WARNING, logger="fxmeg.passes.tensor_parallel"):
        gm = graph_after(model, make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2, **kw)
    said = [r.getMessage() for r in caplog.records if r.name == "fxmeg.passes.tensor_parallel"
            and r.levelno == logging.WARNING]
    return gm, said


def _build(kind, attn="sdpa", **extra):
    torch.manual_seed(0)
    return hf(kind, attn, num_hidden_layers=1, **extra)()


def test_falcon_splits_its_mlp_and_query_heads_and_replicates_its_one_key_value_head(caplog):
    """Falcon's default config: FalconLinear (x @ w.T) is a linear; the MLP and the output
    projection split; the fused query_key_value, viewed as 6 heads and sliced [q | k | v],
    becomes three linears: this rank's 2 query heads and the one key and value head."""
    gm, said = _tp(_build("falcon", head_dim=None, num_key_value_heads=None), caplog)
    tp = _layouts(gm)
    prefix = "transformer.h.0."
    assert tp[prefix + "mlp.dense_h_to_4h.weight"] == Shard(0, (128,))
    assert tp[prefix + "mlp.dense_4h_to_h.weight"] == Shard(1, (128,))
    assert tp[prefix + "self_attention.dense.weight"] == Shard(1, (32,))
    # k, v rows: grads summed
    assert tp[prefix + "self_attention.query_key_value.weight"] == Replicate(True)
    assert aten.matmul.default not in [n.target for n in gm.graph.nodes]
    # k, v, q
    assert sorted(_local(gm, aten.linear.default))[:3] == [(2, 16, 8), (2, 16, 8), (2, 16, 16)]
    (sdpa,) = [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert [tuple(a.meta["val"].shape) for a in sdpa.args[:3]] == [
        (2, 2, 16, 8),
        (2, 1, 16, 8),
        (2, 1, 16, 8),
    ]
    (warning,) = said
    assert "'transformer.h.*.self_attention.query_key_value'" in warning
    assert "1 and 1 key/value head(s), not divisible by tp=2" in warning


def test_gpt_bigcode_multi_query_fused_c_attn(caplog):
    """c_attn (Conv1D-free linear) split into [32, 8, 8]: the query block column-split,
    key and value whole; the MLP splits."""
    gm, said = _tp(_build("gpt_bigcode", multi_query=True), caplog)
    tp = _layouts(gm)
    assert tp["transformer.h.0.attn.c_attn.weight"] == Replicate(True)
    assert tp["transformer.h.0.attn.c_attn.bias"] == Replicate(True)
    assert tp["transformer.h.0.mlp.c_fc.weight"] == Shard(0, (128,))
    assert tp["transformer.h.0.attn.c_proj.weight"] == Shard(1, (32,))
    slices = [n for n in gm.graph.nodes if n.target == torch.ops.fxmeg.tp_slice.default]
    assert [n.args[0].args[0].target for n in slices[:2]] == ["transformer.h.0.attn.c_attn.weight",
                                                             "transformer.h.0.attn.c_attn.bias"]
    assert "'transformer.h.*.attn.c_attn'" in said[0]


def test_llama_with_one_key_value_head_at_tp2(caplog):
    """GQA with num_key_value_heads=1 < tp: q_proj splits, k_proj and v_proj are whole on
    every rank (their gradients summed over tp), read through tp_copy; after repeat_kv
    each rank keeps its query heads' copies (tp_slice)."""
    gm, said = _tp(_build("llama", num_key_value_heads=1), caplog)
    tp = _layouts(gm)
    attn = "model.layers.0.self_attn."
    assert tp[attn + "q_proj.weight"] == Shard(0, (32,))
    assert tp[attn + "k_proj.weight"] == tp[attn + "v_proj.weight"] == Replicate(True)
    assert tp[attn + "o_proj.weight"] == Shard(1, (32,))
    assert tp["model.layers.0.mlp.up_proj.weight"] == Shard(0, (48,))
    linears = [n for n in gm.graph.nodes if n.target == aten.linear.default]
    # one entry
    assert [n.args[0].target for n in linears[:3]] == [torch.ops.fxmeg.tp_copy.default] * 3
    (sdpa,) = [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    assert [a.target for a in sdpa.args[1:3]] == [torch.ops.fxmeg.tp_slice.default] * 2
    assert [tuple(a.meta["val"].shape) for a in sdpa.args[:3]] == [(2, 2, 16, 8)] * 3
    (warning,) = said
    assert (
        "'model.layers.*.self_attn.k_proj': 1 key/value head(s), not divisible by tp=2" in warning
    )
    assert "'model.layers.*.self_attn.v_proj'" in warning and "q_proj" not in warning


class _Interleaved(nn.Module):
    """Bloom's (and Megatron's) fused QKV: rows grouped per head, [heads, 3, head_dim]."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(96, 32), nn.Linear(32, 96)
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"qkv": nn.Linear(32, 96), "out": nn.Linear(32, 32)})]
        )

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, _ = x.shape
        qkv = self.layers[0]["qkv"](x).view(b, s, 4, 3, 8)
        q, k, v = (qkv.select(3, i).transpose(1, 2) for i in range(3))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.layers[0]["out"](y.transpose(1, 2).reshape(b, s, 32))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_per_head_interleaved_fused_qkv_splits_by_whole_heads(caplog):
    """Rank r holds rows [48 r, 48 (r + 1)): heads 2r and 2r + 1, each with its q, k and v."""
    gm, said = _tp(_Interleaved(), caplog)
    assert _layouts(gm)["layers.0.qkv.weight"] == Shard(0, (96,))
    assert _local(gm, aten.view.default)[0] == (2, 16, 2, 3, 8)
    assert _local(gm, aten.scaled_dot_product_attention.default) == [(2, 2, 16, 8)]
    assert not said


def test_whole_projections_are_warned_about_and_shown_by_plan(caplog):
    model = _build("llama", num_key_value_heads=1)
    with caplog.at_level(logging.WARNING, logger="fxmeg.passes.tensor_parallel"):
        result = fxmeg.plan(
            model,
            make_batch(2, seed=0, vocab=96),
            tp=2,
            tp_plan={"model.layers.*.mlp.*": "replicate"},
        )
    assert dict(result.tp_whole)["model.layers.*.mlp.down_proj"] == "tp_plan says 'replicate'"
    text = str(result)
    assert (
        "tp=2 leaves whole on every tp rank: model.layers.*.mlp.up_proj (tp_plan says 'replicate')"
        in text
    )
    assert "model.layers.*.self_attn.k_proj (1 key/value head(s), not divisible by tp=2" in text
    assert [m for m in result.to_dict()["tp_whole"]][0]["modules"] == "model.layers.*.mlp.down_proj"


class _KeyReadWhole(nn.Module):
    """One key head, also added to the residual stream (read whole, not only by the split
    query heads): its gradient on each rank would not be that rank's part. With
    ``in_region`` the whole read is inside an autocast region that the split query heads
    also enter."""

    def __init__(self, in_region: bool = False):
        super().__init__()
        self.in_region = in_region
        self.emb, self.head = nn.Embedding(96, 32), nn.Linear(32, 96)
        self.layers = nn.ModuleList([nn.ModuleDict({n: nn.Linear(32, d) for n, d in (
            ("q", 32), ("k", 8), ("v", 8), ("out", 32))})])

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, _ = x.shape
        layer = self.layers[0]
        q = layer["q"](x).view(b, s, 4, 8).transpose(1, 2)
        k = layer["k"](x).view(b, s, 1, 8).transpose(1, 2)
        v = layer["v"](x).view(b, s, 1, 8).transpose(1, 2)
        if self.in_region:
            with torch.autocast(device_type="cpu", enabled=False):
                q = q.float() * 0.5
                whole = k.float().mean()
        else:
            whole = k.mean()
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + layer["out"](y.transpose(1, 2).reshape(b, s, 32)) + whole
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("in_region", [False, True], ids=["outside", "in-a-region"])
def test_a_replicated_key_read_outside_the_split_heads_is_refused(in_region):
    with pytest.raises(
        PassError,
        match=r"cannot replicate the key/value projection 'layers.0.k' over tp=2 ranks "
        r"\(tp does not divide its key/value heads\): its output reaches node ",
    ):
        graph_after(
            _KeyReadWhole(in_region), make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2
        )
