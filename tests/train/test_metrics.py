"""What the trainer reports, read back: TensorBoard's event files hold the numbers of
metrics.jsonl."""

import json

import numpy as np

from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer

MODEL = json.dumps({"n_layer": 2, "n_embd": 32, "n_head": 4})


def test_tensorboard_events_match_the_metrics_file(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = str(tmp_path / "run")
    cfg = TrainConfig.from_flat(
        data=corpus,
        model_args=MODEL,
        seq_len=32,
        micro_batch_size=4,
        global_batch_size=8,
        train_iters=3,
        log_interval=1,
        eval_interval=2,
        eval_iters=1,
        run_dir=run,
        save=str(tmp_path / "ckpt"),
        progress=False,
        tensorboard=True,
    )
    Trainer(cfg).run()
    # every number of every record with an iteration, as "kind/key" at that step
    want = sorted(
        (f"{r['kind']}/{k}", r["iteration"], float(np.float32(v)))
        for r in read(run)
        if "iteration" in r
        for k, v in r.items()
        if k not in ("iteration", "time") and isinstance(v, (int, float))
    )
    events = EventAccumulator(f"{run}/tensorboard")
    events.Reload()
    got = sorted(
        (tag, e.step, e.value) for tag in events.Tags()["scalars"] for e in events.Scalars(tag)
    )
    assert got == want
    tags = {tag for tag, _, _ in got}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/valid_loss",
            "eval/valid_ppl", "event/save_time"} <= tags
    assert [step for tag, step, _ in got if tag == "train/loss"] == [1, 2, 3]
    assert [step for tag, step, _ in got if tag == "eval/valid_loss"] == [2, 3]
