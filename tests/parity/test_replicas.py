"""Replicas that provably agree, on 4 real gloo ranks (one spawn): a rank that starts
from other weights is refused at parallelize on every rank, naming the parameter and
the ranks (tensor- and data-parallel replicas, the holders of a tied weight);
broadcast_params=True copies the first replica's values instead and then trains exactly
like one device; a replica changed between steps stops the next step
(check_replicas_interval). Frozen parameters and buffers are checked too, and a start-up
check that passes whatever the ranks' timing (ModernBERT-decoder's rotary tables at tp=2,
its ranks reaching parallelize seconds apart). And the Program
replicas are built from: with the spawn's shared transform left out, every rank transforms
a Mixtral at tp=2 x pp=2 x ep=2 by itself and all ranks make the same Program (its digest:
graphs, specs, placement, buffer layouts, tp / ep specs; tests/harness/shared_transform.py)."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import fxmeg
from fxmeg.errors import ReplicaError
from tests.harness import shared_transform
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)
from tests.harness.models import make_model, tiny_moe

MBS, GBS, STEPS = 2, 8, 3
PERTURBED = "layers.1.mlp.fc.weight"  # tp-split: only its data-parallel peer can see the change


def _batches():
    return [make_batch(GBS, seed=100 + s) for s in range(STEPS + 1)]


def _engine(seed: int, **options):
    batches = _batches()
    return fxmeg.parallelize(make_model("gpt", seed=seed), tuple(t[:MBS] for t in batches[0]),
                             global_batch_size=GBS, optimizer=optimizer, **options)


def _refused(seed: int, **options) -> dict:
    try:
        _engine(seed, **options)
    except ReplicaError as err:
        return {"message": str(err), "parameter": err.parameter, "ranks": err.ranks}
    return {"message": None}


def _broadcast_then_drift(rank: int) -> dict:
    """tp=2 x dp=2 with sequence parallelism (norm gradients all-reduced over tp), every
    rank seeded differently: trained after the broadcast, checked before every step;
    then rank 2 changes its shard of one weight."""
    engine = _engine(
        rank, tp=2, sequence_parallel=True, broadcast_params=True, check_replicas_interval=1
    )
    batches = _batches()
    steps = [engine.train_step(b) for b in batches[:STEPS]]
    state = engine.full_state_dict()
    if rank == 2:
        with torch.no_grad():
            engine.named_parameters[PERTURBED].add_(1e-3)
    try:
        engine.train_step(batches[STEPS])
        drift = None
    except ReplicaError as err:
        drift = {"message": str(err), "parameter": err.parameter, "ranks": err.ranks}
    return {
        "losses": [s.loss for s in steps],
        "state": state if rank == 0 else None,
        "drift": drift,
    }


def _broadcast_pipeline(rank: int) -> dict:
    """pp=2 x dp=2, every rank seeded differently, distributed optimizer with overlapped
    parameter gathers: stage 0 and the tied embedding come from rank 0, stage 1 from
    rank 2 (its data-parallel rank 0)."""
    engine = _engine(rank, pp=2, broadcast_params=True, check_replicas_interval=1,
                     distributed_optimizer=True, overlap_param_gather=True)
    steps = [engine.train_step(b) for b in _batches()[:STEPS]]
    state = engine.full_state_dict()
    stage1 = sorted(n for n, h in engine.program.holders.items() if h == (1,))
    return {
        "losses": [s.loss for s in steps],
        "state": state if rank == 0 else None,
        "stage1": stage1,
    }


def _broadcast_masters(rank: int) -> dict:
    """dp=4 in bf16, every rank seeded differently: the fp32 masters are broadcast too
    (else the first update would part the replicas and the check before step 2 fail)."""
    try:
        engine = _engine(rank, precision="bf16", broadcast_params=True, check_replicas_interval=1)
        return {"losses": [engine.train_step(b).loss for b in _batches()[:2]], "error": None}
    except ReplicaError as err:
        return {"losses": None, "error": str(err)}


def _state(rank: int) -> dict:
    """dp=4: a frozen parameter changed on rank 1 and a buffer (Llama's rotary table) on
    rank 3 are refused; with broadcast_params=True the frozen one is copied and every
    rank trains alike."""

    def model(name: str, changed: bool):
        m = make_model(name, seed=0)
        tensor = m.wpe.weight.requires_grad_(False) if name == "gpt" else m.rope_cos
        if changed:
            with torch.no_grad():
                tensor.add_(1e-3)
        return m

    out = {}
    for name, odd in (("gpt", 1), ("llama", 3)):
        batches = _batches()
        try:
            fxmeg.parallelize(
                model(name, rank == odd), tuple(t[:MBS] for t in batches[0]), global_batch_size=GBS
            )
            out[name] = None
        except ReplicaError as err:
            out[name] = (err.parameter, err.ranks)
    engine = fxmeg.parallelize(
        model("gpt", rank == 1),
        tuple(t[:MBS] for t in _batches()[0]),
        global_batch_size=GBS,
        broadcast_params=True,
        check_replicas_interval=1,
    )
    out["broadcast"] = [engine.train_step(b).loss for b in _batches()[:2]]
    return out


def _transformed_alone(rank: int) -> dict:
    """Each rank transforms for itself (the shared cache, which lets one rank transform for
    the spawn, left out); every rank's Program digest, all-gathered."""
    program = shared_transform.transform_alone(
        tiny_moe("mixtral"),
        make_batch(MBS, seed=0, vocab=96),
        tp=2,
        pp=2,
        ep=2,
        dp=2,
        global_batch_size=GBS,
    )
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, shared_transform.program_digest(program))
    return {"digests": digests, "tp": len(program.tp_specs), "ep": len(program.ep_specs),
            "placement": program.placement, "buffers": sum(len(b) for b in program.buffers)}


