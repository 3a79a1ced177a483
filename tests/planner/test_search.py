"""The layout search (fxmeg/planner): cluster parsing, the time model's parts, legality and
memory against what ``fxmeg.plan`` (the passes themselves) says, and the search's report.
The predictions against measured runs: bench/search_check.py."""

import dataclasses
import json
import random

import pytest
import torch

import fxmeg
from fxmeg.diagnostics.devices import DEVICES
from fxmeg.errors import ConfigError, FxmegError
from fxmeg.planner import report
from fxmeg.planner.cluster import Link, cluster, from_dict
from fxmeg.planner.estimate import Composer, collective, spearman
from fxmeg.planner.profile import twin
from fxmeg.planner.search import Layout, Searcher, candidates, memory_verdict, search
from fxmeg.runtime.pipeline import schedules, simulator
from fxmeg.runtime.pipeline.schedules import Kind
from fxmeg.train.cli import main
from models.gpt import GPT, GPTConfig

SEQ = 128


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=2048, seq_len=SEQ, n_layer=4, n_head=4, n_embd=128))


def _example(rows: int = 1):
    ids = torch.zeros((rows, SEQ), dtype=torch.long, device="meta")
    return ids, ids.clone()


@pytest.fixture(scope="module")
def searcher() -> Searcher:
    return Searcher(_gpt(), _example(), cluster=cluster("h100"), global_batch_size=8,
                    precision="fp32")


def test_cluster_presets_overrides_and_refusals(tmp_path):
    c = cluster("h100:nodes=4")
    assert (c.ranks, c.ranks_per_node, c.device.memory) == (32, 8, DEVICES["h100"])
    h800 = cluster("h800:memory_error=0.05")  # an H100 with NVLink cut to 400 GB/s
    assert h800.device.flops == c.device.flops and h800.device.memory == c.device.memory
    assert h800.intra.bandwidth < c.intra.bandwidth and h800.device.memory_error == 0.05
    c = cluster("h200:nodes=2,memory=120GiB,inter_bandwidth=25e9")
    assert (c.ranks, c.device.memory, c.inter.bandwidth) == (16, 120 * 2**30, 25e9)
    with pytest.raises(ConfigError, match="unknown cluster preset 'h1000'.*h100"):
        cluster("h1000")
    with pytest.raises(ConfigError, match="'gpus=8' is not KEY=VALUE"):
        cluster("h100:gpus=8")
    with pytest.raises(ConfigError, match="memory='lots'"):
        cluster("a100:memory=lots")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(c.to_dict()))
    assert cluster(str(path)) == c == from_dict(c.to_dict())


def test_a_group_crosses_nodes_when_its_span_exceeds_one():
    c = cluster("h100:nodes=2")
    assert c.link(1, 8) is c.intra and c.link(2, 4) is c.intra
    assert c.link(8, 2) is c.inter and c.link(4, 4) is c.inter


def test_ring_collectives():
    link = Link(bandwidth=1e9, latency=0.0)
    assert collective("all_reduce", 4e9, 4, link) == pytest.approx(6.0)  # 2 (n-1)/n S / bw
    assert collective("all_gather", 4e9, 4, link) == pytest.approx(3.0)
    assert collective("all_to_all", 4e9, 4, link) == pytest.approx(3.0)
    assert collective("all_reduce", 4e9, 1, link) == 0.0
    assert collective("all_gather", 0, 8, Link(1e9, 1e-3)) == 0.0
    assert collective("all_gather", 1, 8, Link(1e12, 1e-3)) == pytest.approx(7e-3, rel=1e-3)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 1, 2]) == pytest.approx(0.866, abs=1e-3)


@pytest.mark.parametrize("name,pp,vpp,m", [("1f1b", 4, 1, 32), ("interleaved", 2, 2, 16),
                                           ("zbh1", 4, 1, 24), ("dualpipev", 2, 2, 16),
                                           ("gpipe", 2, 1, 9)])
