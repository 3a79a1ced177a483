"""Mixtures of experts through the tensor-parallel pass (fxmeg/passes/tp/moe.py), in one
process: a router (a linear softmaxed or ranked over its output features) and a
one-feature gate stay whole, whatever their module is called; the attention and dense
projections (a shared expert's too) are split; the expert banks stay whole and the pass
says so; DeepSeek-V3's latent attention keeps its down projections whole (Megatron's MLA);
under sequence parallelism a block gathers the tokens it routes; an op with two outputs
(max.dim, topk) over a split value keeps or refuses the split by name, never with a raw
AttributeError (GPT-OSS at tp=2 did)."""

import logging

import pytest
import torch
from torch import nn

from fxmeg.errors import PassError
from fxmeg.ir.layouts import Replicate, Shard
from fxmeg.ir.tags import tag
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import MOE, tiny_moe


def _layouts(gm) -> dict:
    return {
        n.target: n.meta["fxmeg"]["tp"] for n in gm.graph.nodes if "tp" in n.meta.get("fxmeg", {})
    }


# their first layer is dense
@pytest.mark.parametrize("kind", sorted(set(MOE) - {"deepseek_v3", "afmoe", "glm4_moe_lite"}))
def test_routers_stay_whole_and_the_experts_are_named(kind, caplog):
    """With expert_tensor_parallel_size=1 the experts stay whole on every tp rank, said."""
    with caplog.at_level(logging.INFO, logger="fxmeg.passes.tensor_parallel"):
        gm = graph_after(tiny_moe(kind), make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2,
                         expert_tensor_parallel_size=1)
    tp = _layouts(gm)
    block = "block_sparse_moe" if kind.startswith("granitemoe") else "mlp"  # Granite's MoE module
    router = "router" if kind == "gpt_oss" or kind.startswith("granitemoe") else "gate"
    assert tp[f"model.layers.0.{block}.{router}.weight"] == Replicate()
    # Qwen3.5's query projection holds each head's query and output gate: 2 x 32 features
    assert tp["model.layers.1.self_attn.q_proj.weight"] == Shard(
        0, (64,) if kind == "qwen3_5_moe_text" else (32,))
    assert tp[f"model.layers.1.{block}.experts.down_proj"] == Replicate()
    if kind == "qwen2_moe":  # the shared expert is a dense MLP: split; its one-feature gate: whole
        assert tp["model.layers.0.mlp.shared_expert.up_proj.weight"] == Shard(0, (48,))
        assert tp["model.layers.0.mlp.shared_expert_gate.weight"] == Replicate()
    if kind == "granitemoeshared":  # its shared MLP is dense: split, gate and up halves each
        assert tp["model.layers.0.shared_mlp.input_linear.weight"] == Shard(0, (48, 48))
    said = [r for r in caplog.records if r.name == "fxmeg.passes.tensor_parallel"]
    (info,) = [r.getMessage() for r in said if r.levelno == logging.INFO]
    gated = kind in ("qwen2_moe", "qwen3_5_moe_text")  # a one-feature shared-expert gate
    assert f"tp=2 keeps {2 + 2 * gated} router linears whole" in info
    assert f"model.layers.*.{block}.{router}" in info
    (warning,) = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert warning.startswith("tp=2 leaves") and f"'model.layers.*.{block}.experts' (" in warning


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_expert_tensor_parallelism_splits_each_expert_as_a_dense_mlp(kind, caplog):
    """By default (expert_tensor_parallel_size = tp) the up bank is split along its output
    features in the blocks the activation cuts (Mixtral's gate and up halves; GPT-OSS's
    interleaved pairs: one run), its bias alike, the down bank along its input features;
    the rows and (no down bias) the routing weights enter through f (tp_copy), one
    tp_reduce sums the block: after the tokens' sum, or with a down bias (GPT-OSS) right
    after the second matmul. Nothing about the experts is left whole to warn about."""
    with caplog.at_level(logging.WARNING, logger="fxmeg.passes.tensor_parallel"):
        gm = graph_after(tiny_moe(kind), make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2)
    tp = _layouts(gm)
    experts = "model.layers.0.mlp.experts."
    if kind == "mixtral":  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
        assert tp[experts + "gate_up_proj"] == Shard(1, (48, 48))
        assert tp[experts + "down_proj"] == Shard(2, (48,))
    else:  # gate_up_proj [E, H, 2I] interleaved, its bias [E, 2I]; down_proj [E, I, H]
        assert tp[experts + "gate_up_proj"] == Shard(2, (96,))
        assert tp[experts + "gate_up_proj_bias"] == Shard(1, (96,))
        assert tp[experts + "down_proj"] == Shard(1, (48,))
        assert tp[experts + "down_proj_bias"] == Replicate()
    moves = [(n.target.__name__, tag(n, "module", "")) for n in gm.graph.nodes
             if str(n.target).startswith("fxmeg.") and ".mlp" in tag(n, "module", "")]
    weights = [("tp_copy.default", "model.layers.0.mlp.gate")] * (kind == "mixtral")
    assert moves[:len(moves) // 2] == [  # layer 0; the router's own weights, as the model has it
        ("tp_copy.default", "model.layers.0.mlp"), *weights,
        ("tp_reduce.default", "model.layers.0.mlp.experts")]
    assert "expert parameters" not in caplog.text


