"""The cp pass under each ``cp_comm_type`` (issue 48), on the graph (no ranks): which ops
each attention becomes, what is refused and why, and the configuration's checks. Parity:
tests/parity/test_long_context.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fxmeg.config import ParallelConfig
from fxmeg.errors import ConfigError, PassError
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import hf_model

fx_ops, aten = torch.ops.fxmeg, torch.ops.aten
ATTENTION = (fx_ops.cp_attention.default, fx_ops.cp_ring_attention.default,
             fx_ops.cp_to_heads.default, fx_ops.cp_from_heads.default, fx_ops.cp_gather.default,
             aten.scaled_dot_product_attention.default)


def _ops(cp: int, mode: str, **kw) -> Counter:
    gm = graph_after(hf_model("llama", heads=8, kv_heads=4), make_batch(2, seed=0),
                     "context_parallel", cp=cp, cp_comm_type=mode, **kw)
    return Counter(n.target for n in gm.graph.nodes if n.target in ATTENTION)


@pytest.mark.parametrize("cp,mode,extra,want", [
    (2, "all_gather", {}, {fx_ops.cp_attention.default: 2}),
    (2, "p2p", {}, {fx_ops.cp_ring_attention.default: 2}),
    (2, "a2a", {}, {fx_ops.cp_to_heads.default: 6, aten.scaled_dot_product_attention.default: 2,
                    fx_ops.cp_from_heads.default: 2}),
    (4, "a2a+p2p", {"cp_a2a_size": 2}, {fx_ops.cp_to_heads.default: 6,
                                        fx_ops.cp_ring_attention.default: 2,
                                        fx_ops.cp_from_heads.default: 2}),
])
def test_each_mode_exchanges_as_named(cp, mode, extra, want):
    """Each of the 2 layers' attention: gathered keys (all_gather), the ring (p2p), q, k
    and v to heads around a whole-sequence SDPA and back (a2a), both (a2a+p2p); nothing
    else meets the keys."""
    assert _ops(cp, mode, **extra) == want


def test_the_ring_reads_the_padding_mask_whole():
    """A mask the model builds from an attention_mask input reaches the ring whole (the
    kernel picks each block's rows and columns), not cut to this rank's rows."""
    from tests.parity.test_keyword_batches import PAD, padded

    batch = {k: t[:2] for k, t in padded(2, seed=1, side="left").items()}
    gm = graph_after(hf_model("llama", pad_token_id=PAD), batch, "context_parallel", cp=2,
                     cp_comm_type="p2p")
    rings = [n for n in gm.graph.nodes if n.target == fx_ops.cp_ring_attention.default]
    assert len(rings) == 2
    for ring in rings:
        mask = ring.args[3].meta["val"]
        assert mask is not None and mask.shape[-2:] == (16, 16), mask.shape
        assert ring.args[4] is False  # the mask says causal itself


def test_a2a_refuses_heads_it_cannot_split_and_says_what_would():
    """2 heads over cp=4: the node, the counts, and the sizes that divide (2, as
    cp_a2a_size of a2a+p2p), before any rank exists. (Hugging Face's sdpa path repeats the
    key/value heads to the query heads before SDPA: those are the counts the exchange
    meets.)"""
    with pytest.raises(PassError) as err:
        graph_after(hf_model("llama", heads=2, kv_heads=2), make_batch(2, seed=0),
                    "context_parallel", cp=4, cp_comm_type="a2a")
    message = str(err.value)
    assert "scaled_dot_product_attention" in message
    assert "splits its 2 query and 2 key/value heads over cp=4 ranks" in message
    assert "cp_comm_type='p2p'" in message and "a cp in [2]" in message


def test_a2a_counts_the_heads_of_each_tp_rank():
    """At tp=2 each rank holds 2 of the 4 heads: a2a over cp=2 divides them, over cp=4 it
    does not."""
    ok = graph_after(hf_model("llama", heads=4, kv_heads=4), make_batch(2, seed=0),
                     "context_parallel", cp=2, tp=2, cp_comm_type="a2a")
    assert any(n.target == fx_ops.cp_to_heads.default for n in ok.graph.nodes)
    with pytest.raises(PassError, match="on each of tp=2 ranks over cp=4"):
        graph_after(hf_model("llama", heads=4, kv_heads=4), make_batch(2, seed=0),
                    "context_parallel", cp=4, tp=2, cp_comm_type="a2a")


def test_eager_attention_is_refused_outside_all_gather():
    with pytest.raises(PassError, match="attn_implementation='sdpa'"):
        graph_after(hf_model("llama", attn_implementation="eager"), make_batch(2, seed=0),
                    "context_parallel", cp=2, cp_comm_type="p2p")


@pytest.mark.parametrize("kw,says", [
    (dict(cp=2, cp_comm_type="ring"), "cp_comm_type='ring' is not one of ['all_gather', 'p2p', "
                                      "'a2a', 'a2a+p2p']"),
    (dict(cp=2, cp_comm_type="P2P"), "did you mean 'p2p'"),
    (dict(cp=4, cp_comm_type="a2a+p2p"), "cp_a2a_size is not given: use one of [2]"),
    (dict(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=3),
     "cp_a2a_size=3 does not divide cp=4: use one of [2]"),
    (dict(cp=4, cp_comm_type="a2a+p2p", cp_a2a_size=4),
     "cp_a2a_size=4 leaves no ring (that is 'a2a')"),
    (dict(cp=2, cp_comm_type="a2a+p2p", cp_a2a_size=2), "cp=2 has none: use cp_comm_type='a2a'"),
    (dict(cp=4, cp_comm_type="a2a", cp_a2a_size=2), "not of 'a2a': drop it"),
])
def test_the_configuration_refuses_by_name(kw, says):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**kw)
    assert says in str(err.value), str(err.value)


def test_the_inner_size_of_each_mode():
    assert [ParallelConfig(cp=4, cp_comm_type=m, **kw).cp_inner for m, kw in (
        ("all_gather", {}), ("p2p", {}), ("a2a", {}), ("a2a+p2p", {"cp_a2a_size": 2}))] == [
        1, 1, 4, 2]
