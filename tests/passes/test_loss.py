import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

from fxmeg.capture import capture
from fxmeg.errors import PassError
from fxmeg.passes.loss import loss
from tests.helpers import make_batch, make_model


class LossGraphs(TestCase):
    def test_gpt(self):
        model = make_model("gpt", n_layer=1)
        gm = loss(capture(model, make_batch(2, seed=0)).gm)
        self.assertExpectedInline(gm.code.strip(), """\
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
    embedding = torch.ops.aten.embedding.default(wte_weight, input_ids);  input_ids = None
    embedding_1 = torch.ops.aten.embedding.default(wpe_weight, arange);  wpe_weight = arange = None
    add = torch.ops.aten.add.Tensor(embedding, embedding_1);  embedding = embedding_1 = None
    layer_norm = torch.ops.aten.layer_norm.default(add, [32], layers_0_ln_1_weight, layers_0_ln_1_bias, 1e-05, False);  layers_0_ln_1_weight = layers_0_ln_1_bias = None
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
    linear_1 = torch.ops.aten.linear.default(reshape, layers_0_attn_proj_weight, layers_0_attn_proj_bias);  reshape = layers_0_attn_proj_weight = layers_0_attn_proj_bias = None
    add_1 = torch.ops.aten.add.Tensor(add, linear_1);  add = linear_1 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_1, [32], layers_0_ln_2_weight, layers_0_ln_2_bias, 1e-05, False);  layers_0_ln_2_weight = layers_0_ln_2_bias = None
    linear_2 = torch.ops.aten.linear.default(layer_norm_1, layers_0_mlp_fc_weight, layers_0_mlp_fc_bias);  layer_norm_1 = layers_0_mlp_fc_weight = layers_0_mlp_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear_2);  linear_2 = None
    linear_3 = torch.ops.aten.linear.default(gelu, layers_0_mlp_proj_weight, layers_0_mlp_proj_bias);  gelu = layers_0_mlp_proj_weight = layers_0_mlp_proj_bias = None
    add_2 = torch.ops.aten.add.Tensor(add_1, linear_3);  add_1 = linear_3 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_2, [32], ln_f_weight, ln_f_bias, 1e-05, False);  add_2 = ln_f_weight = ln_f_bias = None
    linear_4 = torch.ops.aten.linear.default(layer_norm_2, wte_weight);  layer_norm_2 = wte_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_4, 0, 1);  linear_4 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (cross_entropy_loss, num_tokens)""")

    def test_llama(self):
        model = make_model("llama", n_layer=1)
        gm = loss(capture(model, make_batch(2, seed=0)).gm)
        self.assertExpectedInline(gm.code.strip(), """\
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
    embedding = torch.ops.aten.embedding.default(embed_tokens_weight, input_ids);  embed_tokens_weight = input_ids = None
    to = torch.ops.aten.to.dtype(embedding, torch.float32);  embedding = None
    pow_1 = torch.ops.aten.pow.Tensor_Scalar(to, 2)
    mean = torch.ops.aten.mean.dim(pow_1, [-1], True);  pow_1 = None
    add = torch.ops.aten.add.Tensor(mean, 1e-05);  mean = None
    rsqrt = torch.ops.aten.rsqrt.default(add);  add = None
    mul = torch.ops.aten.mul.Tensor(to, rsqrt);  rsqrt = None
    to_1 = torch.ops.aten.to.dtype(mul, torch.float32);  mul = None
    mul_1 = torch.ops.aten.mul.Tensor(layers_0_input_layernorm_weight, to_1);  layers_0_input_layernorm_weight = to_1 = None
    linear = torch.ops.aten.linear.default(mul_1, layers_0_self_attn_q_proj_weight);  layers_0_self_attn_q_proj_weight = None
    view = torch.ops.aten.view.default(linear, [2, 16, 4, 8]);  linear = None
    transpose = torch.ops.aten.transpose.int(view, 1, 2);  view = None
    linear_1 = torch.ops.aten.linear.default(mul_1, layers_0_self_attn_k_proj_weight);  layers_0_self_attn_k_proj_weight = None
    view_1 = torch.ops.aten.view.default(linear_1, [2, 16, 2, 8]);  linear_1 = None
    transpose_1 = torch.ops.aten.transpose.int(view_1, 1, 2);  view_1 = None
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
    reshape = torch.ops.aten.reshape.default(transpose_3, [2, 16, 32]);  transpose_3 = None
    linear_3 = torch.ops.aten.linear.default(reshape, layers_0_self_attn_o_proj_weight);  reshape = layers_0_self_attn_o_proj_weight = None
    add_3 = torch.ops.aten.add.Tensor(to, linear_3);  to = linear_3 = None
    to_2 = torch.ops.aten.to.dtype(add_3, torch.float32);  add_3 = None
    pow_2 = torch.ops.aten.pow.Tensor_Scalar(to_2, 2)
    mean_1 = torch.ops.aten.mean.dim(pow_2, [-1], True);  pow_2 = None
    add_4 = torch.ops.aten.add.Tensor(mean_1, 1e-05);  mean_1 = None
    rsqrt_1 = torch.ops.aten.rsqrt.default(add_4);  add_4 = None
    mul_6 = torch.ops.aten.mul.Tensor(to_2, rsqrt_1);  rsqrt_1 = None
    to_3 = torch.ops.aten.to.dtype(mul_6, torch.float32);  mul_6 = None
    mul_7 = torch.ops.aten.mul.Tensor(layers_0_post_attention_layernorm_weight, to_3);  layers_0_post_attention_layernorm_weight = to_3 = None
    linear_4 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_gate_proj_weight);  layers_0_mlp_gate_proj_weight = None
    silu = torch.ops.aten.silu.default(linear_4);  linear_4 = None
    linear_5 = torch.ops.aten.linear.default(mul_7, layers_0_mlp_up_proj_weight);  mul_7 = layers_0_mlp_up_proj_weight = None
    mul_8 = torch.ops.aten.mul.Tensor(silu, linear_5);  silu = linear_5 = None
    linear_6 = torch.ops.aten.linear.default(mul_8, layers_0_mlp_down_proj_weight);  mul_8 = layers_0_mlp_down_proj_weight = None
    add_5 = torch.ops.aten.add.Tensor(to_2, linear_6);  to_2 = linear_6 = None
    to_4 = torch.ops.aten.to.dtype(add_5, torch.float32);  add_5 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(to_4, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_6 = torch.ops.aten.add.Tensor(mean_2, 1e-05);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_6);  add_6 = None
    mul_9 = torch.ops.aten.mul.Tensor(to_4, rsqrt_2);  to_4 = rsqrt_2 = None
    to_5 = torch.ops.aten.to.dtype(mul_9, torch.float32);  mul_9 = None
    mul_10 = torch.ops.aten.mul.Tensor(norm_weight, to_5);  norm_weight = to_5 = None
    linear_7 = torch.ops.aten.linear.default(mul_10, lm_head_weight);  mul_10 = lm_head_weight = None
    flatten = torch.ops.aten.flatten.using_ints(linear_7, 0, 1);  linear_7 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(labels);  labels = None
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1, None, 2, -100, 0.0);  flatten = None
    ne_scalar = torch.ops.aten.ne.Scalar(flatten_1, -100);  flatten_1 = None
    num_tokens = torch.ops.aten.sum.default(ne_scalar);  ne_scalar = None
    return (cross_entropy_loss, num_tokens)""")


