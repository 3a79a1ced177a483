"""The bucket pass: gradient-ready order, contiguous layout, buckets and padding."""

import math

import pytest
import torch
from expecttest import TestCase
from torch import nn

from fxmeg.ir.layouts import BucketSlot
from fxmeg.ir.program import buffer_layouts, chunks
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import make_model


def _laid_out(name="gpt", *, num_chunks=1, pp=1, dp=2, bucket_size=None, shard=False, n_layer=2):
    return graph_after(
        make_model(name, n_layer=n_layer),
        make_batch(2, seed=0),
        "buckets",
        num_chunks=num_chunks,
        pp=pp,
        dp=dp,
        bucket_size=bucket_size,
        distributed_optimizer=shard,
    )


def describe(parent) -> str:
    out = []
    for c, gm in enumerate(chunks(parent)):
        for lay in buffer_layouts(gm):
            out.append(f"chunk {c} {lay.dtype} buffer of {lay.numel}")
            for b in lay.buckets:
                slots = [s for s in lay.slots if s.bucket == b.index]
                out.append(f"  bucket {b.index} [{b.start}, {b.end}): "
                           + " ".join(f"{s.name}@{s.offset}" for s in slots))
    return "\n".join(out)


class Layouts(TestCase):
    def test_gpt_dp2_buckets_of_4000(self):
        self.assertExpectedInline(
            describe(_laid_out(bucket_size=4000)),
            """\
chunk 0 torch.float32 buffer of 29888
  bucket 0 [0, 4192): ln_f.bias@0 ln_f.weight@32 layers.1.mlp.proj.bias@64 layers.1.mlp.proj.weight@96
  bucket 1 [4192, 8416): layers.1.mlp.fc.bias@4192 layers.1.mlp.fc.weight@4320
  bucket 2 [8416, 12608): layers.1.ln_2.bias@8416 layers.1.ln_2.weight@8448 layers.1.attn.proj.bias@8480 layers.1.attn.proj.weight@8512 layers.1.attn.qkv.weight@9536
  bucket 3 [12608, 16800): layers.1.ln_1.bias@12608 layers.1.ln_1.weight@12640 layers.0.mlp.proj.bias@12672 layers.0.mlp.proj.weight@12704
  bucket 4 [16800, 21024): layers.0.mlp.fc.bias@16800 layers.0.mlp.fc.weight@16928
  bucket 5 [21024, 25216): layers.0.ln_2.bias@21024 layers.0.ln_2.weight@21056 layers.0.attn.proj.bias@21088 layers.0.attn.proj.weight@21120 layers.0.attn.qkv.weight@22144
  bucket 6 [25216, 29888): layers.0.ln_1.bias@25216 layers.0.ln_1.weight@25248 wpe.weight@25280 wte.weight@25792""",  # noqa: E501 (expected text, compared whole)
        )

    def test_gpt_dp2_sharded(self):
        self.assertExpectedInline(
            describe(_laid_out(bucket_size=4000, shard=True)),
            """\
chunk 0 torch.float32 buffer of 30592
  bucket 0 [0, 4352): ln_f.bias@0 ln_f.weight@64 layers.1.mlp.proj.bias@128 layers.1.mlp.proj.weight@192
  bucket 1 [4352, 8576): layers.1.mlp.fc.bias@4352 layers.1.mlp.fc.weight@4480
  bucket 2 [8576, 12928): layers.1.ln_2.bias@8576 layers.1.ln_2.weight@8640 layers.1.attn.proj.bias@8704 layers.1.attn.proj.weight@8768 layers.1.attn.qkv.weight@9792
  bucket 3 [12928, 17280): layers.1.ln_1.bias@12928 layers.1.ln_1.weight@12992 layers.0.mlp.proj.bias@13056 layers.0.mlp.proj.weight@13120
  bucket 4 [17280, 21504): layers.0.mlp.fc.bias@17280 layers.0.mlp.fc.weight@17408
  bucket 5 [21504, 25856): layers.0.ln_2.bias@21504 layers.0.ln_2.weight@21568 layers.0.attn.proj.bias@21632 layers.0.attn.proj.weight@21696 layers.0.attn.qkv.weight@22720
  bucket 6 [25856, 30592): layers.0.ln_1.bias@25856 layers.0.ln_1.weight@25920 wpe.weight@25984 wte.weight@26496""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama_pp2_one_bucket(self):
        self.assertExpectedInline(
            describe(_laid_out("llama", num_chunks=2, pp=2, n_layer=2)),
            """\
chunk 0 torch.float32 buffer of 13376
  bucket 0 [0, 13376): layers.0.mlp.down_proj.weight@0 layers.0.mlp.up_proj.weight@2048 layers.0.mlp.gate_proj.weight@4096 layers.0.post_attention_layernorm.weight@6144 layers.0.self_attn.o_proj.weight@6176 layers.0.self_attn.v_proj.weight@7200 layers.0.self_attn.k_proj.weight@7712 layers.0.self_attn.q_proj.weight@8224 layers.0.input_layernorm.weight@9248 embed_tokens.weight@9280
chunk 1 torch.float32 buffer of 13408
  bucket 0 [0, 13408): lm_head.weight@0 norm.weight@4096 layers.1.mlp.down_proj.weight@4128 layers.1.mlp.up_proj.weight@6176 layers.1.mlp.gate_proj.weight@8224 layers.1.post_attention_layernorm.weight@10272 layers.1.self_attn.o_proj.weight@10304 layers.1.self_attn.v_proj.weight@11328 layers.1.self_attn.k_proj.weight@11840 layers.1.self_attn.q_proj.weight@12352 layers.1.input_layernorm.weight@13376""",  # noqa: E501 (expected text, compared whole)
        )


def test_ready_order_is_first_use_latest_first():
    lay = buffer_layouts(chunks(_laid_out())[0])[0]
    names = [s.name for s in lay.slots]
    # the tied embedding is first read by the embedding lookup, so it is ready last
    assert names[-2:] == ["wpe.weight", "wte.weight"]
    assert names[:2] == ["ln_f.bias", "ln_f.weight"]
    assert names.index("layers.1.mlp.proj.weight") < names.index("layers.0.mlp.proj.weight")


@pytest.mark.parametrize("dp,shard", [(1, False), (2, False), (3, False), (2, True), (3, True)])
@pytest.mark.parametrize("bucket_size", [None, 1000, 5000])
def test_layout_invariants(dp, shard, bucket_size):
    parent = _laid_out("llama", num_chunks=2, pp=2, dp=dp, bucket_size=bucket_size, shard=shard)
    for gm in chunks(parent):
        (lay,) = buffer_layouts(gm)
        params = {n for n, p in gm.named_parameters()}
        assert {s.name for s in lay.slots} == params  # each parameter exactly once
        for s in lay.slots:
            b = lay.buckets[s.bucket]
            assert b.start <= s.offset and s.offset + s.numel <= b.end
            if shard:
                assert s.offset % 64 == 0
        spans = sorted((s.offset, s.offset + s.numel) for s in lay.slots)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        pad = math.lcm(dp, 128) if shard else dp
        for b in lay.buckets:
            assert (b.end - b.start) % pad == 0 and b.end % pad == 0
            used = sum(s.numel for s in lay.slots if s.bucket == b.index)
            if bucket_size is not None and b.index < len(lay.buckets) - 1:
                last = lay.slot(b.params[-1]).numel
                assert used >= bucket_size > used - last  # closed by its last parameter
        assert lay.buckets[0].start == 0 and lay.buckets[-1].end == lay.numel
        assert all(a.end == b.start for a, b in zip(lay.buckets, lay.buckets[1:]))
        if bucket_size is None:
            assert len(lay.buckets) == 1


def test_parameter_nodes_carry_their_bucket():
    parent = _laid_out(bucket_size=4000)
    (gm,) = chunks(parent)
    (lay,) = buffer_layouts(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in {s.name for s in lay.slots}:
            assert node.meta["fxmeg"]["bucket"] == BucketSlot(
                0, torch.float32, lay.slot(node.target).bucket
            )


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_cuts_buckets_at_blocks_under_full_recompute(zero):
    """Full recompute wraps every block in a region; its parameters still get a bucket per
    block (once one bucket held the whole chunk, which ZeRO-3 then gathered at once)."""
    def bucket_sizes(recompute: str) -> list[int]:
        parent = graph_after(make_model("gpt", n_layer=3), make_batch(2, seed=0), "buckets",
                             dp=2, zero=zero, recompute=recompute)
        (gm,) = chunks(parent)
        return sorted(b.end - b.start for lay in buffer_layouts(gm) for b in lay.buckets)

    assert bucket_sizes("full") == bucket_sizes("none")
    assert len(bucket_sizes("full")) >= 3


class _Shared(nn.Module):
    """One projection reused by blocks 0 and 2 (weight sharing across layers)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.shared = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for i, layer in enumerate(self.layers):
            x = x + layer(x) + (self.shared(x) if i in (0, 2) else 0)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_parameter_shared_by_chunks_of_one_rank_has_one_slot():
    ids = torch.randint(0, 16, (2, 4))
    parent = graph_after(_Shared(), (ids, ids), "buckets", num_chunks=4, pp=2, global_batch_size=4)
    slots = {
        c: {s.name for lay in buffer_layouts(gm) for s in lay.slots}
        for c, gm in enumerate(chunks(parent))
    }
    assert "shared.weight" in slots[0] and "shared.weight" not in slots[2]  # chunks 0, 2: rank 0
    c2 = chunks(parent)[2]
    node = next(n for n in c2.graph.nodes if n.op == "get_attr" and n.target == "shared.weight")
    assert node.meta["fxmeg"]["bucket"].chunk == 0  # points at its home chunk


def test_tied_weight_on_two_ranks_is_tagged_with_each_holders_bucket():
    """Each chunk's get_attr has its own metadata: tagging one copy must not retag the
    other (FX copies node meta shallowly)."""
    parent = _laid_out("gpt", num_chunks=2, pp=2, bucket_size=4000)
    for c, gm in enumerate(chunks(parent)):
        node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "wte.weight")
        (lay,) = buffer_layouts(gm)
        assert node.meta["fxmeg"]["bucket"] == BucketSlot(
            c, torch.float32, lay.slot("wte.weight").bucket
        )
