"""A rank that trained with fxmeg and called ``dist.destroy_process_group()`` keeps no
process group alive: each gloo group's destructor joins its worker threads there, while
Python still runs. A group held past it dies while Python finalizes, and a worker then
releasing a finished collective's tensors asks for the GIL and aborts the process
("terminate called without an active exception", SIGABRT; fxmeg/runtime/groups.py,
``WeakGroup``). That holds for the default group too, which torch.distributed.nn captures when
fxmeg's first parallelize imports it after init_process_group (fxmeg releases the capture:
``torch_private.release_world_capture``). An engine used afterwards says so by name."""

import gc
import importlib
import weakref

import pytest
import torch.distributed as dist
import torch.distributed.nn.functional
from torch.distributed.distributed_c10d import _world

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import make_batch
from tests.harness.models import make_model


def _train_then_destroy(rank: int) -> dict:
    # as when a program imports fxmeg (and torch.distributed.nn with it) only after
    # init_process_group: its collectives capture the default group as a default argument
    importlib.reload(torch.distributed.nn.functional)
    captured = any(isinstance(d, dist.ProcessGroup)
                   for d in torch.distributed.nn.functional.all_reduce.__defaults__)
    # pp2 x dp2 with the GPT's embedding tied over the first and last stage (a group of
    # its own), the distributed optimizer (parameter gathers) and the determinism check
    # (fxmeg's world group)
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), pp=2, zero=1,
                               global_batch_size=8)
    for step in range(2):
        engine.train_step(make_batch(8, seed=step), check_determinism=step == 1)
    default = weakref.ref(dist.group.WORLD)
    made = [weakref.ref(g) for g in _world.pg_map if g is not default()]
    dist.destroy_process_group()
    gc.collect()
    try:
        engine.train_step(make_batch(8, seed=2))
        after = "trained"
    except fxmeg.FxmegError as exc:  # the executor names the rank and step around it
        after = str(exc)
    return {"groups": len(made), "alive": sum(r() is not None for r in made), "after": after,
            "default_alive": default() is not None, "captured": captured}


@pytest.fixture(scope="module")
def ranks():
    return run_world(4, _train_then_destroy)


def test_destroy_process_group_destroys_every_group_fxmeg_made(ranks):
    for r in ranks:
        assert r["groups"] >= 4, r  # pp, dp, tied, world at least
        assert r["alive"] == 0, r


def test_the_default_group_dies_too(ranks):
    """torch.distributed.nn, imported after init, had captured the default group; fxmeg
    released it, and destroy_process_group destroyed it."""
    for r in ranks:
        assert r["captured"] and not r["default_alive"], r


def test_an_engine_used_after_destroy_names_the_destroyed_group(ranks):
    for r in ranks:
        assert "GroupDestroyedError: process group" in r["after"], r
        assert "was destroyed (dist.destroy_process_group())" in r["after"], r