class _Head(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.proj = torch.nn.Linear(8, 10)
        self.fn = fn

    def forward(self, x, y):
        return self.fn(self.proj(x), y)


def _masked(logits, y):
    per_token = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
    mask = (y >= 0).float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


LOSSES = {
    "cross_entropy": lambda z, y: F.cross_entropy(z, y),
    "nll": lambda z, y: F.nll_loss(F.log_softmax(z, -1), y),
    "masked_mean": _masked,
    "plain_mean": lambda z, y: (z**2).mean(),
    "tuple_output": lambda z, y: (F.cross_entropy(z, y), z),
    "cast_of_mean": lambda z, y: F.cross_entropy(z, y).double(),
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_sum_and_count_equal_mean_times_count(kind):
    torch.manual_seed(0)
    model = _Head(LOSSES[kind])
    x = torch.randn(6, 8)
    y = torch.tensor([1, -100, 3, 2, -100, 9])
    gm = loss(capture(model, (x, y)).gm)
    loss_sum, num_tokens = gm(x, y)
    mean = model(x, y)
    mean = mean[0] if isinstance(mean, tuple) else mean
    count = 60 if kind == "plain_mean" else 4  # every logit, or the non-ignored labels
    torch.testing.assert_close(loss_sum.double(), mean.double() * count, rtol=1e-6, atol=0)
    assert int(num_tokens) == count


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_reference_models_sum_and_count(name):
    model = make_model(name)
    ids, labels = make_batch(2, seed=3)
    gm = loss(capture(model, (ids, labels)).gm)
    loss_sum, num_tokens = gm(ids, labels)
    count = int((labels != -100).sum())
    assert int(num_tokens) == count
    torch.testing.assert_close(loss_sum, model(ids, labels) * count, rtol=1e-6, atol=0)


def test_explicit_loss_fn_is_kept():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 10)

        def forward(self, x):
            return self.proj(x)

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y, reduction="sum", ignore_index=-1), (y != -1).sum()

    model = Logits()
    x, y = torch.randn(4, 8), torch.tensor([1, -1, 3, 2])
    c = capture(model, (x, y), loss_fn=loss_fn)
    gm = loss(c.gm)
    loss_sum, num_tokens = gm(x, y)
    assert int(num_tokens) == 3
    torch.testing.assert_close(loss_sum, F.cross_entropy(model(x), y, ignore_index=-1) * 3)
    assert gm.get_parameter("proj.weight") is model.proj.weight  # user names, no prefix


def test_unrecognised_loss_says_how_to_pass_loss_fn():
    model = _Head(lambda z, y: F.cross_entropy(z, y) ** 2)
    with pytest.raises(PassError) as err:
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)
    msg = str(err.value)
    assert "cannot recognise the loss" in msg and "aten::pow" in msg and "loss_fn=" in msg


def test_non_scalar_output_is_refused():
    model = _Head(lambda z, y: z)
    with pytest.raises(PassError, match=r"shape \[4, 10\], not a scalar loss"):
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)


def test_class_weights_are_refused():
    w = torch.ones(10)
    model = _Head(lambda z, y: F.cross_entropy(z, y, weight=w))
    with pytest.raises(PassError, match="class weights"):
        loss(capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4]))).gm)


def test_explicit_loss_fn_must_return_two_scalars():
    model = _Head(lambda z, y: z)
    c = capture(model, (torch.randn(4, 8), torch.tensor([1, 2, 3, 4])),
                loss_fn=lambda m, x, y: (m(x, y).sum(),))
    with pytest.raises(PassError, match=r"loss_fn must return \(loss_sum, num_tokens\)"):
        loss(c.gm)