def test_the_steady_state_extrapolates_the_simulator(searcher, name, pp, vpp, m):
    """The time model simulates a few micro-batches and extrapolates; the whole simulation
    agrees within 2% for uneven chunks (a heavier last chunk, as a head makes)."""
    chunks = pp * vpp
    f = {c: 1.0 + (c == chunks - 1) * 0.7 for c in range(chunks)}
    b = {c: 2 * f[c] for c in range(chunks)}
    makespan, _, _ = searcher.composer.pipeline(name, pp, vpp, m, f, b, 0.01)
    place = fxmeg.config.ParallelConfig(pp=pp, vpp=vpp, schedule=name).placement
    lowered = schedules.lower(schedules.build(name, pp=pp, vpp=vpp, m=m), num_chunks=chunks,
                              p2p="eager", placement=place)
    costs = {(c, k): v for c in range(chunks) for k, v in ((Kind.F, f[c]), (Kind.B, b[c]),
                                                            (Kind.I, b[c] / 2),
                                                            (Kind.W, b[c] / 2))}
    whole = simulator.simulate(lowered, pp=pp, placement=place, costs=costs, latency=0.01)
    assert makespan == pytest.approx(whole.makespan, rel=0.02)


def _deepseek():
    import transformers as T

    cfg = T.DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_hidden_layers=4,
                             first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                             v_head_dim=16, n_group=1, topk_group=1)
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(cfg)


def test_twin_keeps_one_block_of_each_kind():
    model = _deepseek()
    tw = twin(model)
    assert tw.kinds == (0, 1, 1, 1)
    assert len(tw.model.model.layers) == 2 and tw.model.config.num_hidden_layers == 2
    assert twin(_gpt()).kinds == (0, 0, 0, 0) and len(twin(_gpt()).model.layers) == 2
    assert len(model.model.layers) == 4  # the user's model is left whole


def test_routed_experts_count_their_flops_at_every_ep():
    """A MoE block's FLOPs are its attention's, the router's, the shared expert's and each
    routed (token, expert) row's two expert matmuls: transformers' grouped matmuls at ep=1,
    fxmeg's routed-experts op at ep=2 (both counted 0 before, so DeepSeek-V3 was planned at
    171 GFLOPs a token, not its 281 with attention's full square)."""
    from fxmeg.interop.hugging_face import keyword_batch

    ids = torch.zeros((1, 16), dtype=torch.long, device="meta")
    s = Searcher(_deepseek(), keyword_batch(ids, ids), cluster=cluster("h100"),
                 global_batch_size=8, precision="fp32")
    h, dense, expert, k, experts = 64, 128, 32, 2, 4
    mlp = 3 * h * dense  # the dense block's MLP; the MoE block's in its place:
    moe = h * experts + 3 * h * expert + k * 3 * h * expert  # router, shared, routed
    for ep in (1, 2):
        prof = s.profile(Layout(ep=ep, dp=2).key)
        dense_block, moe_block = prof.blocks
        assert moe_block.flops - dense_block.flops == 2 * 16 * (moe - mlp), ep


def test_legality_and_memory_agree_with_the_passes(searcher):
    """A sample of the 4-rank space: the search calls a layout legal exactly when
    ``fxmeg.plan`` (every config check and pass) accepts it, and each stage's predicted
    peak is the plan's (the twin's parts composed over the pipeline cut)."""
    pool = list(candidates(4, 4, 8, experts=False, ranks_per_node=8))
    random.Random(0).shuffle(pool)
    legal = illegal = 0
    for layout in pool[:40]:
        try:
            est = searcher.estimate(layout)
        except FxmegError:
            est = None
        options = layout.options()
        rows = options.pop("micro_batch_size")
        if est is not None and est.split_points:
            options["split_points"] = list(est.split_points)
        try:
            plan = fxmeg.plan(_gpt(), _example(rows), global_batch_size=8, precision="fp32",
                              **options)
        except FxmegError:
            plan = None
        assert (est is None) == (plan is None), layout
        if plan is None:
            illegal += 1
            continue
        legal += 1
        for mine, theirs in zip(est.stages, plan.stages, strict=True):
            tensors = mine.total - mine.reserved - mine.transient  # fxmeg plan's
            assert tensors == pytest.approx(theirs.total, rel=0.05), (layout, mine, theirs)
    assert legal >= 8 and illegal >= 8


