"""Numerical and process faults on real gloo ranks: an inf / NaN gradient on one rank,
a rank that stops answering in the middle of a pipeline schedule."""

from __future__ import annotations

import time

import pytest
import torch

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import make_batch
from tests.harness.models import make_model

BAD_STEP = 2


def nan_on_one_rank(rank: int, precision: str, on_nonfinite: str) -> dict:
    """dp=2: rank 0's gradient of one weight becomes NaN at step 2."""
    batches = [make_batch(8, seed=s) for s in range(5)]
    engine = fxmeg.parallelize(
        make_model("gpt"),
        tuple(t[:2] for t in batches[0]),
        global_batch_size=8,
        precision=precision,
        on_nonfinite=on_nonfinite,
    )
    out = {"steps": []}
    for step, batch in enumerate(batches):
        handle = None
        if step == BAD_STEP:
            before = _snapshot(engine)
            if rank == 0:
                p = engine.named_parameters["layers.1.mlp.fc.weight"]
                handle = p.register_hook(lambda g: torch.full_like(g, float("nan")))
        try:
            out["steps"].append(engine.train_step(batch))
        except fxmeg.FxmegError as err:
            return out | {"error": str(err)}
        if handle is not None:
            handle.remove()
        if step == BAD_STEP:
            out["unchanged"] = _snapshot(engine) == before
    return out


def _snapshot(engine) -> tuple:
    params = tuple(
        p.detach().float().clone().numpy().tobytes() for p in engine.named_parameters.values()
    )
    state = tuple(v.clone().numpy().tobytes() for s in engine.context.optimizer.inner.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    return params, state


def stops_answering(rank: int) -> dict:
    """pp=2, 1F1B: rank 1 hangs in its third forward; rank 0 must not wait forever."""
    batches = [make_batch(8, seed=s) for s in range(2)]
    engine = fxmeg.parallelize(make_model("llama"), tuple(t[:2] for t in batches[0]), pp=2,
                               global_batch_size=8, comm_timeout_s=3)
    engine.train_step(batches[0])  # a healthy step first
    if rank == 1:
        chunk = engine.context.chunks[1]
        calls = {"n": 0}
        original = chunk.forward

        def hang(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                time.sleep(8)  # stops answering (well past the 3 s timeout)
            return original(*args)

        chunk.forward = hang
    start = time.monotonic()
    try:
        engine.train_step(batches[1])
    except Exception as err:  # rank 1 fails too once rank 0 has given up
        return {"error": str(err), "waited": time.monotonic() - start}
    return {"error": None, "waited": time.monotonic() - start}


def run(rank: int) -> dict:
    out = {(p, o): nan_on_one_rank(rank, p, o) for p in ("fp32", "bf16") for o in ("skip", "raise")}
    out["hang"] = stops_answering(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(results, precision):
    for r in results:
        got = r[(precision, "skip")]
        assert "error" not in got
        assert [s.skipped for s in got["steps"]] == [i == BAD_STEP for i in range(5)]
        assert got["steps"][BAD_STEP].skip_reason == "nonfinite"
        assert got["unchanged"]  # weights and optimizer state untouched
        assert all(
            s.loss == s.loss and s.grad_norm is not None
            for i, s in enumerate(got["steps"])
            if i != BAD_STEP
        )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_raise_names_the_parameter_and_rank(results, precision):
    for r in results:
        got = r[(precision, "raise")]
        assert len(got["steps"]) == BAD_STEP
        assert "gradient of 'layers.1.mlp.fc.weight' holds inf or NaN on rank 0" in got["error"]


def test_a_rank_that_stops_answering_fails_the_others_by_name(results):
    rank0 = results[0]["hang"]
    assert rank0["error"] is not None and rank0["waited"] < 3 + 4  # the timeout, not forever
    msg = rank0["error"]
    assert "pipeline stage 0 waited 3 s" in msg
    assert "rank 1 (pipeline stage 1)" in msg
    assert "rank 0: step" in msg and ">>" in msg  # the failing action, marked in the schedule
