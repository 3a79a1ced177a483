"""Every script in examples/ runs as docs/cli.md says, under torchrun on gloo, for a few
steps: exit code 0 and finite losses printed (and, for the trainer, logged)."""

import math
import os
import re
import subprocess
import sys

import pytest

from fxmeg.train.metrics import read

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


def torchrun(script: str, *args: str, nproc: int = 4) -> str:
    """``torchrun --standalone --nproc-per-node NPROC examples/SCRIPT --steps 3 ARGS``; its
    stdout."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            os.path.join(ROOT, "examples", script),
            "--steps",
            str(STEPS),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _losses(stdout: str) -> dict[int, float]:
    """{step: loss} of the 'step N loss X' lines."""
    return {
        int(s): float(x) for s, x in re.findall(r"^step (\d+) loss (\S+)", stdout, re.MULTILINE)
    }


def test_torchrun_gpt():
    losses = _losses(torchrun("torchrun_gpt.py"))
    assert list(losses) == [STEPS] and math.isfinite(losses[STEPS]), losses  # the last step's line


def test_torchrun_hf_llama():
    pytest.importorskip("transformers")
    losses = _losses(torchrun("torchrun_hf_llama.py"))  # tp=2 x pp=2, dp=1 on 4 ranks
    assert list(losses) == [STEPS] and math.isfinite(losses[STEPS]), losses


def test_torchrun_trainer(corpus, tmp_path):
    run = str(tmp_path / "run")
    stdout = torchrun("torchrun_trainer.py", "--data", corpus, "--run-dir", run)
    (final,) = re.findall(r"exit \(done\) at iteration (\d+), .*validation loss (\S+)", stdout)
    assert int(final[0]) == STEPS and math.isfinite(float(final[1])), stdout[-2000:]
    records = read(run)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [STEPS] and math.isfinite(train[0]["loss"])
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    assert f"{evaluation['valid_loss']:.4f}" == final[1]  # the printed line is the logged one
