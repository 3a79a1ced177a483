"""The tensor-parallel pass on attention layouts split by heads that issue 28 found
refused: heads merged into the batch of ``bmm`` / ``baddbmm`` (fairseq, XGLM), a fused
q / k / v viewed as (3, heads, head_dim) and unbound (llama2.c's rotary unbind too, in
the zoo), ``aten.index.Tensor``, softmax / amax / amin over the split dim (a max and a sum
all-reduced), and one fused projection kept whole by ``tp_plan``. One process, tp=2: the
tags and the rewritten graph; tests/parity/test_tensor_parallel.py trains each model at
tp=2 against one device (its 2-rank spawn)."""

import pytest
import torch
from torch import nn

from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.layouts import LOCAL, Replicate, Shard  # noqa: F401
from tests.harness.helpers import graph_after, make_batch

aten, fx_ops = torch.ops.aten, torch.ops.fxmeg


class _Heads(nn.Module):
    """One block of 4 heads of 4 over 16 features, written in one of several layouts
    (``kind``), and an MLP after it; q, k, v from one fused linear or three."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        fused = kind in ("unbind", "replicate-qkv")
        proj = {"qkv": nn.Linear(16, 48)} if fused else {n: nn.Linear(16, 16) for n in "qkv"}
        self.emb, self.head = nn.Embedding(128, 16), nn.Linear(16, 128)
        self.layers = nn.ModuleList([nn.ModuleDict(
            proj | {"o": nn.Linear(16, 16), "up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})])
        self.register_buffer("order", torch.arange(15, -1, -1))

    def attention(self, x):
        b, t, _ = x.shape
        L = self.layers[0]
        if self.kind in ("unbind", "replicate-qkv"):  # (b, t, 3, heads, head_dim), unbound
            q, k, v = (y.transpose(1, 2) for y in L["qkv"](x).view(b, t, 3, 4, 4).unbind(2))
        else:
            q, k, v = (L[n](x).view(b, t, 4, 4).transpose(1, 2) for n in "qkv")
        # fairseq: heads merged into the batch of bmm
        if self.kind in ("merged", "baddbmm", "baddbmm-beta0"):
            q, k, v = (y.reshape(b * 4, t, 4) for y in (q, k, v))
            causal = torch.triu(torch.full((t, t), -1e4), 1)
            if self.kind == "baddbmm":
                s = torch.baddbmm(
                    causal.expand(b * 4, t, t), q, k.transpose(1, 2), beta=1.0, alpha=0.5
                )
            elif self.kind == "baddbmm-beta0":  # the input ignored (gpt_bigcode passes torch.empty)
                s = (
                    torch.baddbmm(
                        torch.full((b * 4, t, t), float("nan")), q, k.transpose(1, 2), beta=0.0
                    )
                    + causal
                )
            else:
                s = (torch.bmm(q, k.transpose(1, 2)).view(b, 4, t, t) * 0.5 + causal).view(
                    b * 4, t, t
                )
            return torch.bmm(s.softmax(-1), v).view(b, 4, t, 4).transpose(1, 2).reshape(b, t, 16)
        if self.kind == "safe-softmax":  # SDPA's math-path softmax over the (split) heads
            return torch.ops.aten._safe_softmax(q.transpose(1, 2), 2).reshape(b, t, 16)
        if self.kind == "across-heads":  # softmax / amax / amin over the (split) heads
            h = q.transpose(1, 2)  # (b, t, heads, head_dim)
            h = (
                h.softmax(2)
                + h.log_softmax(2) * 0.1
                + (h - h.amax(2, keepdim=True))
                - h.amin(2, keepdim=True)
            )
            return h.reshape(b, t, 16)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.kind == "index":  # aten.index.Tensor along the sequence of head-split values
            out = out[:, :, self.order]
        return out.transpose(1, 2).reshape(b, t, 16)

    def forward(self, ids, labels):
        x = self.emb(ids)
        L = self.layers[0]
        x = x + L["o"](self.attention(x))
        x = x + L["down"](L["up"](x).relu())
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


KINDS = ("merged", "baddbmm", "unbind", "index", "across-heads", "replicate-qkv")
PLANS = {"replicate-qkv": {"layers.*.qkv": "replicate"}}


def _tp(kind: str):
    torch.manual_seed(0)
    return graph_after(
        _Heads(kind), make_batch(2, seed=0), "tensor_parallel", tp=2, tp_plan=PLANS.get(kind, {})
    )


def _tags(gm) -> dict:
    return {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}


def _local(gm, target) -> list:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.target == target]


@pytest.mark.parametrize("kind", ["merged", "baddbmm"])
def test_heads_merged_into_the_batch_stay_split(kind):
    """(b, heads, t, d) -> (b * heads, t, d) holds this rank's heads of every batch entry
    (2 blocks of 4 heads): the bmm runs on 2 x 2 local heads, the causal mask added by
    baddbmm is cut to them as blocks, and the view back puts the split on the heads."""
    gm = _tp(kind)
    tags = _tags(gm)
    assert all(tags[f"layers.0.{n}.weight"] == Shard(0, (16,)) for n in "qkv")
    assert tags["layers.0.o.weight"] == Shard(1, (16,))
    assert _local(gm, aten.bmm.default) == [(4, 16, 16), (4, 16, 4)]
    assert _local(gm, aten.reshape.default)[:3] == [(4, 16, 4)] * 3
    if kind == "baddbmm":
        assert aten.baddbmm.default not in [n.target for n in gm.graph.nodes]
        cut = next(n for n in gm.graph.nodes if n.target == fx_ops.tp_slice.default)
        # per batch entry
        assert tuple(cut.args[0].meta["val"].shape) == (2, 4, 16, 16) and cut.args[1] == 1


def test_fused_qkv_viewed_as_three_blocks_of_heads_and_unbound():
    """(b, t, 3, heads, head_dim) then unbind(2): the weight splits by head inside each of
    q, k, v (llama2.c unbinds the rotary halves of its head-split q and k the same way)."""
    gm = _tp("unbind")
    assert _tags(gm)["layers.0.qkv.weight"] == Shard(0, (16, 16, 16))
    assert _local(gm, aten.view.default)[0] == (2, 16, 3, 2, 4)
    assert _local(gm, aten.scaled_dot_product_attention.default) == [(2, 2, 16, 4)]


def test_einops_fused_blocks_in_one_rearrange_split_by_head():
    """einops' rearrange('b n (three h d) -> three b h n d') on a fused projection."""
    pytest.importorskip("einops")
    from tests.passes.test_tensor_parallel import _EinopsAttention

    gm = transform(_EinopsAttention("fused"), make_batch(2, seed=0), tp=2).chunks[0]
    assert _tags(gm)["layers.0.to_qkv.weight"] == Shard(0, (16, 16, 16))
    assert _local(gm, aten.reshape.default)[0] == (2, 16, 3, 2, 4)


