"""Checkpoint robustness on one process: background saves, crashes during a save,
damaged files, incompatible models, export and init-from."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import time

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from fxmeg.train.cli import main as fxmeg_main
from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer
from fxmeg.weights.checkpoint import CheckpointError, check_complete, find_complete

MODEL = json.dumps({"n_layer": 2, "n_embd": 32, "n_head": 4})


def _config(corpus, root, **kw) -> TrainConfig:
    base = dict(
        data=corpus,
        model_args=MODEL,
        seq_len=32,
        micro_batch_size=4,
        global_batch_size=8,
        log_interval=1,
        eval_iters=1,
        lr=1e-3,
        lr_decay_samples=400,
        run_dir=str(root / "run"),
        save=str(root / "ckpt"),
        progress=False,
        tensorboard=False,
    )
    return TrainConfig.from_flat(**(base | kw))


class SlowWriter(FileSystemWriter):
    """Writes the data, then dawdles before the save can finish (its metadata comes
    last): a save that is midway for ``DELAY`` seconds."""

    DELAY = 1.5
    ONLY = ""  # slow only for checkpoint paths containing this

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        if self.ONLY in str(self.path):
            time.sleep(self.DELAY)
        return result


def test_async_save_overlaps_training(corpus, tmp_path):
    t = Trainer(_config(corpus, tmp_path, train_iters=5, save_interval=2, async_save=True))
    t.checkpointer.writer_factory = SlowWriter
    t.run()
    records = read(str(tmp_path / "run"))

    def index(test) -> int:
        return next(i for i, r in enumerate(records) if test(r))

    started = index(lambda r: r.get("save_started", "").endswith("iter_0000002"))
    done = index(lambda r: r.get("saved", "").endswith("iter_0000002"))
    step3 = index(lambda r: r["kind"] == "train" and r["iteration"] == 3)
    assert started < step3 < done  # step 3 was logged while the save of step 2 was in flight
    assert open(tmp_path / "ckpt" / "latest").read() == "iter_0000005"
    check_complete(str(tmp_path / "ckpt" / "iter_0000002"))


def _train_and_get_killed(corpus: str, root: str) -> None:
    SlowWriter.DELAY, SlowWriter.ONLY = 60, "iter_0000004"
    t = Trainer(_config(corpus, pathlib.Path(root), train_iters=100, save_interval=2))
    t.checkpointer.writer_factory = SlowWriter
    t.run()


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(corpus, tmp_path):
    proc = multiprocessing.get_context("spawn").Process(
        target=_train_and_get_killed, args=(corpus, str(tmp_path))
    )
    proc.start()
    ckpt = tmp_path / "ckpt"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the save of step 4 has written its data files
        if (ckpt / "iter_0000004").exists() and any(
            p.suffix == ".distcp" for p in (ckpt / "iter_0000004").iterdir()
        ):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    proc.kill()
    proc.join()
    assert open(ckpt / "latest").read() == "iter_0000002"
    with pytest.raises(CheckpointError, match="iter_0000004/meta.json is missing"):
        check_complete(str(ckpt / "iter_0000004"))
    resumed = Trainer(_config(corpus, tmp_path, train_iters=3, load=str(ckpt)))
    assert (resumed.iteration, resumed.consumed) == (2, 16)


def test_a_damaged_checkpoint_is_named_and_skipped(corpus, tmp_path):
    Trainer(_config(corpus, tmp_path, train_iters=4, save_interval=2)).run()
    ckpt = tmp_path / "ckpt"
    data = sorted((ckpt / "iter_0000004").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    with pytest.warns(
        UserWarning,
        match=f"skipping incomplete checkpoints, loading .*iter_0000002.*{data.name} is truncated",
    ):
        resumed = Trainer(_config(corpus, tmp_path, train_iters=5, load=str(ckpt)))
    assert resumed.iteration == 2
    older = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    older.unlink()
    with pytest.raises(
        CheckpointError, match=f"no complete checkpoint in .*{older.name} is missing"
    ):
        find_complete(str(ckpt))


def test_a_checkpoint_of_another_model_is_refused(corpus, tmp_path):
    Trainer(_config(corpus, tmp_path, train_iters=1)).run()
    other = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 4})
    with pytest.raises(
        CheckpointError,
        match="incompatible model .*layers.1.attn.proj.bias: checkpoint \\[32\\] vs model None",
    ):
        Trainer(
            _config(corpus, tmp_path, train_iters=2, load=str(tmp_path / "ckpt"), model_args=other)
        )


def test_export_then_init_from(corpus, tmp_path):
    t = Trainer(_config(corpus, tmp_path, train_iters=2))
    t.run()
    out = str(tmp_path / "model.pt")
    assert fxmeg_main(["export", str(tmp_path / "ckpt"), "--to", out]) == 0
    exported = torch.load(out)
    full = t.engine.full_state_dict()
    assert exported.keys() == full.keys() and all(torch.equal(exported[k], full[k]) for k in full)
    for source in (out, str(tmp_path / "ckpt")):  # the exported file, or the checkpoint itself
        fresh = Trainer(
            _config(corpus, tmp_path / "again", train_iters=1, init_from=source, save="")
        )
        start = fresh.engine.full_state_dict()
        assert all(torch.equal(start[k], full[k]) for k in full)
