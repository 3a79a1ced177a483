"""`fxmeg train --layout auto`: the search's fastest layout for the ranks launched, the
layout flags given held fixed, trained, with the prediction beside the first measured
steps; refused under torchrun, where the ranks are already started, and with
--max-pending-w, which the search sets."""

import os
import subprocess
import sys

import pytest

from fxmeg.train.metrics import read

MODEL = '{"n_layer": 4, "n_embd": 64, "n_head": 4}'
CLUSTER = "h100:ranks_per_node=2"  # a preset: no calibration of this machine in the test


def fxmeg(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fxmeg.train.cli", *args], capture_output=True,
                          text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"}
                          | (env or {}))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("corpus") / "text")
    out = fxmeg("prepare-data", "--input", "pydoc:topics", "--output", prefix)
    assert out.returncode == 0, out.stderr
    return prefix


def _train(corpus, run, *extra, env=None):
    return fxmeg("train", "--layout", "auto", "--cluster", CLUSTER, "--data", corpus,
                 "--model-args", MODEL, "--seq-len", "64", "--global-batch-size", "16",
                 "--train-iters", "8", "--log-interval", "2", "--no-progress",
                 "--no-tensorboard", "--run-dir", run, *extra, env=env)


def test_layout_auto_trains_the_chosen_layout_and_logs_the_prediction(corpus, tmp_path):
    out = _train(corpus, str(tmp_path / "run"), "--zero", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    chose = next(line for line in out.stdout.splitlines() if "--layout auto chose" in line)
    assert " zero1 " in chose and "on 2 ranks of h100" in chose, chose  # --zero 1 held fixed
    name = chose.split("chose ")[1].split(" (")[0]  # e.g. tp1 dp2 zero1 rc:none mbs8
    parts = dict((p[:2], p[2:]) for p in name.split() if p[:2] in ("tp", "dp"))
    assert (f"layout tp={parts['tp'].split('+')[0]} " in out.stdout
            and f"dp={parts['dp']} zero=1 on 2 rank(s)" in out.stdout), out.stdout
    predicted = float(chose.split("predicted ")[1].split(" s per step")[0])
    train = [r for r in read(str(tmp_path / "run")) if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [2, 4, 6, 8]
    assert [round(r.get("predicted_step_s", 0), 3) for r in train] == [predicted] * 3 + [0]
    assert all(r["iteration_time"] > 0 for r in train)


def test_layout_auto_holds_megatrons_flag_names_fixed_too(corpus, tmp_path):
    out = _train(corpus, str(tmp_path / "run"), "--tensor-model-parallel-size", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    chose = next(line for line in out.stdout.splitlines() if "--layout auto chose" in line)
    assert chose.split("chose ")[1].startswith("tp2"), chose
    assert "layout tp=2 " in out.stdout, out.stdout


def test_layout_auto_under_torchrun_is_refused(corpus, tmp_path):
    out = _train(corpus, str(tmp_path / "run"), env={"RANK": "0", "WORLD_SIZE": "2"})
    assert out.returncode == 1
    assert "--layout auto searches before it starts the ranks" in out.stderr, out.stderr
    out = _train(corpus, str(tmp_path / "run"), "--pp", "2", "--schedule", "zbh1",
                 "--max-pending-w", "2")
    assert out.returncode == 1
    assert "--layout auto sets max_pending_w itself" in out.stderr, out.stderr
