"""Checkpoints on real ranks: exact resume at tp=2 x pp=2 x dp=2 with the distributed
optimizer, resharding to other layouts and one process, export to a plain state_dict; and
the Python API's ``engine.save`` (in the background) at tp=2 x dp=4 and ``engine.load`` at
pp=2 x dp=4 in the other spawn, against plain single-device training."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fxmeg
from fxmeg.data.corpus import prepare, read_documents
from fxmeg.data.tokenizer import ByteTokenizer
from fxmeg.train.metrics import read
from fxmeg.train.trainer import TrainConfig, Trainer
from fxmeg.weights.checkpoint import export
from models.gpt import GPT, GPTConfig
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    LOSS_RTOL,
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)
from tests.harness.models import make_model

SAVED = dict(tp=2, pp=2, dp=2, distributed_optimizer=True)
LAYOUTS = {
    "same": SAVED,
    "tp1-pp4-dp2": dict(tp=1, pp=4, dp=2, distributed_optimizer=True),
    "tp2-pp1-dp4-no-distopt": dict(tp=2, pp=1, dp=4, distributed_optimizer=False),
}
MODEL = {"n_layer": 4, "n_embd": 64, "n_head": 4}


def config(root: str, name: str, **kw) -> TrainConfig:
    base = dict(data=os.path.join(root, "corpus"), model_args=json.dumps(MODEL), seq_len=32,
                micro_batch_size=2, global_batch_size=16, log_interval=1, eval_iters=1, lr=3e-3,
                lr_warmup_samples=16, lr_decay_samples=400, run_dir=os.path.join(root, name),
                progress=False, tensorboard=False)
    return TrainConfig.from_flat(**(base | kw))


def first(rank: int, root: str) -> dict:
    """An uninterrupted 6-step run, and a 3-step run that saves."""
    Trainer(config(root, "whole", train_iters=6, **SAVED)).run()
    t = Trainer(config(root, "first", train_iters=3, save=os.path.join(root, "ckpt"), **SAVED))
    t.run()
    return {"state": t.engine.full_state_dict()} | _engine_saves(root)


# The Python API: 2 steps at tp=2 x dp=4, a background save, 2 more steps; the other spawn
# loads that save at pp=2 x dp=4 (another cut of every parameter) and trains steps 3-4.
API_SAVED, API_LOADED = dict(tp=2), dict(pp=2)
API_BATCHES = [make_batch(16, seed=s) for s in range(4)]


def _api_engine(**layout):
    ids, labels = API_BATCHES[0]
    return fxmeg.parallelize(
        make_model("gpt", n_layer=2),
        (ids[:2], labels[:2]),
        global_batch_size=16,
        optimizer=optimizer,
        **layout,
    )


def _engine_saves(root: str) -> dict:
    engine = _api_engine(**API_SAVED)
    losses = [engine.train_step(b).loss for b in API_BATCHES[:2]]
    saving = engine.save(os.path.join(root, "api"), async_save=True, state={"epoch": 7})
    losses += [engine.train_step(b).loss for b in API_BATCHES[2:]]  # while the save is written
    saving.wait()
    return {"api_losses": losses, "api_state": engine.full_state_dict(), "api_path": saving.path}


def _engine_loads(root: str) -> dict:
    engine = _api_engine(**API_LOADED)
    user = engine.load(os.path.join(root, "api"))
    losses = [engine.train_step(b).loss for b in API_BATCHES[2:]]
    return {"api_user": user, "api_losses": losses, "api_state": engine.full_state_dict(),
            "api_steps": engine.context.steps_taken}


def resumed(rank: int, root: str) -> dict:
    """New processes: load under each layout, compare, train 3 more steps."""
    out = {}
    batch = _fixed_batch()
    for name, layout in LAYOUTS.items():
        t = Trainer(
            config(
                root, f"resumed-{name}", train_iters=6, load=os.path.join(root, "ckpt"), **layout
            )
        )
        out[name] = {"iteration": t.iteration, "state": t.engine.full_state_dict(),
                     "eval": t.engine.eval_step(batch).loss}
        t.run()
    if rank == 0:
        export(os.path.join(root, "ckpt"), os.path.join(root, "model.pt"))
    return out | _engine_loads(root)


def _fixed_batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (16, 32), generator=g)
    return ids, ids.roll(-1, dims=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    prepare(read_documents(["pydoc:topics"]), os.path.join(root, "corpus"), ByteTokenizer())
    saved = run_world(8, first, root)
    loaded = run_world(8, resumed, root)
    single = Trainer(config(root, "resumed-single", train_iters=6, load=os.path.join(root, "ckpt")))
    one = {"iteration": single.iteration, "state": single.engine.full_state_dict(),
           "eval": single.engine.eval_step(_fixed_batch()).loss}
    single.run()
    return root, saved[0]["state"], loaded[0] | {"single": one, "api_saved": saved[0]}


def _losses(root: str, name: str) -> list[float]:
    return [r["loss"] for r in read(os.path.join(root, name)) if r["kind"] == "train"]


def test_exact_resume_in_new_processes(results):
    root, _, _ = results
    assert _losses(root, "resumed-same") == _losses(root, "whole")[3:]  # bitwise, fp32


@pytest.mark.parametrize("layout", ["same", "tp1-pp4-dp2", "tp2-pp1-dp4-no-distopt", "single"])
def test_resharded_load_restores_the_state_and_the_run(results, layout):
    root, saved, loaded = results
    got = loaded[layout]
    assert got["iteration"] == 3
    assert got["state"].keys() == saved.keys()
    for k in saved:
        assert torch.equal(got["state"][k], saved[k]), k
    whole = _losses(root, "whole")[3:]
    for g, w in zip(_losses(root, f"resumed-{layout}"), whole):
        assert abs(g - w) <= LOSS_RTOL * abs(w), (g, w)


def test_exported_state_dict_loads_into_the_unmodified_model(results):
    root, saved, loaded = results
    model = GPT(GPTConfig(vocab_size=384, seq_len=32, **MODEL))
    model.load_state_dict(torch.load(os.path.join(root, "model.pt")))  # strict: every name
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k])
    ids, labels = _fixed_batch()
    loss = model(ids, labels).item()
    for layout in LAYOUTS.keys() | {"single"}:
        assert abs(loaded[layout]["eval"] - loss) <= LOSS_RTOL * loss


def test_engine_save_at_one_layout_loads_at_another_and_trains_as_one_device(results):
    """engine.save in the background at tp=2 x dp=4 while training goes on, engine.load at
    pp=2 x dp=4 in new processes: both runs' losses and weights are those of plain
    single-device training (the saved run's steps 3-4 continue undisturbed by the save)."""
    _, _, loaded = results
    want_losses, _, want_state = reference(make_model("gpt", n_layer=2), API_BATCHES)
    saved = loaded["api_saved"]
    assert saved["api_path"].endswith("iter_0000002")
    assert_losses_close(saved["api_losses"], want_losses)
    assert_weights_close(saved["api_state"], want_state)
    assert loaded["api_user"] == {"epoch": 7} and loaded["api_steps"] == 4
    assert_losses_close(loaded["api_losses"], want_losses[2:])
    assert_weights_close(loaded["api_state"], want_state)