def test_search_ranks_fitting_layouts_and_says_how_to_fit():
    model = _gpt()
    result = search(model, _example(), cluster=cluster("h100"), global_batch_size=8,
                    precision="fp32", layout=Layout(tp=2, dp=4, zero=1),
                    space=lambda c: c.recompute == "none" and c.micro_batch_size == 1)
    steps = [r.estimate.step for r in result.ranked]
    assert steps == sorted(steps) and len(steps) > 20
    assert all(r.estimate.peak <= result.cluster.device.memory for r in result.ranked)
    assert 1 <= result.rank_of(Layout(tp=2, dp=4, zero=1)) <= len(steps)
    text = report.text(result, top=5)
    assert "your layout tp2 dp4 zero1" in text and "#1" not in text.splitlines()[0]
    small = search(model, _example(), cluster=cluster("h100:memory=2MiB"),
                   global_batch_size=8, precision="fp32",
                   space=lambda c: c.micro_batch_size == 1 and c.schedule in ("none", "1f1b"))
    assert not small.ranked and small.too_big
    lines = report.nothing_fits(small, None)
    assert "nothing fits: the smallest" in lines[0] and " over 2.0 MiB" in lines[0]


def test_a_layout_within_the_memory_models_error_of_the_cap_is_tight():
    """A search neither ranks nor drops a layout predicted within the device's
    ``memory_error`` of the cap (the model is 10% from measured peaks at worst on this
    machine: a layout 5% under the cap may not fit); the report says so, for the user's own
    layout too."""
    mine, bare = Layout(tp=2, dp=4, zero=1), cluster("h100:reserved=0B")  # tensors alone
    cap = int(Searcher(_gpt(), _example(), cluster=bare, global_batch_size=8,
                       precision="fp32").estimate(mine).peak * 1.05)
    assert [memory_verdict(p, 100, 0.1) for p in (90, 91, 105, 111, 112)] == [
        "fits", "tight", "tight", "tight", "over"]
    result = search(_gpt(), _example(), cluster=bare, global_batch_size=8,
                    precision="fp32", layout=mine, memory=cap,
                    space=lambda c: c.recompute == "none" and c.micro_batch_size == 1
                    and c.schedule in ("none", "1f1b"))
    assert result.ranked and result.tight and result.too_big
    assert all(r.estimate.peak * 1.1 <= cap for r in result.ranked)
    assert all(r.estimate.peak * 0.9 <= cap < r.estimate.peak * 1.1 for r in result.tight)
    assert all(r.estimate.peak * 0.9 > cap for r in result.too_big)
    assert result.rank_of(mine) is None and mine in [r.layout for r in result.tight]
    text = report.text(result, top=3)
    assert f"{len(result.tight)} more are tight" in text
    assert "tp2 dp4 zero1 rc:none mbs1: tight" in text
    assert report.to_dict(result)["tight"] == len(result.tight)


