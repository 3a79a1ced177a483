"""The layout search on a CPU (fxmeg/planner/calibrate.py): the twin's measured steps per
intra-layer layout turned into the time model's numbers, without starting processes (the
measurements are made up from a known model, and the fit must find it again). Measured
against real runs: bench/search_check.py."""

import dataclasses
import json

import pytest
import torch

from fxmeg.planner import calibrate
from fxmeg.planner.calibrate import Timing, time_keys
from fxmeg.planner.cluster import cluster
from fxmeg.planner.estimate import Composer, collective
from fxmeg.planner.profile import Key, deeper
from fxmeg.planner.search import Layout, Searcher
from tests.planner.test_search import _example, _gpt


def _cpu_like():
    """A cluster that does not overlap communication, as ``local`` (no machine timing)."""
    return dataclasses.replace(cluster("h100:ranks_per_node=2"), overlap=False)


def test_timing_reads_a_microbatch_its_blocks_and_the_rest_of_a_step():
    # (1 sample, 1 micro-batch), (1, 4), (2, 2) of the twin: 0.1 + m (0.2 + 0.05 (samples
    # - 1)); (1, 1), (1, 4) with each block twice: 0.1 + 0.3 m
    t = Timing.of([0.3, 0.9, 0.6, 0.4, 1.3], peak=5)
    assert t.microbatch == pytest.approx((0.2, 0.25)) and t.fixed == pytest.approx(0.1)
    assert t.per_microbatch(4) == pytest.approx(0.35)
    assert t.split == pytest.approx((0.1, 0.1))  # the blocks once more: 0.3 - 0.2
    assert Timing.of([0.3, 0.9, 0.6, 0.3, 0.9], 5).split is None  # blocks took nothing
    assert t.sharded is None
    # (1, 1), (1, 4) at zero=2, 0.1 + m (0.2 + 0.03): each micro-batch's gradients
    # reduced in 30 ms
    assert Timing.of([0.3, 0.9, 0.6, 0.4, 1.3, 0.33, 1.02], 5).sharded == pytest.approx(0.03)


def test_calibration_finds_the_model_it_was_measured_from(monkeypatch):
    """Timings made by a composer whose ops run 3x their roofline plus 20 us each; under
    tp2 the blocks take twice and the rest 1.5x what it says, every step 10 ms besides
    its micro-batches, and zero=2's reduction 3x the ring formula's. The search fits the
    slowdown and per-op cost back from the plain key, the two factors of tp2 alone, adds
    the 10 ms to every step, and takes zero=2's reduction 3x."""
    cpu = _cpu_like()
    truth = Searcher(_gpt(), _example(), cluster=cpu, global_batch_size=8, precision="fp32")
    assert len(deeper(truth.twin).layers) == 2 * len(truth.twin.model.layers)
    twin = Composer(cpu, "fp32", truth.twin.own, (), truth.profile(Key()), truth.tokens)
    twin.calibrate(3.0, 2e-5, 0)
    tp2, made = Key(tp=2), {}
    for key, (on_blocks, on_rest) in ((Key(), (1.0, 1.0)), (tp2, (2.0, 1.5))):
        prof = truth.profile(key)
        per = []
        for samples in (1, 2):
            blocks, rest = twin._twin_seconds(prof, samples)
            per.append(on_blocks * blocks + on_rest * rest)
        est = twin.estimate(prof, truth._twin_config(key))
        fixed = 0.01 + est.breakdown["comm_dp"] + est.breakdown["optimizer"]
        again = on_blocks * twin._twin_seconds(prof, 1)[0]
        grads = est.stages[0].gradients
        sharded = 3 * collective("reduce_scatter", grads, 2, cpu.link(1, 2)) if key == Key() \
            else None
        made[key] = Timing(tuple(per), fixed, per[0] + again, sharded, 100 * 2**20)
    monkeypatch.setattr("fxmeg.planner.search.time_keys", lambda *a, **k: made)

    s = Searcher(_gpt(), _example(), cluster=cpu, global_batch_size=8, precision="fp32")
    s.calibrate([tp2])
    slow, per_op = s.composer.calibration
    assert slow == pytest.approx(3.0, rel=1e-6) and per_op == pytest.approx(2e-5, rel=1e-6)
    assert s.composer.measured[tp2][1] == pytest.approx((2.0, 1.5))
    prof = s.profile(tp2)
    for samples in (1, 4):  # the real model: twice the twin's blocks, the same rest
        blocks, rest = twin._twin_seconds(prof, samples)
        want = 2.0 * 2 * blocks + 1.5 * rest
        assert s.composer.microbatch_seconds(prof, samples) == pytest.approx(want)
    assert s.estimate(Layout(dp=2)).breakdown["overhead"] == pytest.approx(0.01)
    assert s.estimate(Layout(tp=2)).breakdown["overhead"] == pytest.approx(0.01)
    assert s.composer.sharded == pytest.approx(3.0)
    one, two = (s.estimate(Layout(dp=2, zero=z)) for z in (1, 2))
    link = cpu.link(1, 2)
    scatter = collective("reduce_scatter", one.stages[0].gradients, 2, link)
    assert two.breakdown["comm_dp"] - one.breakdown["comm_dp"] == pytest.approx(
        (4 * 3 - 1) * scatter)  # m = 4 micro-batches
    # the reserve: the first key's measured peak over what the model counts for its run
    counted = twin.estimate(truth.profile(Key()), truth._twin_config(Key())).peak
    assert s.composer.reserved == 100 * 2**20 - counted


def test_zero_2_and_3_reduce_every_microbatch():
    """Sharded gradients are reduced after each micro-batch (the runtime's ZeroBuffer):
    without overlap, zero=2's reduction is m reduce-scatters, zero=1's one."""
    s = Searcher(_gpt(), _example(), cluster=_cpu_like(), global_batch_size=8,
                 precision="fp32")
    one, two = (s.estimate(Layout(dp=2, zero=z)) for z in (1, 2))
    link = s.cluster.link(1, 2)
    scatter = collective("reduce_scatter", one.stages[0].gradients, 2, link)
    gather = collective("all_gather", one.stages[0].parameters, 2, link)
    assert one.breakdown["comm_dp"] == pytest.approx(scatter + gather)
    assert two.breakdown["comm_dp"] == pytest.approx(4 * scatter + gather)  # m = 4


def test_timings_are_cached_per_model_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEG_CACHE", str(tmp_path))
    model, example = _gpt(), _example()
    path = calibrate.cache_path(model, example, {}, 2)
    keys = [Key(), Key(tp=2)]
    steps = [0.3, 0.9, 0.6, 0.4, 1.3]
    with open(path, "w") as f:
        json.dump({repr(k): {"steps": steps, "peak": 7} for k in keys}, f)

    def no_spawn(*args, **kwargs):
        raise AssertionError("timed again")
    monkeypatch.setattr(torch.multiprocessing, "spawn", no_spawn)
    found = time_keys(model, model, example, keys, 2)
    assert found[Key(tp=2)] == Timing.of(steps, 7)
    with pytest.raises(AssertionError, match="timed again"):  # a new key is measured
        time_keys(model, model, example, [*keys, Key(cp=2)], 2)
    assert calibrate.cache_path(model, example, {}, 4) != path