APART_S = (0.0, 3.0, 6.0)
"""How long after the other ranks each start of ``_apart`` sends its late rank to parallelize."""


def _modernbert():
    """ModernBERT-decoder (two rotary tables: a global and a sliding-window one, buffers the
    start-up check compares over tp) and 2 steps' batches, as the zoo makes them."""
    from tests.parity import test_zoo

    return test_zoo.make("modernbert-decoder"), test_zoo.batches("modernbert-decoder")[:2]


def _apart(rank: int) -> list:
    """Issue 68: ModernBERT-decoder at tp=2 x dp=2 was refused at start-up ("'...rotary_emb.
    sliding_attention_inv_freq' differs between tensor-parallel ranks") in 2 of 6 tries
    when its ranks reached parallelize seconds apart, one having first trained a float64
    copy. Here each of ``APART_S``'s starts has a late rank (rank 0, 3, 0), the first also
    trains a float64 copy of its model first; each start's losses (2 steps) or its error."""
    out = []
    for i, delay in enumerate(APART_S):
        (model, batches), late = _modernbert(), (0, 3, 0)[i]
        if rank == late:
            if i == 0:
                copy = _modernbert()[0].double()
                opt = torch.optim.AdamW(copy.parameters())
                for ids, labels in batches:
                    copy(input_ids=ids, labels=labels).loss.backward()
                    opt.step()
            time.sleep(delay)
        try:
            engine = fxmeg.parallelize(model, tuple(t[:MBS] for t in batches[0]), tp=2,
                                       global_batch_size=GBS, optimizer=optimizer)
            out.append([engine.train_step(b).loss for b in batches])
        except ReplicaError as err:
            out.append(str(err))
    return out


def run(rank: int) -> dict:
    return {
        "apart": _apart(rank),
        "alone": _transformed_alone(rank),
        "state": _state(rank),
        # rank 3 = (tp 1, dp 1): its full wte differs from rank 2's, its shard from rank 1's
        "tp-dp": _refused(1 if rank == 3 else 0, tp=2),
        # pipeline stage 1 (ranks 2, 3) seeded differently: only the tied embedding is shared
        "tied": _refused(1 if rank >= 2 else 0, pp=2),
        "drift": _broadcast_then_drift(rank),
        "pipeline": _broadcast_pipeline(rank),
        "masters": _broadcast_masters(rank),
    }


@pytest.fixture(scope="module")
def results():
    return run_world(4, run)


FIX = "seed every rank identically before building the model"


def test_a_rank_seeded_differently_is_refused_on_every_rank(results):
    for r in results:
        got = r["tp-dp"]
        assert got["message"] is not None, "parallelize accepted diverging replicas"
        assert got["message"].startswith(
            "replicas differ at start-up: 'wte.weight' differs between tensor-parallel ranks (in "
            "the full "
            "tensor their shards are cut from): rank 3 holds other values than rank 2, and between "
            "data-parallel replicas: rank 3 holds other values than rank 1."
        ), got["message"]
        assert FIX in got["message"] and "broadcast_params=True" in got["message"]
        assert got["parameter"] == "wte.weight" and got["ranks"] == [(3, 2), (3, 1)]


