"""The tensor-parallel pass on one process: the graph of tp=2 (the same on every rank:
collectives name the symbolic group "tp" and rank-dependent work happens inside ops, so
no process group is needed), shard tags, the runtime's materialised shards, errors."""

import pytest
import torch
from expecttest import TestCase
from torch import nn

from fxmeg.errors import PassError
from fxmeg.runtime.context import _materialise
from fxmeg.runtime.groups import Groups, Topology
from fxmeg.transform import transform
from tests.helpers import graph_after, make_batch, make_model


def _tp(model, tp=2, **kw):
    ids, labels = make_batch(2, seed=0, vocab=model.cfg.vocab_size if hasattr(model, "cfg") else 128)
    return graph_after(model, (ids, labels), "tensor_parallel", tp=tp, **kw)


def _tags(gm) -> dict:
    return {n.target: n.meta["fxmeg"].get("tp") for n in gm.graph.nodes if n.op == "get_attr"}


class ShardedGraphs(TestCase):
    def test_gpt_tp2(self):
        self.assertExpectedInline(_tp(make_model("gpt", n_layer=1)).code.strip(), """\
def forward(self, input_ids, labels):
    wte_weight = self.wte.weight
    wpe_weight = self.wpe.weight
    layers_0_ln_1_weight = getattr(self.layers, "0").ln_1.weight
    layers_0_ln_1_bias = getattr(self.layers, "0").ln_1.bias
    layers_0_attn_qkv_weight = getattr(self.layers, "0").attn.qkv.weight
    layers_0_attn_proj_weight = getattr(self.layers, "0").attn.proj.weight
    layers_0_attn_proj_bias = getattr(self.layers, "0").attn.proj.bias
    layers_0_ln_2_weight = getattr(self.layers, "0").ln_2.weight
    layers_0_ln_2_bias = getattr(self.layers, "0").ln_2.bias
    layers_0_mlp_fc_weight = getattr(self.layers, "0").mlp.fc.weight
    layers_0_mlp_fc_bias = getattr(self.layers, "0").mlp.fc.bias
    layers_0_mlp_proj_weight = getattr(self.layers, "0").mlp.proj.weight
    layers_0_mlp_proj_bias = getattr(self.layers, "0").mlp.proj.bias
    ln_f_weight = self.ln_f.weight
    ln_f_bias = self.ln_f.bias
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    vocab_shard_ids_default = torch.ops.fxmeg.vocab_shard_ids.default(input_ids, 64, 'tp');  input_ids = None
    getitem_3 = vocab_shard_ids_default[0]
    getitem_4 = vocab_shard_ids_default[1];  vocab_shard_ids_default = None
    embedding = torch.ops.aten.embedding.default(wte_weight, getitem_3);  getitem_3 = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(getitem_4, -1);  getitem_4 = None
    masked_fill_scalar = torch.ops.aten.masked_fill.Scalar(embedding, unsqueeze_default, 0.0);  embedding = unsqueeze_default = None
    tp_reduce_default = torch.ops.fxmeg.tp_reduce.default(masked_fill_scalar, 'tp');  masked_fill_scalar = None
    embedding_1 = torch.ops.aten.embedding.default(wpe_weight, arange);  wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(tp_reduce_default, embedding_1);  tp_reduce_default = embedding_1 = None
    layer_norm = torch.ops.aten.layer_norm.default(add, [32], layers_0_ln_1_weight, layers_0_ln_1_bias, 1e-05, False);  layers_0_ln_1_weight = layers_0_ln_1_bias = None
    tp_copy_default = torch.ops.fxmeg.tp_copy.default(layer_norm, 'tp');  layer_norm = None
    linear = torch.ops.aten.linear.default(tp_copy_default, layers_0_attn_qkv_weight);  tp_copy_default = layers_0_attn_qkv_weight = None
    split = torch.ops.aten.split.Tensor(linear, 16, 2);  linear = None
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2];  split = None
    view = torch.ops.aten.view.default(getitem, [2, 16, 2, 8]);  getitem = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.view.default(getitem_1, [2, 16, 2, 8]);  getitem_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.view.default(getitem_2, [2, 16, 2, 8]);  getitem_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 16]);  transpose_3 = None
    linear_1 = torch.ops.aten.linear.default(reshape, layers_0_attn_proj_weight);  reshape = layers_0_attn_proj_weight = None
    tp_reduce_default_1 = torch.ops.fxmeg.tp_reduce.default(linear_1, 'tp');  linear_1 = None
    add_tensor = torch.ops.aten.add.Tensor(tp_reduce_default_1, layers_0_attn_proj_bias);  tp_reduce_default_1 = layers_0_attn_proj_bias = None
    add_1 = torch.ops.aten.add.Tensor(add, add_tensor);  add = add_tensor = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [32], layers_0_ln_2_weight, layers_0_ln_2_bias, 1e-05, False);  layers_0_ln_2_weight = layers_0_ln_2_bias = None
    tp_copy_default_1 = torch.ops.fxmeg.tp_copy.default(layer_norm_1, 'tp');  layer_norm_1 = None
    linear_2 = torch.ops.aten.linear.default(tp_copy_default_1, layers_0_mlp_fc_weight, layers_0_mlp_fc_bias);  tp_copy_default_1 = layers_0_mlp_fc_weight = layers_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_2);  linear_2 = None
    linear_3 = torch.ops.aten.linear.default(gelu, layers_0_mlp_proj_weight);  gelu = layers_0_mlp_proj_weight = None
    tp_reduce_default_2 = torch.ops.fxmeg.tp_reduce.default(linear_3, 'tp');  linear_3 = None
    add_tensor_1 = torch.ops.aten.add.Tensor(tp_reduce_default_2, layers_0_mlp_proj_bias);  tp_reduce_default_2 = layers_0_mlp_proj_bias = None
    add_2 = torch.ops.aten.add.Tensor(add_1, add_tensor_1);  add_1 = add_tensor_1 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [32], ln_f_weight, ln_f_bias, 1e-05, False);  add_2 = ln_f_weight = ln_f_bias = None
    tp_copy_default_2 = torch.ops.fxmeg.tp_copy.default(layer_norm_2, 'tp');  layer_norm_2 = None
    linear_4 = torch.ops.aten.linear.default(tp_copy_default_2, wte_weight);  tp_copy_default_2 = wte_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_4, 0, 1);  linear_4 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    vocab_parallel_cross_entropy_default = torch.ops.fxmeg.vocab_parallel_cross_entropy.default(flatten, flatten_1, -100, 'tp');  flatten = None
    getitem_5 = vocab_parallel_cross_entropy_default[0];  vocab_parallel_cross_entropy_default = None
    sum_default = torch.ops.aten.sum.default(getitem_5);  getitem_5 = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (sum_default, num_tokens)""")

    def test_llama_tp2(self):
        self.assertExpectedInline(_tp(make_model("llama", n_layer=1)).code.strip(), """\
def forward(self, input_ids, labels):
    embed_tokens_weight = self.embed_tokens.weight
    layers_0_input_layernorm_weight = getattr(self.layers, "0").input_layernorm.weight
    layers_0_self_attn_q_proj_weight = getattr(self.layers, "0").self_attn.q_proj.weight
    layers_0_self_attn_k_proj_weight = getattr(self.layers, "0").self_attn.k_proj.weight
    layers_0_self_attn_v_proj_weight = getattr(self.layers, "0").self_attn.v_proj.weight
    layers_0_self_attn_o_proj_weight = getattr(self.layers, "0").self_attn.o_proj.weight
    layers_0_post_attention_layernorm_weight = getattr(self.layers, "0").post_attention_layernorm.weight
    layers_0_mlp_gate_proj_weight = getattr(self.layers, "0").mlp.gate_proj.weight
    layers_0_mlp_up_proj_weight = getattr(self.layers, "0").mlp.up_proj.weight
    layers_0_mlp_down_proj_weight = getattr(self.layers, "0").mlp.down_proj.weight
    norm_weight = self.norm.weight
    lm_head_weight = self.lm_head.weight
    rope_cos = self.rope_cos
    rope_sin = self.rope_sin
    slice_1 = torch.ops.aten.slice.Tensor(rope_cos, 0, 0, 16);  rope_cos = None
    slice_2 = torch.ops.aten.slice.Tensor(rope_sin, 0, 0, 16);  rope_sin = None
    vocab_shard_ids_default = torch.ops.fxmeg.vocab_shard_ids.default(input_ids, 64, 'tp');  input_ids = None
    getitem_4 = vocab_shard_ids_default[0]
    getitem_5 = vocab_shard_ids_default[1];  vocab_shard_ids_default = None
    embedding = torch.ops.aten.embedding.default(embed_tokens_weight, getitem_4);  embed_tokens_weight = getitem_4 = None
    unsqueeze_default = torch.ops.aten.unsqueeze.default(getitem_5, -1);  getitem_5 = None
    masked_fill_scalar = torch.ops.aten.masked_fill.Scalar(embedding, unsqueeze_default, 0.0);  embedding = unsqueeze_default = None
    tp_reduce_default = torch.ops.fxmeg.tp_reduce.default(masked_fill_scalar, 'tp');  masked_fill_scalar = None
    to = torch.ops.aten.to.dtype(tp_reduce_default, torch.float32);  tp_reduce_default = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(to, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add = torch.ops.aten.add.Tensor(mean, 1e-05);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add);  add = None
    mul = torch.ops.aten.mul.Tensor(to, rsqrt);  rsqrt = None
    to_1 = torch.ops.aten.to.dtype(mul, torch.float32);  mul = None
    mul_1 = torch.ops.aten.mul.Tensor(layers_0_input_layernorm_weight, to_1);  layers_0_input_layernorm_weight = to_1 = None
    tp_copy_default = torch.ops.fxmeg.tp_copy.default(mul_1, 'tp');  mul_1 = None
    linear = torch.ops.aten.linear.default(tp_copy_default, layers_0_self_attn_q_proj_weight);  layers_0_self_attn_q_proj_weight = None
    view = torch.ops.aten.view.default(linear, [2, 16, 2, 8]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(tp_copy_default, layers_0_self_attn_k_proj_weight);  layers_0_self_attn_k_proj_weight = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 1, 8]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    linear_2 = torch.ops.aten.linear.default(tp_copy_default, layers_0_self_attn_v_proj_weight);  tp_copy_default = layers_0_self_attn_v_proj_weight = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 1, 8]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    mul_2 = torch.ops.aten.mul.Tensor(transpose, slice_1)
    chunk = torch.ops.aten.chunk.default(transpose, 2, -1);  transpose = None
    getitem = chunk[0]
    getitem_1 = chunk[1];  chunk = None
    neg = torch.ops.aten.neg.default(getitem_1);  getitem_1 = None
    cat = torch.ops.aten.cat.default([neg, getitem], -1);  neg = getitem = None
    mul_3 = torch.ops.aten.mul.Tensor(cat, slice_2);  cat = None
    add_1 = torch.ops.aten.add.Tensor(mul_2, mul_3);  mul_2 = mul_3 = None
    mul_4 = torch.ops.aten.mul.Tensor(transpose_1, slice_1);  slice_1 = None
    chunk_1 = torch.ops.aten.chunk.default(transpose_1, 2, -1);  transpose_1 = None
    getitem_2 = chunk_1[0]
    getitem_3 = chunk_1[1];  chunk_1 = None
    neg_1 = torch.ops.aten.neg.default(getitem_3);  getitem_3 = None
    cat_1 = torch.ops.aten.cat.default([neg_1, getitem_2], -1);  neg_1 = getitem_2 = None
    mul_5 = torch.ops.aten.mul.Tensor(cat_1, slice_2);  cat_1 = slice_2 = None
    add_2 = torch.ops.aten.add.Tensor(mul_4, mul_5);  mul_4 = mul_5 = None
    repeat_interleave = torch.ops.aten.repeat_interleave.self_int(add_2, 2, 1);  add_2 = None
    repeat_interleave_1 = torch.ops.aten.repeat_interleave.self_int(transpose_2, 2, 1);  transpose_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_1, repeat_interleave, repeat_interleave_1, None, 0.0, True);  add_1 = repeat_interleave = repeat_interleave_1 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 16]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, layers_0_self_attn_o_proj_weight);  reshape = layers_0_self_attn_o_proj_weight = None
    tp_reduce_default_1 = torch.ops.fxmeg.tp_reduce.default(linear_3, 'tp');  linear_3 = None
    add_3 = torch.ops.aten.add.Tensor(to, tp_reduce_default_1);  to = tp_reduce_default_1 = None
    to_2 = torch.ops.aten.to.dtype(add_3, torch.float32);  add_3 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_2, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_4 = torch.ops.aten.add.Tensor(mean_1, 1e-05);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_4);  add_4 = None
    mul_6 = torch.ops.aten.mul.Tensor(to_2, rsqrt_1);  rsqrt_1 = None
    to_3 = torch.ops.aten.to.dtype(mul_6, torch.float32);  mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(layers_0_post_attention_layernorm_weight, to_3);  layers_0_post_attention_layernorm_weight = to_3 = None
    tp_copy_default_1 = torch.ops.fxmeg.tp_copy.default(mul_7, 'tp');  mul_7 = None
    linear_4 = torch.ops.aten.linear.default(tp_copy_default_1, layers_0_mlp_gate_proj_weight);  layers_0_mlp_gate_proj_weight = None
    silu = torch.ops.aten.silu.default(linear_4);  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(tp_copy_default_1, layers_0_mlp_up_proj_weight);  tp_copy_default_1 = layers_0_mlp_up_proj_weight = None
    mul_8 = torch.ops.aten.mul.Tensor(silu, linear_5);  silu = linear_5 = None
    linear_6 = torch.ops.aten.linear.default(mul_8, layers_0_mlp_down_proj_weight);  mul_8 = layers_0_mlp_down_proj_weight = None
    tp_reduce_default_2 = torch.ops.fxmeg.tp_reduce.default(linear_6, 'tp');  linear_6 = None
    add_5 = torch.ops.aten.add.Tensor(to_2, tp_reduce_default_2);  to_2 = tp_reduce_default_2 = None
    to_4 = torch.ops.aten.to.dtype(add_5, torch.float32);  add_5 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_4, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_6 = torch.ops.aten.add.Tensor(mean_2, 1e-05);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_6);  add_6 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_4, rsqrt_2);  to_4 = rsqrt_2 = None
    to_5 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    mul_10 = torch.ops.aten.mul.Tensor(norm_weight, to_5);  norm_weight = to_5 = None
    tp_copy_default_2 = torch.ops.fxmeg.tp_copy.default(mul_10, 'tp');  mul_10 = None
    linear_7 = torch.ops.aten.linear.default(tp_copy_default_2, lm_head_weight);  tp_copy_default_2 = lm_head_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_7, 0, 1);  linear_7 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    vocab_parallel_cross_entropy_default = torch.ops.fxmeg.vocab_parallel_cross_entropy.default(flatten, flatten_1, -100, 'tp');  flatten = None
    getitem_6 = vocab_parallel_cross_entropy_default[0];  vocab_parallel_cross_entropy_default = None
    sum_default = torch.ops.aten.sum.default(getitem_6);  getitem_6 = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (sum_default, num_tokens)""")


