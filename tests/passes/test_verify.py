"""The pass driver and the Ensures checks: every pass runs through ``fxmeg.transform``
(tests set FXMEG_VERIFY=1, so each pass's result is checked), and each check fails on a
graph that breaks what its pass ensures."""

import dataclasses
import logging

import pytest
import torch

import fxmeg
import fxmeg.frontend.pass_driver as driver
from fxmeg.errors import ConfigError
from fxmeg.frontend.pass_driver import NAMES, check_pass
from fxmeg.ir.program import chunks
from fxmeg.passes.recompute import Recompute
from tests.harness.helpers import graph_after, make_batch
from tests.harness.models import make_model

OPTIONS = dict(
    tp=2,
    num_chunks=2,
    dp=2,
    bucket_size=4000,
    distributed_optimizer=True,
    overlap_param_gather=True,
)


def _config(**kw):
    from fxmeg.config import make_config

    return make_config(
        make_batch(2, seed=0),
        world=None,
        tp=2,
        pp=2,
        dp=2,
        distributed_optimizer=True,
        overlap_param_gather=True,
        **kw,
    )


def _after(name):
    return graph_after(make_model("gpt", n_layer=2), make_batch(2, seed=0), name, **OPTIONS)


def test_every_pass_runs_and_verifies(caplog):
    with caplog.at_level(logging.INFO, logger="fxmeg.frontend.pass_driver"):
        program = fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), _config())
    logged = [r.getMessage().split()[0] for r in caplog.records]
    assert logged == ["capture", *NAMES]
    assert len(program.chunks) == 2 and program.placement == (0, 1)
    text = str(program)
    assert "chunk 0 on pp rank 0" in text and "returns the loss" in text and "bucket" in text


def test_dump_graphs_writes_one_file_per_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEG_DUMP_GRAPHS", str(tmp_path))
    fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), _config())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_capture.py"] + [f"{i + 1:02d}_{n}.py" for i, n in enumerate(NAMES)]
    assert "chunk_1" in (tmp_path / f"{NAMES.index('pipeline') + 1:02d}_pipeline.py").read_text()


def _untag_loss(gm):
    gm.graph.output_node().args[0][0].meta["fxmeg"].pop("loss")


def _untag_tp(gm):
    next(n for n in gm.graph.nodes if n.op == "get_attr" and "tp" in n.meta["fxmeg"]).meta[
        "fxmeg"
    ].pop("tp")


def _later_chunk(gm):
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.meta["fxmeg"]["chunk"] = 1  # the first node claims the last chunk: later nodes read it


def _lose_recv(parent):
    gm = chunks(parent)[1]
    recv = next(n for n in gm.graph.nodes if n.target is fxmeg.ir.ops.recv)
    recv.replace_all_uses_with(recv.args[0])
    gm.graph.erase_node(recv)


def _overlap_slots(parent):
    gm = chunks(parent)[0]
    layout = gm.meta["fxmeg"]["buffers"][0]
    gm.meta["fxmeg"]["buffers"] = (
        type(layout)(layout.dtype, layout.numel, layout.slots + layout.slots[:1], layout.buckets),
    )


def _drop_wait(parent):
    gm = chunks(parent)[0]
    wait = next(n for n in gm.graph.nodes if n.target is fxmeg.ir.ops.wait_param_gather)
    gm.graph.erase_node(wait)


BREAK = {
    "loss": _untag_loss,
    "tensor_parallel": _untag_tp,
    "partition": _later_chunk,
    "pipeline": _lose_recv,
    "buckets": _overlap_slots,
    "param_gather": _drop_wait,
}


@pytest.mark.parametrize("name", sorted(BREAK))
def test_each_check_fails_on_a_broken_result(name):
    gm = _after(name)
    check_pass(name, gm, _config())  # the intact result passes
    BREAK[name](gm)
    with pytest.raises(AssertionError, match=name):
        check_pass(name, gm, _config())


def test_stop_after_names_a_pass():
    with pytest.raises(ValueError, match="stop_after='buckts' is not one of"):
        fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), stop_after="buckts")
    assert isinstance(_after("loss"), torch.fx.GraphModule)


def test_skip_passes_switches_passes_off_by_name(monkeypatch, caplog):
    monkeypatch.setenv("FXMEG_SKIP_PASSES", "recompute, param_gather")
    with caplog.at_level(logging.INFO, logger="fxmeg.frontend.pass_driver"):
        program = fxmeg.transform(
            make_model("gpt", n_layer=2), make_batch(2, seed=0), _config(recompute="full")
        )
    logged = [r.getMessage().split()[0] for r in caplog.records if r.levelno == logging.INFO]
    assert logged == ["capture", *(n for n in NAMES if n not in ("recompute", "param_gather"))]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "recompute, param_gather" in warning
    for gm in program.chunks:
        assert not any(isinstance(m, Recompute) for m in gm.modules())
        assert not any(n.target is fxmeg.ir.ops.wait_param_gather for n in gm.graph.nodes)


@pytest.mark.parametrize(
    "names, message",
    [
        (
            "recompute,bucket",
            (
                r"names 'bucket', which is not a pass \(did you mean 'buckets'\?\); the passes are "
                r"loss, "
            ),
        ),
        (
            "pipeline",
            (
                "pass 'pipeline' cannot be skipped.*can be: context_parallel, tensor_parallel, "
                "expert_parallel, recompute"
            ),
        ),
    ],
)
def test_skip_passes_refuses_unknown_and_required_names(monkeypatch, names, message):
    monkeypatch.setenv("FXMEG_SKIP_PASSES", names)
    with pytest.raises(ConfigError, match=message):
        fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), _config())


def _with(name, **changes):
    return tuple(dataclasses.replace(p, **changes) if p.name == name else p for p in driver.PASSES)


def test_driver_refuses_a_pass_that_returns_no_graph(monkeypatch):
    monkeypatch.setattr(driver, "PASSES", _with("recompute", run=lambda gm, **_: None))
    with pytest.raises(
        TypeError, match="pass 'recompute' returned NoneType for chunk 0, not an fx.GraphModule"
    ):
        fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), _config())


def test_driver_refuses_a_pass_on_the_wrong_side_of_pipeline(monkeypatch):
    order = [p for p in driver.PASSES if p.name != "recompute"]
    order.insert(NAMES.index("pipeline"), driver.PASSES[NAMES.index("recompute")])
    monkeypatch.setattr(driver, "PASSES", tuple(order))
    with pytest.raises(
        AssertionError,
        match="pass 'recompute' takes the chunk graph, but it got a graph that is not",
    ):
        fxmeg.transform(make_model("gpt", n_layer=2), make_batch(2, seed=0), _config())
