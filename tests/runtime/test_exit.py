"""A rank that trained with fxmeg and called ``dist.destroy_process_group()`` keeps no
process group alive: each gloo group's destructor joins its worker threads there, while
Python still runs. A group held past it dies while Python finalizes, and a worker then
releasing a finished collective's tensors asks for the GIL and aborts the process
("terminate called without an active exception", SIGABRT; fxmeg/runtime/groups.py,
``WeakGroup``). An engine used afterwards says so by name."""

import gc
import weakref

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import make_batch
from tests.harness.models import make_model


def _train_then_destroy(rank: int) -> dict:
    # pp2 x dp2 with the GPT's embedding tied over the first and last stage (a group of
    # its own), the distributed optimizer (parameter gathers) and the determinism check
    # (fxmeg's world group)
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), pp=2, zero=1,
                               global_batch_size=8)
    for step in range(2):
        engine.train_step(make_batch(8, seed=step), check_determinism=step == 1)
    default = dist.group.WORLD
    made = [weakref.ref(g) for g in _world.pg_map if g is not default]
    del default
    dist.destroy_process_group()
    gc.collect()
    try:
        engine.train_step(make_batch(8, seed=2))
        after = "trained"
    except fxmeg.FxmegError as exc:  # the executor names the rank and step around it
        after = str(exc)
    return {"groups": len(made), "alive": sum(r() is not None for r in made), "after": after}


@pytest.fixture(scope="module")
def ranks():
    return run_world(4, _train_then_destroy)


def test_destroy_process_group_destroys_every_group_fxmeg_made(ranks):
    for r in ranks:
        assert r["groups"] >= 4, r  # pp, dp, tied, world at least
        assert r["alive"] == 0, r


def test_an_engine_used_after_destroy_names_the_destroyed_group(ranks):
    for r in ranks:
        assert "GroupDestroyedError: process group" in r["after"], r
        assert "was destroyed (dist.destroy_process_group())" in r["after"], r