def test_cli_search(capsys):
    args = ["plan", "--search", "--cluster", "h100", "--model", "models.gpt:GPT", "--model-args",
            json.dumps({"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 2048}),
            "--seq-len", str(SEQ), "--global-batch-size", "8", "--quiet", "--top", "3"]
    # two searches, not three: the text of a ranking is test_search_ranks_fitting_layouts'
    assert main([*args, "--recompute", "none", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert len(found["top"]) == 3 and found["top"][0]["step_s"] <= found["top"][1]["step_s"]
    assert found["yours"]["layout"]["recompute"] == "none" and found["yours"]["rank"] >= 1
    assert main([*args, "--device-memory", "1MB"]) == 2
    assert "nothing fits" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown cluster preset"):
        main([*args[:2], "--cluster", "tpu", *args[4:]])


def test_composer_is_shared_per_search(searcher):
    assert isinstance(searcher.composer, Composer)
    assert searcher.composer.sample_flops > 0


def test_full_recompute_saves_what_a_micro_batch_holds_until_its_input_gradient(searcher):
    """Full recompute drops what forward saves, not what the weight gradients read. Under
    1F1B every stage holds less (the last by over a fifth). Under zbh1 the first stage,
    whose I is nearly empty (it holds its saved tensors until W), holds less too; the last
    receives, and from each micro-batch's I to its W it carries the weight matmuls' inputs
    and output gradients, recomputed or not (``profile.check_split``; the bench GPT's block
    carries 3.5 MiB with and without recompute, against 4.0 and 0.25 MiB saved)."""
    def activations(schedule, rc):
        est = searcher.estimate(Layout(pp=2, schedule=schedule, recompute=rc))
        return [s.activations for s in est.stages]
    (first, last), (first_full, last_full) = activations("1f1b", "none"), activations(
        "1f1b", "full")
    assert first_full < first and last_full < 0.8 * last
    (first, last), (first_full, last_full) = activations("zbh1", "none"), activations(
        "zbh1", "full")
    assert first_full < 0.5 * first and last_full > 0.9 * last

def test_a_zero_bubble_rank_holds_the_split_graphs_where_its_memory_is_the_hosts(searcher):
    """The program is rank-free: every rank holds every chunk's split graphs, in host
    memory. Where a rank's memory is the host's (``local``: ``SPLIT_NODE_BYTES`` a node,
    measured) a zero-bubble layout's reserve grows by that per node of the model's split
    graphs; on a GPU (0) and under 1F1B (no split) it does not."""
    host = Searcher(_gpt(), _example(), cluster=cluster("h100:split_node_bytes=1000"),
                    global_batch_size=8, precision="fp32")
    for layout in (Layout(pp=2, schedule="zbh1"), Layout(pp=2, schedule="1f1b")):
        grown = [a.reserved - b.reserved for a, b in zip(
            host.estimate(layout).stages, searcher.estimate(layout).stages, strict=True)]
        if layout.schedule == "1f1b":
            assert grown == [0, 0]
        else:  # the 4-layer GPT's split graphs: hundreds of nodes, the same on each rank
            assert grown[0] == grown[1] and grown[0] % 1000 == 0 and grown[0] > 300_000


def test_a_zero_bubble_layout_over_memory_fits_deferring_fewer_ws():
    """``max_pending_w`` trades a zero-bubble schedule's bubble for what its deferred Ws
    hold (under full recompute, nearly all a micro-batch holds): fewer Ws pending hold
    less and run no faster. A search whose cap a layout misses by its deferred Ws finds it
    again at the most pending Ws that fit (``Searcher.capped``): a layout ``parallelize``
    takes as it is."""
    bare = cluster("h100:reserved=0B")  # the tensors alone
    base = Layout(pp=2, dp=4, schedule="zbh1", recompute="full")  # a node's 8 ranks, m = 8
    s = Searcher(_gpt(), _example(), cluster=bare, global_batch_size=32, precision="fp32")
    est = {k: s.estimate(dataclasses.replace(base, pending_w=k)) for k in (None, 1, 0)}
    assert est[None].peak >= est[1].peak >= est[0].peak and est[0].peak < est[None].peak
    assert est[None].step <= est[1].step <= est[0].step
    cap = int(est[0].peak * 1.1) + 1
    assert memory_verdict(est[None].peak, cap, 0.1) != "fits"
    result = search(_gpt(), _example(), cluster=bare, global_batch_size=32, precision="fp32",
                    memory=cap, space=lambda c: c == base)
    (found,) = result.ranked
    assert found.layout.pending_w in (0, 1) and found.estimate.peak * 1.1 <= cap
    assert f"pending-w{found.layout.pending_w}" in str(found.layout)
    config = s.config(found.layout)
    assert config.parallel.max_pending_w == found.layout.pending_w
    assert Layout.of(config) == found.layout
