"""A pipeline cut carrying several tensors costs one message per direction and
micro-batch (runtime/pipeline/packing.py), with both p2p modes, on real gloo ranks; and packing
changes no bit of training: losses and final weights equal those of the same engine
sending one message per tensor (``Executor.pack = False``)."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch.distributed as dist

from tests.harness.distributed import run_world
from tests.parity.scenarios import Scenario

M, STEPS = 4, 3
SCENARIOS = [
    Scenario("llama", 2, 1, "1f1b", M, options=(("p2p", mode),)) for mode in ("eager", "paired")
]


@contextlib.contextmanager
def counting_messages(counts: Counter):
    """Count every point-to-point message posted, at the process group: the executor
    posts on it directly, ``dist.isend`` / ``irecv`` and ``batch_isend_irecv`` end there."""
    originals = {"isend": dist.ProcessGroup.send, "irecv": dist.ProcessGroup.recv}

    def counted(name):
        def post(self, tensors, *args, **kwargs):
            counts[name] += len(tensors)
            return originals[name](self, tensors, *args, **kwargs)

        return post

    try:
        dist.ProcessGroup.send, dist.ProcessGroup.recv = counted("isend"), counted("irecv")
        yield counts
    finally:
        dist.ProcessGroup.send, dist.ProcessGroup.recv = originals["isend"], originals["irecv"]


def train(rank: int, sc: Scenario, pack: bool) -> dict:
    engine = sc.engine()
    engine.context.executor.wire.pack = pack
    losses, counts, counters = [], [], []
    for batch in sc.batches()[:STEPS]:
        with counting_messages(Counter()) as c:
            losses.append(engine.train_step(batch).loss)
        counts.append(dict(c))
        counters.append(engine.context.executor.counters)
    state = engine.full_state_dict()  # collective: every rank calls it
    return {
        "losses": losses,
        "counts": counts,
        "counters": counters,
        "state": state if rank == 0 else None,
        "cut": engine.program.specs[0].send,
    }


def run(rank: int) -> dict:
    return {(sc.id, pack): train(rank, sc, pack) for sc in SCENARIOS for pack in (True, False)}


@pytest.fixture(scope="module")
def results():
    return run_world(2, run)


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_one_message_per_cut_direction_and_micro_batch(results, sc):
    first, last = (r[(sc.id, True)] for r in results)
    cut = first["cut"]
    assert len(cut) >= 3 and sum(b.grad for b in cut) == 1  # hidden state, cos, sin
    for counts in first["counts"]:
        assert counts == {"isend": M, "irecv": M}  # activations out, gradients in
    for counts in last["counts"]:
        assert counts == {"isend": M, "irecv": M}  # activations in, gradients out
    unpacked = results[0][(sc.id, False)]["counts"]
    assert all(c == {"isend": len(cut) * M, "irecv": M} for c in unpacked)  # the saving


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_packing_changes_no_bit(results, sc):
    for r in results:
        assert r[(sc.id, True)]["losses"] == r[(sc.id, False)]["losses"]
    got, want = results[0][(sc.id, True)]["state"], results[0][(sc.id, False)]["state"]
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].equal(want[name]), name


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.id)
def test_sent_activations_are_still_freed(results, sc):
    for c in results[0][(sc.id, True)]["counters"]:
        assert c.deallocated == c.sent_for_dealloc == M  # the hidden state, every micro-batch