def test_a_tied_weight_must_agree_across_its_pipeline_holders(results):
    for r in results:
        got = r["tied"]
        assert got["message"] is not None
        assert (
            "'wte.weight' differs between the pipeline ranks holding this tied weight: rank 2 "
            "holds "
            "other values than rank 0; rank 3 holds other values than rank 1."
        ) in got["message"]
        assert got["ranks"] == [(2, 0), (3, 1)]


def test_broadcast_params_trains_like_one_device_from_rank_0s_model(results):
    ref_losses, _, ref_state = reference(make_model("gpt", seed=0), _batches()[:STEPS])
    for r in results:
        assert r["drift"]["losses"] == results[0]["drift"]["losses"]
    assert_losses_close(results[0]["drift"]["losses"], ref_losses)
    assert_weights_close(results[0]["drift"]["state"], ref_state)


def test_broadcast_params_with_a_pipeline_and_a_tied_weight(results):
    got = results[0]["pipeline"]
    model = make_model("gpt", seed=0)  # stage 0 and the tied embedding: rank 0's
    stage1 = make_model("gpt", seed=2).state_dict()  # stage 1: rank 2's
    assert got["stage1"] and "wte.weight" not in got["stage1"]
    model.load_state_dict({**model.state_dict(), **{n: stage1[n] for n in got["stage1"]}})
    ref_losses, _, ref_state = reference(model, _batches()[:STEPS])
    assert_losses_close(got["losses"], ref_losses)
    assert_weights_close(got["state"], ref_state)


def test_broadcast_params_copies_half_precision_masters(results):
    for r in results:
        assert r["masters"]["error"] is None, r["masters"]["error"]
        assert r["masters"]["losses"] == results[0]["masters"]["losses"]


def test_a_replica_changed_between_steps_stops_the_next_step(results):
    for r in results:
        drift = r["drift"]["drift"]
        assert drift is not None, "the drifted replica trained on"
        assert drift["message"].startswith(
            f"replicas drifted before train step {STEPS + 1} of this engine: '{PERTURBED}' differs "
            "between "
            "data-parallel replicas: rank 2 holds other values than rank 0."
        ), drift["message"]
        assert drift["parameter"] == PERTURBED and drift["ranks"] == [(2, 0)]


def test_the_collective_section_of_docs_errors_lists_these_rows(results):
    """docs/errors.md's rows found by a collective check, each excerpt in the message raised
    here."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")
    with open(path) as f:
        section = f.read().split("\n## Found by a collective check")[1].split("\n## ")[0]
    rows = dict(
        re.findall(r"^\| `([a-z0-9-]+)` \| [^|]* \| `([^`]*)` \|", section, flags=re.MULTILINE)
    )
    raised = {"replicas-differ": results[0]["tp-dp"]["message"],
              "replicas-drifted": results[0]["drift"]["drift"]["message"]}
    assert rows.keys() == raised.keys()
    for row, excerpt in rows.items():
        assert excerpt in raised[row], row


def test_a_start_up_check_holds_whatever_the_ranks_timing(results):
    """ModernBERT-decoder's rotary tables agree over tp whichever rank comes late (and by
    how much, one after training a float64 copy): each start trains, every rank alike, with
    the losses of single-device PyTorch."""
    want = reference(*_modernbert())[0]
    for i in range(len(APART_S)):
        got = [r["apart"][i] for r in results]
        assert all(isinstance(g, list) for g in got), (i, got)
        assert all(g == got[0] for g in got), (i, got)
        assert_losses_close(got[0], want)


def test_frozen_parameters_and_buffers_must_agree_too(results):
    for r in results:
        assert r["state"]["gpt"] == ("wpe.weight", [(1, 0)])
        assert r["state"]["llama"] == ("rope_cos", [(3, 0)])
        assert r["state"]["broadcast"] == results[0]["state"]["broadcast"]


def test_ranks_that_transform_by_themselves_make_the_same_program(results):
    got = results[0]["alone"]
    # something to agree on
    assert got["tp"] and got["ep"] and got["buffers"] and got["placement"] == (0, 1)
    assert all(r["alone"]["digests"] == got["digests"] for r in results)
    assert len(set(got["digests"])) == 1, f"the ranks' Programs differ: {got['digests']}"
