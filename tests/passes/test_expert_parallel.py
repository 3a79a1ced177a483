"""The expert-parallel pass (fxmeg/passes/expert_parallel.py) in one process: each Hugging
Face grouped-experts block becomes one ``routed_experts`` node computing the same values,
its banks tagged with their split and local shapes; ep=1 changes nothing."""

import pytest
import torch

from fxmeg import ops
from fxmeg.layouts import ExpertShard
from fxmeg.passes.graph_utils import val
from fxmeg.program import chunks
from tests.helpers import MOE, graph_after, make_batch, tiny_moe


def _nodes(parent, pred):
    return [n for gm in chunks(parent) for n in gm.graph.nodes if pred(n)]


def _grouped(n) -> bool:
    return "grouped_mm" in str(n.target)


@pytest.mark.parametrize("kind", sorted(MOE))
def test_each_block_becomes_one_routed_experts_node_computing_the_same(kind):
    batch = make_batch(2, seed=0, vocab=96)
    before = graph_after(tiny_moe(kind), batch, "expert_parallel", dp=2)
    after = graph_after(tiny_moe(kind), batch, "expert_parallel", ep=2, dp=2)
    moe_layers = sum(n.endswith(".mlp.experts") for n, _ in tiny_moe(kind).named_modules())  # DeepSeek-V3,
    # AFMoE: the first layer is dense
    assert len(_nodes(before, _grouped)) == 2 * moe_layers and not _nodes(before, lambda n: n.target is ops.routed_experts)
    calls = _nodes(after, lambda n: n.target is ops.routed_experts)
    assert len(calls) == moe_layers and not _nodes(after, _grouped)
    assert [(c.kwargs["num_experts"], c.kwargs["group"], c.kwargs["capacity_factor"]) for c in calls] == [
        (4, "ep", None)] * moe_layers
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
    computes no router loss, or recompute, is refused by name."""
    import fxmeg
    from fxmeg.errors import ConfigError, PassError
    from tests.helpers import hf_model

    batch = make_batch(2, seed=0)
    parent = graph_after(hf_model("mixtral"), batch, "expert_parallel", moe_router_load_balancing_type="global_aux_loss")
    (mean,) = _nodes(parent, lambda n: n.target is ops.global_tokens)
    assert mean.args[0].target == torch.ops.aten.div.Tensor and mean.kwargs == {"group": "dp"}
    (product,) = mean.users
    assert product.target == torch.ops.aten.mul.Tensor
    with pytest.raises(PassError, match="computes no router loss .* output_router_logits=True"):
        fxmeg.transform(tiny_moe("mixtral", vocab_size=128), batch, moe_router_load_balancing_type="global_aux_loss")
    with pytest.raises(ConfigError, match="does not run with recompute='full' yet"):
        fxmeg.transform(hf_model("mixtral"), batch, moe_router_load_balancing_type="global_aux_loss",
                        recompute="full")
    with pytest.raises(ConfigError, match="is not one of"):
        fxmeg.transform(hf_model("mixtral"), batch, moe_router_load_balancing_type="global")