def test_gpt_oss_expert_biases_are_named_with_their_bank(caplog):
    with caplog.at_level(logging.WARNING, logger="fxmeg.passes.tensor_parallel"):
        graph_after(tiny_moe("gpt_oss"), make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2,
                    expert_tensor_parallel_size=1)
    assert (
        "tp=2 leaves 8 expert parameters (37888 elements) whole on every tp rank: "
        "'model.layers.*.mlp."
        "experts' (down_proj [4, 48, 32], down_proj_bias [4, 32], gate_up_proj [4, 32, 96], "
        "gate_up_proj_bias [4, 96])"
    ) in caplog.text


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "q_proj"])
def test_latent_attention_keeps_its_down_projections_whole(q_lora_rank, caplog, monkeypatch):
    """Megatron's MLA at tp, found by structure (fxmeg/passes/tp/latent.py): the down
    projections feeding a per-head up projection (q_a_proj, kv_a_proj_with_mqa, whose
    output also holds the rotary key every head shares) and their norms whole, the up
    projections split over heads, o_proj by rows; the router whole, the experts and the
    shared experts split. The whole down projections are said, with why."""
    monkeypatch.setitem(MOE, "deepseek_v3", MOE["deepseek_v3"] | {"q_lora_rank": q_lora_rank})
    model, batch = tiny_moe("deepseek_v3"), make_batch(2, seed=0, vocab=96)
    with caplog.at_level(logging.WARNING, logger="fxmeg.passes.tensor_parallel"):
        tp = _layouts(graph_after(model, batch, "tensor_parallel", tp=2))
    attn = "model.layers.1.self_attn."
    whole = ["kv_a_proj_with_mqa", "kv_a_layernorm"] + ["q_a_proj", "q_a_layernorm"] * bool(
        q_lora_rank
    )
    for module in whole:
        assert tp[attn + module + ".weight"] == Replicate(), module
    q = "q_b_proj" if q_lora_rank else "q_proj"
    assert tp[attn + q + ".weight"] == Shard(0, (4 * 12,))  # 4 heads of 8 + 4
    assert tp[attn + "kv_b_proj.weight"] == Shard(0, (4 * 16,))  # 4 heads of k 8 + v 8
    assert tp[attn + "o_proj.weight"] == Shard(1, (32,))
    assert tp["model.layers.1.mlp.gate.weight"] == Replicate()
    assert tp["model.layers.1.mlp.experts.down_proj"] == Shard(2, (48,))  # expert tp
    assert tp["model.layers.1.mlp.shared_experts.up_proj.weight"] == Shard(0, (48,))
    assert "'model.layers.*.self_attn.kv_a_proj_with_mqa': a down projection every head reads" in (
        caplog.text
    )


def test_an_mlp_up_projection_is_no_down_projection():
    """An MLP's up projection feeds its down projection too, through per-token ops, but
    the down projection's output is not unpacked into heads: column-parallel as before."""
    tp = _layouts(graph_after(_Scored(), make_batch(2, seed=0), "tensor_parallel", tp=2))
    assert tp["layers.0.up.weight"] == Shard(0, (32,))


