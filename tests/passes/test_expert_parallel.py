"""The expert-parallel pass (fxmeg/passes/expert_parallel.py) in one process: each Hugging
Face grouped-experts block, and each batched-experts block (Llama 4's;
fxmeg/passes/ep_batched.py), becomes one ``routed_experts`` node computing the same values,
its banks tagged with their split and local shapes; ep=1 changes nothing."""

import pytest
import torch
from torch import nn

from fxmeg.ir import ops
from fxmeg.ir.layouts import ExpertShard
from fxmeg.ir.program import chunks
from fxmeg.passes.graph_utils import val
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import MOE, tiny_moe


def _nodes(parent, pred):
    return [n for gm in chunks(parent) for n in gm.graph.nodes if pred(n)]


def _grouped(n) -> bool:
    return "grouped_mm" in str(n.target)


@pytest.mark.parametrize("kind", sorted(MOE))
def test_each_block_becomes_one_routed_experts_node_computing_the_same(kind):
    batch = make_batch(2, seed=0, vocab=96)
    before = graph_after(tiny_moe(kind), batch, "expert_parallel", dp=2)
    after = graph_after(tiny_moe(kind), batch, "expert_parallel", ep=2, dp=2)
    # DeepSeek-V3,
    moe_layers = sum(n.endswith(".experts") for n, _ in tiny_moe(kind).named_modules())
    # AFMoE: the first layer is dense
    assert len(_nodes(before, _grouped)) == 2 * moe_layers and not _nodes(
        before, lambda n: n.target is ops.routed_experts
    )
    calls = _nodes(after, lambda n: n.target is ops.routed_experts)
    assert len(calls) == moe_layers and not _nodes(after, _grouped)
    assert [
        (c.kwargs["num_experts"], c.kwargs["group"], c.kwargs["capacity_factor"]) for c in calls
    ] == [(4, "ep", None)] * moe_layers
    banks = _nodes(after, lambda n: n.op == "get_attr" and "ep" in n.meta.get("fxmeg", {}))
    assert len(banks) == moe_layers * (4 if kind == "gpt_oss" else 2)  # GPT-OSS: two bias banks too
    for b in banks:
        assert b.meta["fxmeg"]["ep"] == ExpertShard(4) and val(b).shape[0] == 2, b.target
    with torch.no_grad():  # unbound, every expert is local: the parent graph computes what it did
        want, got = before(*batch), after(*batch)
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6) and torch.equal(got[1], want[1])


def test_global_router_loss_wraps_the_tokens_per_expert_and_is_refused_without_a_router_loss():
    """global_aux_loss: the factor of the router loss's product that no gradient flows
    through (tokens per expert) goes through ops.global_tokens, once; a model that
    computes no router loss is refused by name; recompute is not."""
    import fxmeg
    from fxmeg.errors import ConfigError, PassError
    from tests.harness.models import hf_model

    batch = make_batch(2, seed=0)
    parent = graph_after(
        hf_model("mixtral"),
        batch,
        "expert_parallel",
        moe_router_load_balancing_type="global_aux_loss",
    )
    (mean,) = _nodes(parent, lambda n: n.target is ops.global_tokens)
    assert mean.args[0].target == torch.ops.aten.div.Tensor and mean.kwargs == {"group": "dp"}
    (product,) = mean.users
    assert product.target == torch.ops.aten.mul.Tensor
    with pytest.raises(PassError, match="computes no router loss .* output_router_logits=True"):
        fxmeg.transform(
            tiny_moe("mixtral", vocab_size=128),
            batch,
            moe_router_load_balancing_type="global_aux_loss",
        )
    # recompute runs: Hugging Face's router loss follows the blocks, outside every region
    # (one inside a region replays its value: test_recompute.py's once test)
    program = fxmeg.transform(
        hf_model("mixtral"), batch, moe_router_load_balancing_type="global_aux_loss",
        recompute="full",
    )
    (chunk,) = program.chunks
    assert [n for n in chunk.graph.nodes if n.target is ops.global_tokens]
    with pytest.raises(ConfigError, match="is not one of"):
        fxmeg.transform(hf_model("mixtral"), batch, moe_router_load_balancing_type="global")


