"""Dropout under tensor parallelism, on the graph (one process): which random nodes the
tensor-parallel pass routes through the per-tp-rank stream (``fxmeg.ir.ops.tp_rng_fork`` /
``tp_rng_join``, Megatron's model-parallel RNG tracker) and which keep the default stream."""

import torch
from torch import nn

from fxmeg.ir import ops
from tests.harness.helpers import graph_after, make_batch

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, fused: bool, p: float):
        super().__init__()
        self.fused, self.p = fused, p
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 4, 4).transpose(1, 2) for y in self.qkv(x).split(16, -1))
        if self.fused:
            out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        else:
            out = self.attn_drop((q @ k.transpose(-1, -2) / 2.0).softmax(-1)) @ v
        return x + self.resid_drop(self.o(out.transpose(1, 2).reshape(b, t, 16)))


class DropoutAttention(nn.Module):
    """One block: attention with dropout on its probabilities (split over heads at tp=2),
    an eager (matmul) or fused (SDPA, dropout_p) core, and dropout on the residual stream
    (replicated, or a sequence slice under sequence parallelism)."""

    def __init__(self, fused: bool = False, p: float = 0.5):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.layers = nn.ModuleList([Block(fused, p)])
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        x = self.layers[0](self.emb(ids))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _graph(model, **kw):
    ids, labels = make_batch(2, seed=0)
    return graph_after(model, (ids, labels), "tensor_parallel", tp=2, **kw)


def _streams(gm) -> dict[str, str]:
    """Each random node (by target) -> 'rank' (between fork and join) or 'default'."""
    out = {}
    for n in gm.graph.nodes:
        if n.target in (aten.dropout.default, aten.scaled_dot_product_attention.default):
            forked = any(a.target is ops.tp_rng_fork for a in n.all_input_nodes)
            joined = [u.target for u in n.users] == [ops.tp_rng_join]
            assert forked == joined, n.format_node()
            key = (
                "sdpa"
                if n.target == aten.scaled_dot_product_attention.default
                else n.meta["fxmeg"]["module"]
            )
            out[key] = "rank" if forked else "default"
    return out


def test_head_split_attention_dropout_is_per_rank_residual_dropout_is_not():
    torch.manual_seed(0)
    assert _streams(_graph(DropoutAttention())) == {
        "layers.0.attn_drop": "rank",
        "layers.0.resid_drop": "default",
    }


def test_sequence_parallel_residual_dropout_is_per_rank():
    torch.manual_seed(0)
    assert _streams(_graph(DropoutAttention(), sequence_parallel=True)) == {
        "layers.0.attn_drop": "rank", "layers.0.resid_drop": "rank"}


def test_fused_attention_with_dropout_is_per_rank():
    torch.manual_seed(0)
    assert _streams(_graph(DropoutAttention(fused=True))) == {
        "sdpa": "rank",
        "layers.0.resid_drop": "default",
    }


def test_no_tensor_parallelism_no_markers():
    torch.manual_seed(0)
    gm = graph_after(DropoutAttention(), make_batch(2, seed=0), "tensor_parallel", tp=1)
    assert not [n for n in gm.graph.nodes if n.target in ops.RNG_MARKERS]


def test_markers_are_identities_unbound():
    x = torch.randn(3)
    assert ops.tp_rng_fork(x, group="tp") is x and ops.tp_rng_join(x, group="tp") is x


def test_recompute_regions_hold_the_markers():
    """fork and join move into the recompute region with their random op, so the region's
    replay forks again from the replayed default stream."""
    torch.manual_seed(0)
    for granularity in ("full", "selective"):
        gm = graph_after(
            DropoutAttention(), make_batch(2, seed=0), "recompute", tp=2, recompute=granularity
        )
        regions = [m for name, m in gm.named_modules() if name.endswith("region")]
        inside = [n.target for m in regions for n in m.graph.nodes if n.target in ops.RNG_MARKERS]
        assert inside == [ops.tp_rng_fork, ops.tp_rng_join], granularity


def test_dropout_of_zero_draws_nothing_and_is_not_forked():
    torch.manual_seed(0)
    assert _streams(_graph(DropoutAttention(p=0.0))) == {
        "layers.0.attn_drop": "default", "layers.0.resid_drop": "default"}