@pytest.mark.parametrize("expert_tp", [2, 1], ids=["experts-split", "experts-whole"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_sequence_parallel_gathers_the_tokens_a_block_routes(kind, expert_tp):
    """tp x sp: the block flattening the sequence-split stream into tokens reads it whole
    (``sp_whole``: all-gather, backward this rank's part of the whole gradient), routes
    every token on every tp rank, and its output rejoins the stream cut to this rank's
    part (``sp_split``: backward all-gathered). Its experts are split over tp as without sp
    (expert tensor parallelism, the default: the down bank by its input features, the
    block's sum all-reduced), or with expert_tensor_parallel_size=1 run whole, their
    gradient the same on every tp rank (not reduced over tp). A shared expert reading the
    whole tokens is all-reduced, not scattered along a sequence it no longer has."""
    gm = graph_after(
        tiny_moe(kind), make_batch(2, seed=0, vocab=96), "tensor_parallel", tp=2,
        sequence_parallel=True, expert_tensor_parallel_size=expert_tp,
    )
    ops = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    moe_layers = 1 if kind == "deepseek_v3" else 2  # DeepSeek-V3's layer 0 is dense
    assert ops.count("sp_whole.default") == ops.count("sp_split.default") == moe_layers
    whole = next(n for n in gm.graph.nodes if n.target is torch.ops.fxmeg.sp_whole.default)
    assert list(whole.users)[0].target.__name__ in ("view.default", "reshape.default")
    assert tuple(whole.meta["val"].shape) == (2, 16, 32)  # the whole sequence
    tp = _layouts(gm)
    block = "model.layers.1.mlp"
    split = expert_tp == 2
    want = Shard(2, (48,)) if split else Replicate(reduce_grad=False)  # [E, H, I]
    assert tp[f"{block}.experts.down_proj"] == want
    assert tp[f"{block}.gate.weight"] == Replicate(reduce_grad=False)
    shared = kind == "qwen2_moe"  # its shared expert reads the whole tokens: all-reduced
    if shared:
        assert tp[f"{block}.shared_expert.down_proj.weight"] == Shard(1, (48,))
    # one sum per block of split experts, one per shared expert
    assert ops.count("tp_reduce.default") == moe_layers * (split + shared)


class _Scored(nn.Module):
    """A block whose ``scorer`` (no 'gate' or 'router' in its name) is softmaxed over its
    output features, whose ``weigh`` has one output feature, and whose ``up`` / ``down``
    pair is a dense MLP: found by kind, the first two stay whole."""

    def __init__(self, reduce: str = "none"):
        super().__init__()
        self.reduce = reduce
        self.emb = nn.Embedding(128, 16)
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {
                        "scorer": nn.Linear(16, 4),
                        "weigh": nn.Linear(16, 1),
                        "up": nn.Linear(16, 32),
                        "down": nn.Linear(32, 16),
                    }
                )
            ]
        )
        self.head = nn.Linear(16, 128)

    def forward(self, ids, labels):
        x, block = self.emb(ids), self.layers[0]
        probs = block["scorer"](x).float().softmax(-1)  # (b, s, 4)
        h = block["up"](x)  # (b, s, 32): column-parallel
        if self.reduce == "features":
            h = h - h.max(dim=-1, keepdim=True).values  # along the split features
        elif self.reduce == "sequence":
            h = h - h.max(dim=1, keepdim=True).values  # along the sequence: keeps the split
        x = (
            x
            + block["down"](h.relu())
            * probs.max(-1, keepdim=True).values
            * block["weigh"](x).sigmoid()
        )
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_a_router_is_found_by_kind_not_by_name():
    tp = _layouts(graph_after(_Scored(), make_batch(2, seed=0), "tensor_parallel", tp=2))
    assert tp["layers.0.scorer.weight"] == tp["layers.0.weigh.weight"] == Replicate()
    assert tp["layers.0.up.weight"] == Shard(0, (32,)) and tp["layers.0.down.weight"] == Shard(
        1, (32,)
    )


def test_a_two_output_reduction_keeps_the_split_along_another_dim():
    gm = graph_after(_Scored("sequence"), make_batch(2, seed=0), "tensor_parallel", tp=2)
    (values,) = [n for n in gm.graph.nodes if n.name == "getitem"]
    assert tuple(values.meta["val"].shape) == (2, 1, 16)  # this rank's 16 of 32 features


def test_a_two_output_reduction_over_the_split_dim_is_refused_by_name():
    refusal = (
        r"cannot split node 'max_1' \(max.dim, module ''\) over tp=2 ranks \(split along dim 2 by "
        r"module "
        r"'layers.0.up'\): it reduces over dim 2"
    )
    with pytest.raises(PassError, match=refusal):
        graph_after(_Scored("features"), make_batch(2, seed=0), "tensor_parallel", tp=2)
