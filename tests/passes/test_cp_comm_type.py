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
     "cp_a2a_size=4 leaves no ring (that is cp_comm_type='a2a')"),
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


# ---------------------------------------------------------------- what the planner counts


def _llama_plan(mode: str, **kw):
    import fxmeg
    from models.llama import Llama, LlamaConfig

    seq = 4096
    with torch.device("meta"):
        model = Llama(LlamaConfig(seq_len=seq, n_layer=2, n_head=4, n_kv_head=4, n_embd=128,
                                  ffn_hidden=256))
    ids = torch.zeros(1, seq, dtype=torch.long)
    return fxmeg.plan(model, (ids, ids), cp=4, cp_comm_type=mode, global_batch_size=1, **kw)


def test_fxmeg_plan_counts_each_modes_attention_working_set():
    """At sequence 4096 over cp=4 (1024 queries a rank, 4 heads): all_gather's backward holds
    five tensors of fp32 scores over every key (5 x 4 x 4 x 1024 x 4096 bytes) and the
    gathered K and V; the ring four 1024 x 1024 blocks of scores and two blocks of K/V with
    their gradients; a2a's SDPA is a fused kernel. The stage totals differ by as much."""
    plans = {m: _llama_plan(m, **({"cp_a2a_size": 2} if m == "a2a+p2p" else {}))
             for m in ("all_gather", "p2p", "a2a", "a2a+p2p")}
    held = {m: p.stages[0].attention_working_set for m, p in plans.items()}
    kv = 2 * 4 * 1024 * 32 * 4  # this rank's k and v, fp32
    assert held["all_gather"] == 5 * 4 * 4 * 1024 * 4096 + 4 * kv
    assert held["p2p"] == 4 * 4 * 4 * 1024 * 1024 + 2 * kv + 2 * kv
    assert held["a2a"] == 0
    assert held["a2a+p2p"] == 4 * 4 * 2 * 2048 * 2048 + 2 * kv + 2 * kv  # 2 heads, 2048 rows
    base = {m: p.stages[0].total - held[m] for m, p in plans.items()}
    # the ring keeps its output and log-sum-exp (fp32) in each of the 2 layers
    assert base["p2p"] == base["all_gather"] + 2 * (1024 * 4 * 32 * 4 + 1024 * 4 * 4)
    assert "cp_comm_type p2p: one attention's backward holds" in str(plans["p2p"])


def test_the_time_model_knows_each_modes_traffic():
    """a2a: q, k, v to heads and the output back, each an all-to-all forward and backward;
    p2p: the ring's K/V passes, hidden behind its blocks' FLOPs, and in backward their fp32
    gradients too; exposed is only what the compute does not cover."""
    from types import SimpleNamespace

    from fxmeg.planner.cluster import Link
    from fxmeg.planner.estimate import Composer
    from fxmeg.planner.profile import Comm, _comm

    def comms(mode):
        gm = graph_after(hf_model("llama", heads=8, kv_heads=4), make_batch(2, seed=0),
                         "context_parallel", cp=2, cp_comm_type=mode)
        return [c for n in gm.graph.nodes for c in _comm(n)]

    a2a = comms("a2a")
    assert sorted({(c.kind, c.backward) for c in a2a}) == [("all_to_all", False),
                                                            ("all_to_all", True)]
    assert len(a2a) == 2 * 2 * 4  # 2 layers, forward and backward, q, k, v and the output
    ring = comms("p2p")
    assert len(ring) == 4 and all(c.hidden_by > 0 for c in ring)
    fwd, bwd = ring[:2]
    # backward: K/V and their fp32 gradients (the model is fp32: twice the bytes)
    assert bwd.nbytes == fwd.nbytes * 2 and bwd.hidden_by == 2 * fwd.hidden_by

    link, rate = Link(bandwidth=1e9, latency=0.0), 1e12
    me = SimpleNamespace(rate=rate)
    comm = Comm("cp", "all_gather", 4_000_000_000, False, hidden_by=1e12)  # 2 s of traffic, 1 s
    assert Composer._comm(me, comm, 1, 2, link) == pytest.approx(1.0)
    assert Composer._comm(me, Comm("cp", "all_gather", 4_000_000_000, False), 1, 2,
                          link) == pytest.approx(2.0)


def test_the_flags_and_the_config_file_set_it(tmp_path):
    """`fxmeg train --cp 4 --cp-comm-type a2a+p2p --cp-a2a-size 2` parses to the config's
    names and types, and the same keys read from a config file make the engine's config."""
    import argparse

    from fxmeg.train.cli import _train_parser
    from fxmeg.train.flags import read_config
    from fxmeg.train.train_config import engine_from_flat

    parser = argparse.ArgumentParser()
    _train_parser(parser)
    args = parser.parse_args(["--cp", "4", "--cp-comm-type", "a2a+p2p", "--cp-a2a-size", "2"])
    flags = engine_from_flat(cp=args.cp, cp_comm_type=args.cp_comm_type,
                             cp_a2a_size=args.cp_a2a_size).parallel
    assert (flags.cp_comm_type, flags.cp_a2a_size, flags.cp_inner) == ("a2a+p2p", 2, 2)
    path = tmp_path / "run.toml"
    path.write_text('cp = 2\ncp_comm_type = "a2a"\n')
    read = engine_from_flat(**read_config(str(path))).parallel
    assert (read.cp, read.cp_comm_type, read.cp_inner) == (2, "a2a", 2)