@pytest.mark.parametrize("rank", [0, 1])
def test_runtime_materialises_this_ranks_shards(rank):
    """The pass only tags; the runtime's bound chunk holds rank's shard, and the user's
    model keeps its full parameters."""
    full = make_model("gpt", n_layer=1)
    ref = {k: v.clone() for k, v in full.state_dict().items()}
    program = transform(full, make_batch(2, seed=0), tp=2)
    gm = _materialise(program, Groups(Topology(tp=2, pp=1, dp=1), rank))[0][0]
    assert all(torch.equal(v, ref[k]) for k, v in full.state_dict().items())
    qkv = gm.get_parameter("layers.0.attn.qkv.weight")
    assert qkv.shape == (48, 32)  # (3 x 32 rows) / 2, block by block: q, k and v heads
    w = ref["layers.0.attn.qkv.weight"]
    want = torch.cat([w[b * 32 + rank * 16 : b * 32 + (rank + 1) * 16] for b in range(3)])
    assert torch.equal(qkv, want)
    assert torch.equal(gm.get_parameter("wte.weight"), ref["wte.weight"][rank * 64 : (rank + 1) * 64])
    proj = gm.get_parameter("layers.0.mlp.proj.weight")
    assert torch.equal(proj, ref["layers.0.mlp.proj.weight"][:, rank * 64 : (rank + 1) * 64])
    tags = _tags(program.chunks[0])
    assert tags["layers.0.attn.qkv.weight"] == ("shard", 0, (32, 32, 32))
    assert tags["layers.0.mlp.proj.weight"] == ("shard", 1, (128,))
    assert tags["layers.0.mlp.proj.bias"] == ("replicate", False)  # added after the all-reduce
    assert tags["wpe.weight"] == ("replicate", False)