class BatchedExperts(nn.Module):
    """Llama 4's experts written out in plain PyTorch (no transformers class: the pass reads
    the graph): every expert runs over every token (``bmm`` over [E, T, H] slots), each
    token's rows scaled by its router scores, which a top-k and a scatter into a row of
    -inf make zero, through the sigmoid, outside its top-k. ``scores="softmax"``: the
    scores of every expert (none zero); ``shift``: an activation that maps zero to nonzero."""

    def __init__(self, scores: str = "top-k", shift: float = 0.0):
        super().__init__()
        self.scores, self.shift = scores, shift
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict(
                    {
                        "emb": nn.Embedding(128, 16),
                        "router": nn.Linear(16, 4),
                        "head": nn.Linear(16, 128),
                    }
                )
            ]
        )
        self.gate_up = nn.Parameter(torch.randn(4, 16, 64) * 0.1)  # [E, H, 2I]
        self.down = nn.Parameter(torch.randn(4, 32, 16) * 0.1)  # [E, I, H]

    def forward(self, ids, labels):
        layer = self.layers[0]
        h = layer["emb"](ids)
        x = h.reshape(-1, 16)  # (T, H)
        logits = layer["router"](x)
        if self.scores == "softmax":
            scores = logits.softmax(-1)
        else:
            top, index = torch.topk(logits, 2, dim=1)
            scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top).sigmoid()
        rows = x.repeat(4, 1) * scores.transpose(0, 1).reshape(-1, 1)  # (E * T, H), expert-major
        gate, up = torch.bmm(rows.view(4, -1, 16), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(nn.functional.silu(gate) * up + self.shift, self.down)
        y = h + out.view(-1, 16).reshape(4, -1, 16).sum(0).view_as(h)
        return nn.functional.cross_entropy(layer["head"](y).flatten(0, 1), labels.flatten())


def _bank_matmuls(parent) -> list:
    return _nodes(parent, lambda n: n.target is torch.ops.aten.bmm.default)


@pytest.mark.parametrize("model", ["llama4_text", "plain"])
def test_batched_experts_become_one_routed_experts_node_with_the_weights_on_their_input(model):
    """Llama 4 as transformers builds it, and the same form written out: at ep=2 one
    ``routed_experts`` node per block (probs_on_input; the weights gathered from the
    scores at the top-k index) replaces the two bank matmuls; each rank's banks hold 2 of
    the 4 experts; unbound (every expert local) it computes the loss it did."""
    torch.manual_seed(0)
    make = (lambda: tiny_moe("llama4_text")) if model == "llama4_text" else BatchedExperts
    batch = make_batch(2, seed=0, vocab=96)
    torch.manual_seed(0)
    before = graph_after(make(), batch, "expert_parallel", dp=2)
    torch.manual_seed(0)
    after = graph_after(make(), batch, "expert_parallel", ep=2, dp=2)
    assert len(_bank_matmuls(before)) == 2 and not _bank_matmuls(after)
    (call,) = _nodes(after, lambda n: n.target is ops.routed_experts)
    assert (call.kwargs["num_experts"], call.kwargs["probs_on_input"]) == (4, True)
    assert call.args[3].target == torch.ops.aten.gather.default and tuple(
        val(call.args[3]).shape
    ) == (32, 2)
    assert len(_nodes(before, lambda n: n.target is ops.expert_load)) == 1  # counted at ep=1 too
    banks = _nodes(after, lambda n: n.op == "get_attr" and "ep" in n.meta.get("fxmeg", {}))
    assert sorted(tuple(val(b).shape) for b in banks) == (
        [(2, 32, 96), (2, 48, 32)] if model == "llama4_text" else [(2, 16, 64), (2, 32, 16)])
    with torch.no_grad():
        want, got = before(*batch), after(*batch)
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (
            {"scores": "softmax"},
            "cannot show that the routing scores 'softmax' .* are zero outside each token's top-k",
        ),
        ({"shift": 0.5}, "maps a zero row to a nonzero one"),
    ],
)
def test_batched_experts_that_are_not_routed_are_refused_at_ep2_and_left_alone_at_ep1(
    kwargs, words
):
    """Scores not zero outside the top-k (every expert weighs in), or an activation that
    turns a skipped expert's zero rows into something: running only the picked experts
    would change the values, so ep=2 refuses by name (row ep-batched-experts); at ep=1
    the block is not counted and nothing changes."""
    from fxmeg.errors import PassError

    batch = make_batch(2, seed=0)
    with pytest.raises(PassError, match=words + ".* Fix: train this model with ep=1"):
        graph_after(BatchedExperts(**kwargs), batch, "expert_parallel", ep=2, dp=2)
    parent = graph_after(BatchedExperts(**kwargs), batch, "expert_parallel", dp=2)
    assert len(_bank_matmuls(parent)) == 2 and not _nodes(
        parent, lambda n: n.target is ops.expert_load
    )


