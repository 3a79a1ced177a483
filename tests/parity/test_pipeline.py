"""Pipeline parallelism on real gloo ranks vs plain single-device PyTorch.

Every scenario trains 5 steps with uneven ignored-label counts per micro-batch and
compares the loss of every step, the grad norm and every weight with the reference;
the executor's own counters show the in-flight bound and the deallocation of every
sent activation.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import fxmeg
from fxmeg.diagnostics.measured_activations import SavedBytes
from tests.harness.distributed import run_worlds
from tests.harness.helpers import assert_bitwise, make_batch, optimizer
from tests.harness.models import make_model
from tests.parity.scenarios import MBS, Scenario, check_parity, train_each

CONFIGS = [(2, 1, "1f1b", 4), (4, 1, "1f1b", 8), (2, 1, "gpipe", 4), (2, 2, "interleaved", 4),
           (4, 2, "interleaved", 8), (2, 1, "1f1b", 3)]
PARITY = [Scenario(model, *c) for c in CONFIGS for model in ("gpt", "llama")] + [
    # compiled chunks, whole blocks recomputed, sent activations freed: all at once
    Scenario("gpt", 2, 1, "1f1b", 4, options=(("compile", True), ("recompute", "full"))),
    Scenario(
        "llama",
        2,
        2,
        "interleaved",
        4,
        options=(("recompute", "full"), ("recompute_num_layers", 1)),
    ),
]
BITWISE = [Scenario("llama", pp, 1, "1f1b", 4, clip=0.0) for pp in (2, 4)]
SCENARIOS = PARITY + BITWISE


BAD_CONFIGS = {  # on 2 ranks, each must fail before any process group exists
    "pp*vpp > blocks": (
        dict(pp=2, vpp=4, global_batch_size=2 * 2),
        "pp * vpp = 8 chunks, but the model has only 4 blocks",
    ),
    "interleaved m": (
        dict(pp=2, vpp=2, global_batch_size=2 * 3),
        "interleaved schedule needs the micro-batch count m to be a multiple of pp=2",
    ),
    "split point": (dict(pp=2, split_points=["layers.9"]), "split point 'layers.9' names no block"),
}


def refuse_bad_configs() -> dict:
    before = c10d._world.group_count
    messages = {}
    for name, (kwargs, _) in BAD_CONFIGS.items():
        try:
            fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), **kwargs)
        except fxmeg.FxmegError as err:
            messages[name] = str(err)
    return dict(messages=messages, new_groups=c10d._world.group_count - before)


def stage_activations() -> dict:
    """Peak bytes autograd keeps on this rank over one 1F1B step, per recompute mode."""
    out = {}
    for mode in ("none", "full"):
        engine = Scenario("gpt", 2, 1, "1f1b", 4, options=(("recompute", mode),)).engine()
        meter = SavedBytes(engine.named_parameters.values())
        with meter.hooks():
            engine.train_step(make_batch(MBS * 4, seed=1))
        out[mode] = meter.peak
    return out


def run(rank: int, scenarios: list[Scenario]) -> dict:
    out = train_each(rank, scenarios)
    if dist.get_world_size() == 2:
        out["refused"] = refuse_bad_configs()
        out["activations"] = stage_activations()
    return out


@pytest.fixture(scope="module")
def results():
    return run_worlds(run, SCENARIOS, (2, 4))  # world size = pp: keyed by pp


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_parity(results, sc):
    check_parity([r[sc.id] for r in results[sc.pp]], sc)


@pytest.mark.parametrize("sc", [s for s in PARITY if s.schedule == "1f1b"], ids=lambda s: s.id)
def test_first_stage_holds_at_most_pp_microbatches(results, sc):
    first = next(r[sc.id] for r in results[sc.pp] if r[sc.id]["pp_rank"] == 0)
    assert max(c.peak_in_flight for c in first["counters"]) == min(sc.pp, sc.m)


@pytest.mark.parametrize("sc", PARITY, ids=lambda s: s.id)
def test_every_sent_activation_is_freed(results, sc):
    for r in results[sc.pp]:
        for c in r[sc.id]["counters"]:
            assert c.deallocated == c.sent_for_dealloc
            if r[sc.id]["pp_rank"] < sc.pp - 1 or sc.vpp > 1:  # every chunk but the last sends
                assert c.sent_for_dealloc == sc.m * (
                    sc.vpp if r[sc.id]["pp_rank"] < sc.pp - 1 else sc.vpp - 1
                )


@pytest.mark.parametrize("sc", BITWISE, ids=lambda s: s.id)
def test_pipeline_does_not_change_the_arithmetic(results, sc):
    """Llama (no tied weights), clipping off: pp > 1 is bitwise the same engine at pp=1."""
    batches = sc.batches()
    single = fxmeg.parallelize(
        make_model(sc.model, n_layer=sc.layers), tuple(t[:MBS] for t in batches[0]),
        global_batch_size=sc.gbs, optimizer=optimizer, clip_grad=0.0,
    )
    losses = [single.train_step(b).loss for b in batches]
    got = results[sc.pp][0][sc.id]
    assert [s.loss for s in got["steps"]] == losses
    assert_bitwise(got["state"], single.full_state_dict())


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_configs_are_refused_before_process_groups(results, name):
    for rank in results[2]:
        assert BAD_CONFIGS[name][1] in rank["refused"]["messages"][name]
        assert rank["refused"]["new_groups"] == 0


def test_full_recompute_keeps_under_a_third_of_stage_0_activations(results):
    """Acceptance: with every block recomputed, the first stage (two micro-batches in
    flight under 1F1B at pp=2) keeps at most a third of the activations it keeps without."""
    first = next(
        r["activations"] for r in results[2] if r["gpt-dp1-pp2-vpp1-1f1b-m4"]["pp_rank"] == 0
    )
    assert first["full"] <= first["none"] / 3, first
