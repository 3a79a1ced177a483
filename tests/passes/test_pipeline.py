"""The pipeline pass: chunk graphs with explicit recv / send / deallocate nodes."""

import pytest
import torch
from expecttest import TestCase

from fxmeg.program import chunk_spec, chunks
from tests.helpers import graph_after, make_batch, make_model


def _pipelined(name, *, n_layer, num_chunks):
    model = make_model(name, n_layer=n_layer)
    return model, graph_after(model, make_batch(2, seed=0), "pipeline", num_chunks=num_chunks)


def _code(parent, *, boundaries_only: bool = False) -> str:
    """Every chunk's code; with boundaries_only, just its signature, its recv / send /
    deallocate nodes and its return."""
    out = []
    for c, gm in enumerate(chunks(parent)):
        lines = gm.code.strip().splitlines()
        if boundaries_only:
            lines = [ln for ln in lines if ln.startswith("def ") or "fxmeg_ops_" in ln or "return" in ln]
        out.append(f"# chunk {c}\n" + "\n".join(lines))
    return "\n\n".join(out)


class ChunkGraphs(TestCase):
    def test_gpt_pp2(self):
        self.assertExpectedInline(_code(_pipelined("gpt", n_layer=2, num_chunks=2)[1]), """\
# chunk 0
def forward(self, input_ids):
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    wte_weight = self.wte.weight
    embedding = torch.ops.aten.embedding.default(wte_weight, input_ids);  wte_weight = input_ids = None
    wpe_weight = self.wpe.weight
    embedding_1 = torch.ops.aten.embedding.default(wpe_weight, arange);  wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    layers_0_ln_1_weight = getattr(self.layers, "0").ln_1.weight
    layers_0_ln_1_bias = getattr(self.layers, "0").ln_1.bias
    layer_norm = torch.ops.aten.layer_norm.default(add, [32], layers_0_ln_1_weight, layers_0_ln_1_bias, 1e-05, False);  layers_0_ln_1_weight = layers_0_ln_1_bias = None
    layers_0_attn_qkv_weight = getattr(self.layers, "0").attn.qkv.weight
    linear = torch.ops.aten.linear.default(layer_norm, layers_0_attn_qkv_weight);  layer_norm = layers_0_attn_qkv_weight = None
    split = torch.ops.aten.split.Tensor(linear, 32, 2);  linear = None
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2];  split = None
    view = torch.ops.aten.view.default(getitem, [2, 16, 4, 8]);  getitem = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    view_1 = torch.ops.aten.view.default(getitem_1, [2, 16, 4, 8]);  getitem_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    view_2 = torch.ops.aten.view.default(getitem_2, [2, 16, 4, 8]);  getitem_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True);  transpose = transpose_1 = transpose_2 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
    layers_0_attn_proj_weight = getattr(self.layers, "0").attn.proj.weight
    layers_0_attn_proj_bias = getattr(self.layers, "0").attn.proj.bias
    linear_1 = torch.ops.aten.linear.default(reshape, layers_0_attn_proj_weight, layers_0_attn_proj_bias);  reshape = layers_0_attn_proj_weight = layers_0_attn_proj_bias = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_1);  add = linear_1 = None
    layers_0_ln_2_weight = getattr(self.layers, "0").ln_2.weight
    layers_0_ln_2_bias = getattr(self.layers, "0").ln_2.bias
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [32], layers_0_ln_2_weight, layers_0_ln_2_bias, 1e-05, False);  layers_0_ln_2_weight = layers_0_ln_2_bias = None
    layers_0_mlp_fc_weight = getattr(self.layers, "0").mlp.fc.weight
    layers_0_mlp_fc_bias = getattr(self.layers, "0").mlp.fc.bias
    linear_2 = torch.ops.aten.linear.default(layer_norm_1, layers_0_mlp_fc_weight, layers_0_mlp_fc_bias);  layer_norm_1 = layers_0_mlp_fc_weight = layers_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_2);  linear_2 = None
    layers_0_mlp_proj_weight = getattr(self.layers, "0").mlp.proj.weight
    layers_0_mlp_proj_bias = getattr(self.layers, "0").mlp.proj.bias
    linear_3 = torch.ops.aten.linear.default(gelu, layers_0_mlp_proj_weight, layers_0_mlp_proj_bias);  gelu = layers_0_mlp_proj_weight = layers_0_mlp_proj_bias = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_3);  add_1 = linear_3 = None
    send_add_2 = fxmeg_ops_send(add_2, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    deallocate_add_2 = fxmeg_ops_deallocate(send_add_2);  deallocate_add_2 = None
    return (send_add_2,)

# chunk 1
def forward(self, labels, add_2):
    recv_add_2 = fxmeg_ops_recv(add_2, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    layers_1_ln_1_weight = getattr(self.layers, "1").ln_1.weight
    layers_1_ln_1_bias = getattr(self.layers, "1").ln_1.bias
    layer_norm_2 = torch.ops.aten.layer_norm.default(recv_add_2, [32], layers_1_ln_1_weight, layers_1_ln_1_bias, 1e-05, False);  layers_1_ln_1_weight = layers_1_ln_1_bias = None
    layers_1_attn_qkv_weight = getattr(self.layers, "1").attn.qkv.weight
    linear_4 = torch.ops.aten.linear.default(layer_norm_2, layers_1_attn_qkv_weight);  layer_norm_2 = layers_1_attn_qkv_weight = None
    split_1 = torch.ops.aten.split.Tensor(linear_4, 32, 2);  linear_4 = None
    getitem_3 = split_1[0]
    getitem_4 = split_1[1]
    getitem_5 = split_1[2];  split_1 = None
    view_3 = torch.ops.aten.view.default(getitem_3, [2, 16, 4, 8]);  getitem_3 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    view_4 = torch.ops.aten.view.default(getitem_4, [2, 16, 4, 8]);  getitem_4 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    view_5 = torch.ops.aten.view.default(getitem_5, [2, 16, 4, 8]);  getitem_5 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_4, transpose_5, transpose_6, None, 0.0, True);  transpose_4 = transpose_5 = transpose_6 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [2, 16, 32]);  transpose_7 = None
    layers_1_attn_proj_weight = getattr(self.layers, "1").attn.proj.weight
    layers_1_attn_proj_bias = getattr(self.layers, "1").attn.proj.bias
    linear_5 = torch.ops.aten.linear.default(reshape_1, layers_1_attn_proj_weight, layers_1_attn_proj_bias);  reshape_1 = layers_1_attn_proj_weight = layers_1_attn_proj_bias = None
    add_3 = torch.ops.aten.add.Tensor(recv_add_2, linear_5);  recv_add_2 = linear_5 = None
    layers_1_ln_2_weight = getattr(self.layers, "1").ln_2.weight
    layers_1_ln_2_bias = getattr(self.layers, "1").ln_2.bias
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_3, [32], layers_1_ln_2_weight, layers_1_ln_2_bias, 1e-05, False);  layers_1_ln_2_weight = layers_1_ln_2_bias = None
    layers_1_mlp_fc_weight = getattr(self.layers, "1").mlp.fc.weight
    layers_1_mlp_fc_bias = getattr(self.layers, "1").mlp.fc.bias
    linear_6 = torch.ops.aten.linear.default(layer_norm_3, layers_1_mlp_fc_weight, layers_1_mlp_fc_bias);  layer_norm_3 = layers_1_mlp_fc_weight = layers_1_mlp_fc_bias = None
    gelu_1 = torch.ops.aten.gelu.default(linear_6);  linear_6 = None
    layers_1_mlp_proj_weight = getattr(self.layers, "1").mlp.proj.weight
    layers_1_mlp_proj_bias = getattr(self.layers, "1").mlp.proj.bias
    linear_7 = torch.ops.aten.linear.default(gelu_1, layers_1_mlp_proj_weight, layers_1_mlp_proj_bias);  gelu_1 = layers_1_mlp_proj_weight = layers_1_mlp_proj_bias = None
    add_4 = torch.ops.aten.add.Tensor(add_3, linear_7);  add_3 = linear_7 = None
    ln_f_weight = self.ln_f.weight
    ln_f_bias = self.ln_f.bias
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_4, [32], ln_f_weight, ln_f_bias, 1e-05, False);  add_4 = ln_f_weight = ln_f_bias = None
    wte_weight = self.wte.weight
    linear_8 = torch.ops.aten.linear.default(layer_norm_4, wte_weight);  layer_norm_4 = wte_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_8, 0, 1);  linear_8 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (cross_entropy_loss, num_tokens)""")

    def test_llama_pp2(self):
        self.assertExpectedInline(_code(_pipelined("llama", n_layer=2, num_chunks=2)[1]), """\
# chunk 0
def forward(self, input_ids):
    rope_cos = self.rope_cos
    slice_1 = torch.ops.aten.slice.Tensor(rope_cos, 0, 0, 16);  rope_cos = None
    rope_sin = self.rope_sin
    slice_2 = torch.ops.aten.slice.Tensor(rope_sin, 0, 0, 16);  rope_sin = None
    embed_tokens_weight = self.embed_tokens.weight
    embedding = torch.ops.aten.embedding.default(embed_tokens_weight, input_ids);  embed_tokens_weight = input_ids = None
    to = torch.ops.aten.to.dtype(embedding, torch.float32);  embedding = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(to, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add = torch.ops.aten.add.Tensor(mean, 1e-05);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add);  add = None
    mul = torch.ops.aten.mul.Tensor(to, rsqrt);  rsqrt = None
    to_1 = torch.ops.aten.to.dtype(mul, torch.float32);  mul = None
    layers_0_input_layernorm_weight = getattr(self.layers, "0").input_layernorm.weight
    mul_1 = torch.ops.aten.mul.Tensor(layers_0_input_layernorm_weight, to_1);  layers_0_input_layernorm_weight = to_1 = None
    layers_0_self_attn_q_proj_weight = getattr(self.layers, "0").self_attn.q_proj.weight
    linear = torch.ops.aten.linear.default(mul_1, layers_0_self_attn_q_proj_weight);  layers_0_self_attn_q_proj_weight = None
    view = torch.ops.aten.view.default(linear, [2, 16, 4, 8]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    layers_0_self_attn_k_proj_weight = getattr(self.layers, "0").self_attn.k_proj.weight
    linear_1 = torch.ops.aten.linear.default(mul_1, layers_0_self_attn_k_proj_weight);  layers_0_self_attn_k_proj_weight = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 2, 8]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
    layers_0_self_attn_v_proj_weight = getattr(self.layers, "0").self_attn.v_proj.weight
    linear_2 = torch.ops.aten.linear.default(mul_1, layers_0_self_attn_v_proj_weight);  mul_1 = layers_0_self_attn_v_proj_weight = None
    view_2 = torch.ops.aten.view.default(linear_2, [2, 16, 2, 8]);  linear_2 = None
    transpose_2 = torch.ops.aten.transpose.int(view_2, 1, 2);  view_2 = None
    mul_2 = torch.ops.aten.mul.Tensor(transpose, slice_1)
    chunk = torch.ops.aten.chunk.default(transpose, 2, -1);  transpose = None
    getitem = chunk[0]
    getitem_1 = chunk[1];  chunk = None
    neg = torch.ops.aten.neg.default(getitem_1);  getitem_1 = None
    cat = torch.ops.aten.cat.default([neg, getitem], -1);  neg = getitem = None
    mul_3 = torch.ops.aten.mul.Tensor(cat, slice_2);  cat = None
    add_1 = torch.ops.aten.add.Tensor(mul_2, mul_3);  mul_2 = mul_3 = None
    mul_4 = torch.ops.aten.mul.Tensor(transpose_1, slice_1)
    chunk_1 = torch.ops.aten.chunk.default(transpose_1, 2, -1);  transpose_1 = None
    getitem_2 = chunk_1[0]
    getitem_3 = chunk_1[1];  chunk_1 = None
    neg_1 = torch.ops.aten.neg.default(getitem_3);  getitem_3 = None
    cat_1 = torch.ops.aten.cat.default([neg_1, getitem_2], -1);  neg_1 = getitem_2 = None
    mul_5 = torch.ops.aten.mul.Tensor(cat_1, slice_2);  cat_1 = None
    add_2 = torch.ops.aten.add.Tensor(mul_4, mul_5);  mul_4 = mul_5 = None
    repeat_interleave = torch.ops.aten.repeat_interleave.self_int(add_2, 2, 1);  add_2 = None
    repeat_interleave_1 = torch.ops.aten.repeat_interleave.self_int(transpose_2, 2, 1);  transpose_2 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(add_1, repeat_interleave, repeat_interleave_1, None, 0.0, True);  add_1 = repeat_interleave = repeat_interleave_1 = None
    transpose_3 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
    layers_0_self_attn_o_proj_weight = getattr(self.layers, "0").self_attn.o_proj.weight
    linear_3 = torch.ops.aten.linear.default(reshape, layers_0_self_attn_o_proj_weight);  reshape = layers_0_self_attn_o_proj_weight = None
    add_3 = torch.ops.aten.add.Tensor(to, linear_3);  to = linear_3 = None
    to_2 = torch.ops.aten.to.dtype(add_3, torch.float32);  add_3 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_2, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_4 = torch.ops.aten.add.Tensor(mean_1, 1e-05);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_4);  add_4 = None
    mul_6 = torch.ops.aten.mul.Tensor(to_2, rsqrt_1);  rsqrt_1 = None
    to_3 = torch.ops.aten.to.dtype(mul_6, torch.float32);  mul_6 = None
    layers_0_post_attention_layernorm_weight = getattr(self.layers, "0").post_attention_layernorm.weight
    mul_7 = torch.ops.aten.mul.Tensor(layers_0_post_attention_layernorm_weight, to_3);  layers_0_post_attention_layernorm_weight = to_3 = None
    layers_0_mlp_gate_proj_weight = getattr(self.layers, "0").mlp.gate_proj.weight
    linear_4 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_gate_proj_weight);  layers_0_mlp_gate_proj_weight = None
    silu = torch.ops.aten.silu.default(linear_4);  linear_4 = None
    layers_0_mlp_up_proj_weight = getattr(self.layers, "0").mlp.up_proj.weight
    linear_5 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_up_proj_weight);  mul_7 = layers_0_mlp_up_proj_weight = None
    mul_8 = torch.ops.aten.mul.Tensor(silu, linear_5);  silu = linear_5 = None
    layers_0_mlp_down_proj_weight = getattr(self.layers, "0").mlp.down_proj.weight
    linear_6 = torch.ops.aten.linear.default(mul_8, layers_0_mlp_down_proj_weight);  mul_8 = layers_0_mlp_down_proj_weight = None
    add_5 = torch.ops.aten.add.Tensor(to_2, linear_6);  to_2 = linear_6 = None
    send_slice_1 = fxmeg_ops_send(slice_1, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    send_slice_2 = fxmeg_ops_send(slice_2, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    send_add_5 = fxmeg_ops_send(add_5, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    deallocate_add_5 = fxmeg_ops_deallocate(send_add_5);  deallocate_add_5 = None
    return (send_slice_1, send_slice_2, send_add_5)

# chunk 1
def forward(self, labels, slice_1, slice_2, add_5):
    recv_slice_1 = fxmeg_ops_recv(slice_1, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ops_recv(slice_2, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_5 = fxmeg_ops_recv(add_5, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    to_4 = torch.ops.aten.to.dtype(recv_add_5, torch.float32);  recv_add_5 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_4, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_6 = torch.ops.aten.add.Tensor(mean_2, 1e-05);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_6);  add_6 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_4, rsqrt_2);  rsqrt_2 = None
    to_5 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    layers_1_input_layernorm_weight = getattr(self.layers, "1").input_layernorm.weight
    mul_10 = torch.ops.aten.mul.Tensor(layers_1_input_layernorm_weight, to_5);  layers_1_input_layernorm_weight = to_5 = None
    layers_1_self_attn_q_proj_weight = getattr(self.layers, "1").self_attn.q_proj.weight
    linear_7 = torch.ops.aten.linear.default(mul_10, layers_1_self_attn_q_proj_weight);  layers_1_self_attn_q_proj_weight = None
    view_3 = torch.ops.aten.view.default(linear_7, [2, 16, 4, 8]);  linear_7 = None
    transpose_4 = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    layers_1_self_attn_k_proj_weight = getattr(self.layers, "1").self_attn.k_proj.weight
    linear_8 = torch.ops.aten.linear.default(mul_10, layers_1_self_attn_k_proj_weight);  layers_1_self_attn_k_proj_weight = None
    view_4 = torch.ops.aten.view.default(linear_8, [2, 16, 2, 8]);  linear_8 = None
    transpose_5 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    layers_1_self_attn_v_proj_weight = getattr(self.layers, "1").self_attn.v_proj.weight
    linear_9 = torch.ops.aten.linear.default(mul_10, layers_1_self_attn_v_proj_weight);  mul_10 = layers_1_self_attn_v_proj_weight = None
    view_5 = torch.ops.aten.view.default(linear_9, [2, 16, 2, 8]);  linear_9 = None
    transpose_6 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    mul_11 = torch.ops.aten.mul.Tensor(transpose_4, recv_slice_1)
    chunk_2 = torch.ops.aten.chunk.default(transpose_4, 2, -1);  transpose_4 = None
    getitem_4 = chunk_2[0]
    getitem_5 = chunk_2[1];  chunk_2 = None
    neg_2 = torch.ops.aten.neg.default(getitem_5);  getitem_5 = None
    cat_2 = torch.ops.aten.cat.default([neg_2, getitem_4], -1);  neg_2 = getitem_4 = None
    mul_12 = torch.ops.aten.mul.Tensor(cat_2, recv_slice_2);  cat_2 = None
    add_7 = torch.ops.aten.add.Tensor(mul_11, mul_12);  mul_11 = mul_12 = None
    mul_13 = torch.ops.aten.mul.Tensor(transpose_5, recv_slice_1);  recv_slice_1 = None
    chunk_3 = torch.ops.aten.chunk.default(transpose_5, 2, -1);  transpose_5 = None
    getitem_6 = chunk_3[0]
    getitem_7 = chunk_3[1];  chunk_3 = None
    neg_3 = torch.ops.aten.neg.default(getitem_7);  getitem_7 = None
    cat_3 = torch.ops.aten.cat.default([neg_3, getitem_6], -1);  neg_3 = getitem_6 = None
    mul_14 = torch.ops.aten.mul.Tensor(cat_3, recv_slice_2);  cat_3 = recv_slice_2 = None
    add_8 = torch.ops.aten.add.Tensor(mul_13, mul_14);  mul_13 = mul_14 = None
    repeat_interleave_2 = torch.ops.aten.repeat_interleave.self_int(add_8, 2, 1);  add_8 = None
    repeat_interleave_3 = torch.ops.aten.repeat_interleave.self_int(transpose_6, 2, 1);  transpose_6 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(add_7, repeat_interleave_2, repeat_interleave_3, None, 0.0, True);  add_7 = repeat_interleave_2 = repeat_interleave_3 = None
    transpose_7 = torch.ops.aten.transpose.int(scaled_dot_product_attention_1, 1, 2);  scaled_dot_product_attention_1 = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_7, [2, 16, 32]);  transpose_7 = None
    layers_1_self_attn_o_proj_weight = getattr(self.layers, "1").self_attn.o_proj.weight
    linear_10 = torch.ops.aten.linear.default(reshape_1, layers_1_self_attn_o_proj_weight);  reshape_1 = layers_1_self_attn_o_proj_weight = None
    add_9 = torch.ops.aten.add.Tensor(to_4, linear_10);  to_4 = linear_10 = None
    to_6 = torch.ops.aten.to.dtype(add_9, torch.float32);  add_9 = None
    pow_4 = torch.ops.aten.pow.Tensor_Scalar(to_6, 2)
    mean_3 = torch.ops.aten.mean.dim(pow_4, [-1], True);  pow_4 = None
    add_10 = torch.ops.aten.add.Tensor(mean_3, 1e-05);  mean_3 = None
    rsqrt_3 = torch.ops.aten.rsqrt.default(add_10);  add_10 = None
    mul_15 = torch.ops.aten.mul.Tensor(to_6, rsqrt_3);  rsqrt_3 = None
    to_7 = torch.ops.aten.to.dtype(mul_15, torch.float32);  mul_15 = None
    layers_1_post_attention_layernorm_weight = getattr(self.layers, "1").post_attention_layernorm.weight
    mul_16 = torch.ops.aten.mul.Tensor(layers_1_post_attention_layernorm_weight, to_7);  layers_1_post_attention_layernorm_weight = to_7 = None
    layers_1_mlp_gate_proj_weight = getattr(self.layers, "1").mlp.gate_proj.weight
    linear_11 = torch.ops.aten.linear.default(mul_16, layers_1_mlp_gate_proj_weight);  layers_1_mlp_gate_proj_weight = None
    silu_1 = torch.ops.aten.silu.default(linear_11);  linear_11 = None
    layers_1_mlp_up_proj_weight = getattr(self.layers, "1").mlp.up_proj.weight
    linear_12 = torch.ops.aten.linear.default(mul_16, layers_1_mlp_up_proj_weight);  mul_16 = layers_1_mlp_up_proj_weight = None
    mul_17 = torch.ops.aten.mul.Tensor(silu_1, linear_12);  silu_1 = linear_12 = None
    layers_1_mlp_down_proj_weight = getattr(self.layers, "1").mlp.down_proj.weight
    linear_13 = torch.ops.aten.linear.default(mul_17, layers_1_mlp_down_proj_weight);  mul_17 = layers_1_mlp_down_proj_weight = None
    add_11 = torch.ops.aten.add.Tensor(to_6, linear_13);  to_6 = linear_13 = None
    to_8 = torch.ops.aten.to.dtype(add_11, torch.float32);  add_11 = None
    pow_5 = torch.ops.aten.pow.Tensor_Scalar(to_8, 2)
    mean_4 = torch.ops.aten.mean.dim(pow_5, [-1], True);  pow_5 = None
    add_12 = torch.ops.aten.add.Tensor(mean_4, 1e-05);  mean_4 = None
    rsqrt_4 = torch.ops.aten.rsqrt.default(add_12);  add_12 = None
    mul_18 = torch.ops.aten.mul.Tensor(to_8, rsqrt_4);  to_8 = rsqrt_4 = None
    to_9 = torch.ops.aten.to.dtype(mul_18, torch.float32);  mul_18 = None
    norm_weight = self.norm.weight
    mul_19 = torch.ops.aten.mul.Tensor(norm_weight, to_9);  norm_weight = to_9 = None
    lm_head_weight = self.lm_head.weight
    linear_14 = torch.ops.aten.linear.default(mul_19, lm_head_weight);  mul_19 = lm_head_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_14, 0, 1);  linear_14 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (cross_entropy_loss, num_tokens)""")

    def test_gpt_pp2_vpp2(self):
        parent = _pipelined("gpt", n_layer=4, num_chunks=4)[1]
        self.assertExpectedInline(_code(parent, boundaries_only=True), """\
# chunk 0
def forward(self, input_ids):
    send_add_2 = fxmeg_ops_send(add_2, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    deallocate_add_2 = fxmeg_ops_deallocate(send_add_2);  deallocate_add_2 = None
    return (send_add_2,)

# chunk 1
def forward(self, add_2):
    recv_add_2 = fxmeg_ops_recv(add_2, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_2 = None
    send_add_4 = fxmeg_ops_send(add_4, dst_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_4 = None
    deallocate_add_4 = fxmeg_ops_deallocate(send_add_4);  deallocate_add_4 = None
    return (send_add_4,)

# chunk 2
def forward(self, add_4):
    recv_add_4 = fxmeg_ops_recv(add_4, src_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_4 = None
    send_add_6 = fxmeg_ops_send(add_6, dst_chunk = 3, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_6 = None
    deallocate_add_6 = fxmeg_ops_deallocate(send_add_6);  deallocate_add_6 = None
    return (send_add_6,)

# chunk 3
def forward(self, labels, add_6):
    recv_add_6 = fxmeg_ops_recv(add_6, src_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_6 = None
    return (cross_entropy_loss, num_tokens)""")


    def test_llama_pp2_vpp2(self):
        parent = _pipelined("llama", n_layer=4, num_chunks=4)[1]
        self.assertExpectedInline(_code(parent, boundaries_only=True), """\
# chunk 0
def forward(self, input_ids):
    send_slice_1 = fxmeg_ops_send(slice_1, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    send_slice_2 = fxmeg_ops_send(slice_2, dst_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    send_add_5 = fxmeg_ops_send(add_5, dst_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    deallocate_add_5 = fxmeg_ops_deallocate(send_add_5);  deallocate_add_5 = None
    return (send_slice_1, send_slice_2, send_add_5)

# chunk 1
def forward(self, slice_1, slice_2, add_5):
    recv_slice_1 = fxmeg_ops_recv(slice_1, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ops_recv(slice_2, src_chunk = 0, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_5 = fxmeg_ops_recv(add_5, src_chunk = 0, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_5 = None
    send_slice_1 = fxmeg_ops_send(recv_slice_1, dst_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_1 = None
    send_slice_2 = fxmeg_ops_send(recv_slice_2, dst_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_2 = None
    send_add_11 = fxmeg_ops_send(add_11, dst_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_11 = None
    deallocate_add_11 = fxmeg_ops_deallocate(send_add_11);  deallocate_add_11 = None
    return (send_slice_1, send_slice_2, send_add_11)

# chunk 2
def forward(self, slice_1, slice_2, add_11):
    recv_slice_1 = fxmeg_ops_recv(slice_1, src_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ops_recv(slice_2, src_chunk = 1, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_11 = fxmeg_ops_recv(add_11, src_chunk = 1, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_11 = None
    send_slice_1 = fxmeg_ops_send(recv_slice_1, dst_chunk = 3, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_1 = None
    send_slice_2 = fxmeg_ops_send(recv_slice_2, dst_chunk = 3, shape = [16, 8], dtype = torch.float32, grad = False);  recv_slice_2 = None
    send_add_17 = fxmeg_ops_send(add_17, dst_chunk = 3, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_17 = None
    deallocate_add_17 = fxmeg_ops_deallocate(send_add_17);  deallocate_add_17 = None
    return (send_slice_1, send_slice_2, send_add_17)

# chunk 3
def forward(self, labels, slice_1, slice_2, add_17):
    recv_slice_1 = fxmeg_ops_recv(slice_1, src_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  slice_1 = None
    recv_slice_2 = fxmeg_ops_recv(slice_2, src_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False);  slice_2 = None
    recv_add_17 = fxmeg_ops_recv(add_17, src_chunk = 2, shape = [2, 16, 32], dtype = torch.float32, grad = True);  add_17 = None
    return (cross_entropy_loss, num_tokens)""")