class _StrayBank(nn.Module):
    """A depthwise convolution (a 3-D weight, [16, 1, 3]) and, with ``bank``, a 3-D weight
    read by a ``bmm`` with no routing: a bank of experts fxmeg cannot find."""

    def __init__(self, bank: bool):
        super().__init__()
        self.emb, self.head = nn.Embedding(128, 16), nn.Linear(16, 128)
        self.conv = nn.Conv1d(16, 16, 3, groups=16, padding=2)
        self.bank = nn.Parameter(torch.randn(2, 16, 16) * 0.1) if bank else None

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + self.conv(h.transpose(1, 2))[..., : ids.shape[1]].transpose(1, 2)
        if self.bank is not None:
            h = torch.bmm(h.view(2, -1, 16), self.bank).view_as(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_bank_is_what_multiplies_like_experts_never_a_3d_weight_for_its_shape():
    """Issue 68: Qwen3.5-MoE's Gated DeltaNet conv1d weight ([C, 1, K]) was refused at ep=2
    as an expert bank no block reads. A 3-D weight is taken for a bank only when its
    values reach a matmul: the convolution's is left whole (ep=2 captures and splits the
    real banks only), a 3-D weight multiplied with no routing is still refused by name."""
    from fxmeg.errors import PassError

    batch = make_batch(2, seed=0)
    graph_after(_StrayBank(bank=False), batch, "expert_parallel", ep=2, dp=2)
    with pytest.raises(PassError, match="cannot find the routed experts that read 'bank'"):
        graph_after(_StrayBank(bank=True), batch, "expert_parallel", ep=2, dp=2)
    after = graph_after(tiny_moe("qwen3_5_moe_text"), make_batch(2, seed=0, vocab=96),
                        "expert_parallel", ep=2, dp=2)
    banks = {n.target for n in _nodes(after, lambda n: "ep" in n.meta.get("fxmeg", {}))}
    assert banks == {f"model.layers.{i}.mlp.experts.{b}" for i in (0, 1)
                     for b in ("gate_up_proj", "down_proj")}, banks


def test_the_routed_experts_signature_is_written_once():
    """The graph op, its runtime binding and the pass's node all take ``moe.routed_experts``'
    arguments (``moe.as_op``), its exchange replaced by a group name: a new option is
    added in one place, and a node written with a misspelt one fails at once."""
    import inspect

    from fxmeg.ir import moe
    from fxmeg.runtime import experts

    want = [
        p.name.replace("exchange", "group")
        for p in inspect.signature(moe.routed_experts).parameters.values()
        if p.name not in ("drops", "taps")
    ]  # the rank's, given by the binding; a zero-bubble split's matmul results
    for op in (ops.routed_experts, experts.RankExperts().routed_experts):
        assert list(inspect.signature(op).parameters) == want, op
    with pytest.raises(TypeError):
        ops.routed_experts_call(*range(8), num_experts=4, group="ep", capacity_factr=1.0)
