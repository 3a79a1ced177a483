"""A background checkpoint on 4 ranks (pp=2 x dp=2, distributed optimizer) resumed
bitwise, and the validation stream continuing across evaluations and across that resume.

One spawn runs three trainers in turn: an uninterrupted run; the same run saving
asynchronously at step 3 (a slow writer keeps the save in flight while steps 4-6 train
and evaluate); and a fresh trainer that loads that step-3 checkpoint and trains to 6.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from fxmeg.data.corpus import prepare, read_documents
from fxmeg.data.tokenizer import ByteTokenizer
from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer
from tests.harness.distributed import run_world
from tests.weights.test_checkpoint import SlowWriter

GLOBAL_BATCH = 8


def config(root: str, name: str, **kw) -> TrainConfig:
    base = dict(
        data=os.path.join(root, "corpus"),
        model_args=json.dumps({"n_layer": 2, "n_embd": 32, "n_head": 4}),
        seq_len=32,
        micro_batch_size=2,
        global_batch_size=GLOBAL_BATCH,
        train_iters=6,
        log_interval=1,
        eval_interval=2,
        eval_iters=1,
        lr=3e-3,
        lr_warmup_samples=8,
        lr_decay_samples=400,
        pp=2,
        dp=2,
        distributed_optimizer=True,
        run_dir=os.path.join(root, name),
        progress=False,
        tensorboard=False,
    )
    return TrainConfig.from_flat(**(base | kw))


def _spy(trainer: Trainer) -> list[list[int]]:
    """The validation stream positions of each evaluation (eval_iters=1: one batch each)."""
    seen, batch = [], trainer.batch

    def record(split: str, positions):
        if split == "valid":
            seen.append(list(positions))
        return batch(split, positions)

    trainer.batch = record
    return seen


def three_runs(rank: int, root: str) -> dict:
    ckpt = os.path.join(root, "ckpt")
    whole = Trainer(config(root, "whole"))
    whole.run()
    SlowWriter.DELAY, SlowWriter.ONLY = 2.0, "iter_0000003"
    saving = Trainer(config(root, "async", save=ckpt, save_interval=3, async_save=True))
    saving.checkpointer.writer_factory = SlowWriter
    saving_seen = _spy(saving)
    saving.run()
    if rank == 0:  # resume from the background save of step 3, not the final one of step 6
        shutil.rmtree(os.path.join(ckpt, "iter_0000006"))
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write("iter_0000003")
    dist.barrier()
    resumed = Trainer(config(root, "resumed", load=ckpt))
    start = (resumed.iteration, resumed.consumed, resumed.valid_consumed)
    resumed_seen = _spy(resumed)
    resumed.run()
    return {
        "whole": whole.engine.full_state_dict(),
        "async": saving.engine.full_state_dict(),
        "resumed": resumed.engine.full_state_dict(),
        "start": start,
        "valid_count": len(resumed.data.valid),
        "async_seen": saving_seen,
        "resumed_seen": resumed_seen,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    prepare(read_documents(["pydoc:topics"]), os.path.join(root, "corpus"), ByteTokenizer())
    return root, run_world(4, three_runs, root)


def _records(root: str, name: str, kind: str, key: str) -> dict[int, float]:
    return {r["iteration"]: r[key] for r in read(os.path.join(root, name)) if r["kind"] == kind}


def test_async_save_overlaps_training(results):
    root, _ = results
    records = read(os.path.join(root, "async"))

    def index(test) -> int:
        return next(i for i, r in enumerate(records) if test(r))

    started = index(lambda r: r.get("save_started", "").endswith("iter_0000003"))
    done = index(lambda r: r.get("saved", "").endswith("iter_0000003"))
    step4 = index(lambda r: r["kind"] == "train" and r["iteration"] == 4)
    assert started < step4 < done  # step 4 trained while the save of step 3 was being written


def test_async_checkpoint_resumes_bitwise(results):
    root, ranks = results
    whole = _records(root, "whole", "train", "loss")
    assert _records(root, "async", "train", "loss") == whole  # the background save changes nothing
    # one evaluation (step 2) before the save
    assert ranks[0]["start"] == (3, 3 * GLOBAL_BATCH, GLOBAL_BATCH)
    # bitwise, fp32
    assert _records(root, "resumed", "train", "loss") == {i: whole[i] for i in (4, 5, 6)}
    valid = _records(root, "whole", "eval", "valid_loss")
    assert _records(root, "resumed", "eval", "valid_loss") == {i: valid[i] for i in (4, 6)}
    for rank in ranks:  # every parameter, gathered on every rank
        for name in ("async", "resumed"):
            assert rank[name].keys() == rank["whole"].keys()
            for k, v in rank["whole"].items():
                assert torch.equal(rank[name][k], v), (name, k)


def test_validation_stream_continues_across_evaluations_and_the_resume(results):
    """Megatron's valid iterator is not reset per evaluation; fxmeg's stream position
    (valid_consumed) is checkpointed, so a resumed run reads on from there too. The valid
    split holds what Megatron sizes it for: (6 // 2 + 1) evaluations of one batch."""
    _, ranks = results
    for rank in ranks:  # pp=2: the first stage reads the ids, the last the labels
        assert rank["valid_count"] >= 4 * GLOBAL_BATCH
        stream = list(range(3 * GLOBAL_BATCH))
        # evaluations at 2, 4, 6
        assert rank["async_seen"] == [stream[:8], stream[8:16], stream[16:]]
        # 4 and 6: from where step 2 left off
        assert rank["resumed_seen"] == [stream[8:16], stream[16:]]