def test_sequence_parallel_marks_norm_weights_for_tp_reduction():
    gm = _tp(make_model("llama", n_layer=1), sequence_parallel=True)
    tags = _tags(gm)
    assert tags["norm.weight"] == ("replicate", True)
    assert tags["layers.0.input_layernorm.weight"] == ("replicate", True)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.fxmeg.sp_gather.default) == 3  # attention, MLP, head
    assert ops.count(torch.ops.fxmeg.sp_scatter.default) == 3  # embedding, attention, MLP
    assert torch.ops.fxmeg.tp_copy.default not in ops


def test_plan_overrides_the_automatic_choice():
    gm = _tp(make_model("llama", n_layer=1), tp_plan={"layers.*.mlp.*": "replicate"})
    tags = _tags(gm)
    assert tags["layers.0.mlp.up_proj.weight"] == ("replicate", False)
    assert tags["layers.0.self_attn.q_proj.weight"][0] == "shard"


def test_tp_not_dividing_heads():
    model = make_model("gpt", n_layer=1, n_embd=48, n_head=4, vocab_size=126)
    with pytest.raises(PassError) as err:
        _tp(model, tp=3)
    msg = str(err.value)
    assert "tp=3 does not divide 4, the number of heads" in msg
    assert "module 'layers.0.attn'" in msg and "choose tp in [1, 2, 4]" in msg