def test_advanced_index_along_another_dim_keeps_the_split():
    gm = _tp("index")
    assert _local(gm, aten.index.Tensor) == [(2, 2, 16, 4)]


def test_softmax_and_extremes_over_the_split_dim_are_all_reduced():
    """Over the heads: a max all-reduced (fxmeg::tp_max) under the softmax, log-softmax,
    amax and amin, and the sums of exponentials all-reduced; the MLP stays split."""
    gm = _tp("across-heads")
    ops = [n.target for n in gm.graph.nodes]
    assert ops.count(fx_ops.tp_max.default) == 4  # softmax, log_softmax, amax, amin
    assert aten.softmax.int not in ops and aten.log_softmax.int not in ops
    assert _tags(gm)["layers.0.q.weight"] == Shard(0, (16,))
    stats = [n for n in gm.graph.nodes if n.target == fx_ops.tp_reduce.default
             and n.args[0].target == fx_ops.tp_copy.default]
    # read with split values
    assert [s.args[0].args[0].target for s in stats] == [aten.sum.dim_IntList] * 2
    maxima = [n for n in gm.graph.nodes if n.target == fx_ops.tp_max.default]
    assert [n.args[0].target for n in maxima] == [aten.amax.default] * 3 + [aten.neg.default]


def test_replicating_one_fused_projection_keeps_its_output_projection_whole():
    """tp_plan replicates qkv: the attention output is replicated, so o (its output added
    to the residual stream it reads) stays whole too, instead of splitting the stream up
    to the vocabulary-parallel head; the MLP still splits."""
    tags = _tags(_tp("replicate-qkv"))
    assert tags["layers.0.qkv.weight"] == Replicate(False) and tags[
        "layers.0.o.weight"
    ] == Replicate(False)
    assert tags["layers.0.up.weight"] == Shard(0, (32,)) and tags["layers.0.down.weight"] == Shard(
        1, (32,)
    )
    assert tags["head.weight"] == Shard(0, (128,))


def test_baddbmm_with_beta_zero_reads_no_input():
    """torch ignores baddbmm's input at beta=0 (NaN in it does not reach the output):
    the rewritten product must not add it either."""
    graph = _tp("baddbmm-beta0").graph
    nan = [n for n in graph.nodes if n.target == aten.full.default and n.args[1] != n.args[1]]
    # dead code is dropped: the NaN input is gone or read by nothing
    assert all(not n.users for n in nan), [list(n.users) for n in nan]


def test_a_sequence_parallel_split_is_not_merged_into_the_batch():
    """(batch, seq / tp, hidden) -> (batch * seq, hidden) would interleave every rank's
    tokens of each sequence: sequence-parallel all-gathers act on one dim, so it is refused
    (GPT-2's Conv1D under sp: test_zoo_axes' known gap), while heads merge (blocks)."""
    from fxmeg.passes.tp.placement import reshape_shard

    seq = reshape_shard(Shard(1, (16,), seq=True), (2, 16, 64), (32, 64), 2)
    assert (
        seq
        == "it merges dim 1 (size 16, split over tp ranks) into a larger dim with dims outside it"
    )
    assert reshape_shard(Shard(1, (4,)), (2, 4, 16, 8), (8, 16, 8), 2) == Shard(0, (4, 4))


def test_a_safe_softmax_over_the_split_dim_gives_zero_for_a_row_masked_everywhere():
    """aten._safe_softmax is 0 (not NaN) where the whole row is -inf: split over tp, a row
    is whole-masked when the all-reduced maximum is -inf, and the rewrite zeroes it there."""
    gm = _tp("safe-softmax")
    ops = [n.target for n in gm.graph.nodes]
    assert aten._safe_softmax.default not in ops and fx_ops.tp_max.default in ops
    wheres = [n for n in gm.graph.nodes if n.target == aten.where.ScalarSelf]
    (cond,) = {n.args[0] for n in wheres}
    assert cond.target == aten.eq.Scalar and cond.args[0].target == fx_ops.tp_max.default
    assert cond.args[1] == float("-inf") and [n.args[1] for n in wheres] == [0.0, 0.0]
    # the shifted scores zeroed there too (their exp finite: no NaN in backward), and the result
    assert (
        wheres[0].args[2].target == aten.sub.Tensor and wheres[1].args[2].target == aten.div.Tensor
    )