@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_chained_chunks_compute_the_captured_loss(name, k):
    model, parent = _pipelined(name, n_layer=4, num_chunks=k)
    ids, labels = make_batch(2, seed=7)
    loss_sum, num_tokens = parent(ids, labels)
    assert int(num_tokens) == int((labels != -100).sum())
    assert torch.equal(loss_sum / num_tokens, model(ids, labels))


def test_boundaries_carry_several_tensors_and_relay_them():
    _, parent = _pipelined("llama", n_layer=4, num_chunks=4)
    specs = [chunk_spec(gm) for gm in chunks(parent)]
    assert [s.data_inputs for s in specs] == [(0,), (), (), (1,)]  # ids first, labels last
    for s in specs[:-1]:  # rotary tables (no grad) ride along with the hidden state
        assert [(b.name, b.grad) for b in s.send][:2] == [("slice_1", False), ("slice_2", False)]
        assert s.send[2].grad and s.send[2].shape == (2, 16, 32)
        assert s.deallocate == (False, False, True)  # relayed / no-grad tensors stay
    for prev, nxt in zip(specs, specs[1:]):
        assert nxt.recv == prev.send
    assert specs[-1].is_last and not any(s.is_last for s in specs[:-1])
    middle = chunks(parent)[1].code
    assert "send_slice_1 = fxmeg_ops_send(recv_slice_1, dst_chunk = 2, shape = [16, 8], dtype = torch.float32, grad = False)" in middle


def test_tied_weight_is_held_by_both_ends():
    _, parent = _pipelined("gpt", n_layer=4, num_chunks=4)
    holders = [c for c, gm in enumerate(chunks(parent)) if "wte.weight" in dict(gm.named_parameters())]
    assert holders == [0, 3]
    first, last = chunks(parent)[0], chunks(parent)[3]
    assert first.get_parameter("wte.weight") is last.get_parameter("wte.weight")