def test_tp_not_dividing_kv_heads():
    model = make_model("llama", n_layer=1, n_embd=64, n_head=4, n_kv_head=2)
    with pytest.raises(PassError) as err:
        _tp(model, tp=4)
    msg = str(err.value)
    assert "tp=4 does not divide 2, the number of heads" in msg
    assert "module 'layers.0.self_attn'" in msg and "choose tp in [1, 2]" in msg


def test_tp_not_dividing_the_vocabulary_offers_padding():
    model = make_model("gpt", n_layer=1, vocab_size=126)
    ids, labels = make_batch(2, seed=0, vocab=126)
    with pytest.raises(PassError, match=r"tp=4 does not divide the 126 vocabulary rows.*pad the vocabulary to a multiple of 4 \(e.g. 128\)"):
        graph_after(model, (ids, labels), "tensor_parallel", tp=4)


class _NormedMLP(nn.Module):
    """An MLP that normalises its hidden layer: the norm spans the split features."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 16)
        self.layers = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})])
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        x = self.emb(ids)
        h = nn.functional.layer_norm(self.layers[0]["up"](x), (32,))
        x = x + self.layers[0]["down"](h)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_unshardable_pattern_names_node_module_and_fix():
    with pytest.raises(PassError) as err:
        _tp(_NormedMLP())
    msg = str(err.value)
    assert "cannot split node 'layer_norm'" in msg and "normalizes over dim 2" in msg
    assert "split along dim 2 by module 'layers.0.up'" in msg
    assert "tp_plan={'layers.*.up': 'replicate'}" in msg
