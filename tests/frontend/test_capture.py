"""Capture: the one full snapshot of each model's graph (pass tests snapshot only what
their pass changes, tests.harness.helpers.graph_diff), names, ownership and refusals."""

import pytest
import torch
from expecttest import TestCase

from fxmeg.errors import CaptureError
from fxmeg.frontend.capture import capture, owning_module
from tests.harness.helpers import make_batch
from tests.harness.models import make_model


def _gm(name: str, **cfg):
    model = make_model(name, n_layer=1, **cfg)
    return model, capture(model, make_batch(2, seed=0))


class CapturedGraphs(TestCase):
    def test_gpt(self):
        self.assertExpectedInline(
            _gm("gpt")[1].gm.code.strip(),
            """\
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
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1);  flatten = flatten_1 = None
    return (cross_entropy_loss,)""",  # noqa: E501 (expected text, compared whole)
        )

    def test_llama(self):
        self.assertExpectedInline(
            _gm("llama")[1].gm.code.strip(),
            """\
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
    cross_entropy_loss = torch.ops.aten.cross_entropy_loss.default(flatten, flatten_1);  flatten = flatten_1 = None
    return (cross_entropy_loss,)""",  # noqa: E501 (expected text, compared whole)
        )


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_parameters_keep_their_names_and_objects(name):
    model, c = _gm(name)
    params = dict(model.named_parameters())
    getters = [n for n in c.gm.graph.nodes if n.op == "get_attr"]
    for n in getters:
        if n.target in params:
            assert c.gm.get_parameter(n.target) is params[n.target]
    assert {n.target for n in getters} >= set(params)
    ids, labels = make_batch(2, seed=1)
    assert torch.equal(c.gm(ids, labels)[0], model(ids, labels))


def test_tied_weight_appears_once_under_its_first_name():
    model, c = _gm("gpt")
    targets = [n.target for n in c.gm.graph.nodes if n.op == "get_attr"]
    assert targets.count("wte.weight") == 1 and "lm_head.weight" not in targets
    assert c.aliases["wte.weight"] == ["wte.weight", "lm_head.weight"]


def test_nodes_carry_owning_module_and_shape():
    _, c = _gm("llama")
    for node in c.gm.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta["val"], torch.Tensor) or node.meta["val"] is not None
    by_module = {owning_module(n) for n in c.gm.graph.nodes if n.op == "call_function"}
    assert {"embed_tokens", "layers.0.self_attn.q_proj", "layers.0.mlp", "norm", ""} <= by_module
    q = next(n for n in c.gm.graph.nodes if owning_module(n) == "layers.0.self_attn.q_proj")
    assert tuple(q.meta["val"].shape) == (2, 16, 32)


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        return y * 2 if y.sum() > 0 else y


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_DataDependent()])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.blocks[0](x), y)


def test_uncapturable_model_names_module_and_fix():
    with pytest.raises(CaptureError) as err:
        capture(_Outer(), (torch.randn(2, 4), torch.randn(2, 4)))
    msg = str(err.value)
    assert "'blocks.0' (_DataDependent)" in msg
    assert "data-dependent" in msg and "torch.cond" in msg


def _glm4_moe_lite(kv_heads: int) -> torch.nn.Module:
    """GLM-4-MoE-Lite (latent attention: keys expanded per query head from a shared
    latent) with ``kv_heads`` key/value heads in its config (issue 68's recipe gave 2)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "glm4_moe_lite", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def test_a_shape_error_names_the_models_own_failure_not_control_flow():
    """GLM-4-MoE-Lite with 2 key/value heads runs eagerly only while no mask is built
    (transformers' sdpa then passes enable_gqa=True, keys and queries alike with 4 heads);
    under export it builds the mask, repeats the keys 2x and fails. The error says plain
    PyTorch fails too with a padded mask, and names the config's heads, not control flow;
    with num_key_value_heads = num_attention_heads the same model is captured."""
    batch = make_batch(2, seed=0, vocab=96)
    with pytest.raises(CaptureError) as err:
        capture(_glm4_moe_lite(2), batch)
    msg = str(err.value)
    assert "in module 'model.layers.0.self_attn' (Glm4MoeLiteAttention)" in msg, msg
    assert "plain PyTorch fails too on the example with an attention mask" in msg, msg
    assert "num_key_value_heads=2 of num_attention_heads=4" in msg, msg
    assert "set num_key_value_heads=num_attention_heads" in msg, msg
    assert "data-dependent Python control flow" not in msg, msg
    assert capture(_glm4_moe_lite(4), batch).gm is not None


def test_buffer_mutation_is_refused():
    class WithBatchNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.bn(x), y)

    with pytest.raises(CaptureError, match="module .bn. updates bn.num_batches_tracked"):
        capture(WithBatchNorm(), (torch.randn(2, 4), torch.randn(2, 4)))


def test_a_dict_example_is_passed_by_keyword_in_its_key_order():
    model = make_model("gpt", n_layer=1)
    ids, labels = make_batch(2, seed=0)
    c = capture(model, {"labels": labels, "input_ids": ids})  # not forward's order
    assert c.input_names == ["labels", "input_ids"]
    info = c.gm.meta["fxmeg"]["capture"]
    assert [i.name for i in info.inputs] == ["labels", "input_ids"] and info.keywords
    assert torch.equal(c.gm(labels, ids)[0], model(ids, labels))
    assert not capture(model, (ids, labels)).gm.meta["fxmeg"]["capture"].keywords


def test_a_dict_example_reaches_loss_fn_by_keyword():
    def loss_fn(model, *, input_ids, labels):
        return model(input_ids, labels) * 3, (labels != -100).sum()

    model = make_model("gpt", n_layer=1)
    ids, labels = make_batch(2, seed=0)
    c = capture(model, {"input_ids": ids, "labels": labels}, loss_fn=loss_fn)
    assert c.explicit_loss and c.input_names == ["input_ids", "labels"]
    assert torch.equal(c.gm(ids, labels)[0], model(ids, labels) * 3)


def test_an_example_passing_one_tensor_twice_is_captured_as_two_inputs():
    """(ids, ids) as the example (labels = input ids): export would trace one value for
    both, and the graph would read the labels as the input ids of every later batch."""
    model = make_model("gpt", n_layer=1)
    ids, labels = make_batch(2, seed=0)
    gm = capture(model, (ids, ids)).gm
    assert torch.equal(gm(ids, labels)[0], model(ids, labels))
