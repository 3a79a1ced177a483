"""Variable sequence lengths (``variable_seq_lengths=True``) on real gloo ranks: steps of
three different lengths (16, the example's; then 8 and 12, each compiled once and met
again) train like plain single-device training, at pp2 x dp2 (GPT, learned positions),
tp2 x pp2 (Llama: rotary tables sliced to the length, GQA), zero-bubble ZB-H1 at
pp2 x dp2 (the B / W split made per shape), context parallelism cp2 x pp2 (each length
cut into its own load-balanced chunks) and pp4 with middle stages
that read no data and learn each step's shape from the others; and a Hugging Face Llama
on padded dict batches (dynamic padding: each batch as long as its longest row) at
tp2 x pp2 and at cp2 x dp2. One spawn of 4 ranks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import fxmeg
from fxmeg.errors import BatchError
from tests.harness.distributed import run_world
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    digests,
    make_batch,
    model_loss,
    optimizer,
    train_dicts,
)
from tests.harness.models import hf_model
from tests.parity.scenarios import Scenario, check_parity

LENGTHS = (16, 8, 12, 8, 16)  # STEPS = 5 batches
VARIABLE = (("variable_seq_lengths", True),)


@dataclass(frozen=True)
class Varying(Scenario):
    def batches(self):
        return [make_batch(self.gbs, seed=100 + s, seq=n) for s, n in enumerate(LENGTHS)]


CASES = [
    Varying("gpt", pp=2, dp=2, m=2, options=VARIABLE),
    Varying("llama", tp=2, pp=2, m=2, options=VARIABLE),
    Varying("gpt", pp=4, m=4, options=VARIABLE),
    Varying("llama", pp=2, dp=2, m=2, schedule="zbh1", options=VARIABLE),  # I / W graphs per shape
    Varying("llama", cp=2, pp=2, m=2, options=VARIABLE),  # each length cut in 2 * cp chunks
]
EVAL = dict(seed=7, seq=12)


def padded(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Rows of these real lengths, right-padded (token 0, label -100) to the longest."""
    g = torch.Generator().manual_seed(seed)
    seq = max(lengths)
    ids = torch.randint(1, 128, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


HF_BATCHES = [
    padded([16, 9, 5, 12], 0),
    padded([3, 8, 7, 6], 1),
    padded([12, 4, 10, 11], 2),
    padded([8, 8, 2, 5], 3),
]


def hf_llama():
    return hf_model("llama", n_layer=4, pad_token_id=0)


def run_hf(**layout) -> dict:
    engine = fxmeg.parallelize(
        hf_llama(),
        {k: t[:2] for k, t in HF_BATCHES[0].items()},
        global_batch_size=4,
        optimizer=optimizer,
        variable_seq_lengths=True,
        **layout,
    )
    steps = [engine.train_step(b) for b in HF_BATCHES]
    return dict(losses=[s.loss for s in steps], compiled=[key for key, _ in engine.shapes.compiled],
                state=engine.full_state_dict())


HF_LAYOUTS = {"hf": {"tp": 2, "pp": 2}, "hf-cp": {"cp": 2, "dp": 2}}
"""The padded batches' layouts: at cp the mask input stays whole, and each new length is
captured on meta (its causal mask evaluated there)."""


def run(rank: int) -> dict:
    out = {name: run_hf(**layout) for name, layout in HF_LAYOUTS.items()}
    for sc in CASES:
        engine = sc.engine()
        feeds = engine.needs_data
        steps, grads = [], []
        for b in sc.batches():
            # collective: every rank gathers
            step = engine.train_step(b if feeds else None, full_grads=True)
            steps.append(dataclasses.replace(step, grads=None))
            grads.append(step.grads)
        evaluated = engine.eval_step(
            make_batch(sc.gbs, **EVAL) if feeds else None, num_microbatches=sc.m
        ).loss
        state = engine.full_state_dict()
        try:
            engine.train_step(make_batch(sc.gbs, seed=1, seq=24) if feeds else None)
            error = "no error"
        except BatchError as e:
            error = str(e)
        ids, labels = make_batch(sc.gbs, seed=1)
        try:  # 1-D input ids on the stages that read data: every stage stops, none waits
            engine.train_step((ids[:, 0], labels) if feeds else None)
            refused = "no error"
        except BatchError as e:
            refused = str(e)
        out[sc.id] = dict(
            steps=steps,
            grads=grads if rank == 0 else None,
            grad_digests=[digests(g) for g in grads],
            state=state if rank == 0 else None,
            state_digests=digests(state),
            feeds=feeds,
            eval=evaluated,
            compiled=[key for key, _ in engine.shapes.compiled],
            error=error,
            refused=refused,
        )
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(4, run)


@pytest.mark.parametrize("sc", CASES, ids=lambda sc: sc.id)
def test_steps_of_three_lengths_train_as_on_one_device(results, sc):
    ranks = [r[sc.id] for r in results]
    check_parity(ranks, sc)
    reference = sc.make_model()
    reference.load_state_dict(ranks[0]["state"])
    with torch.no_grad():
        want = model_loss(reference, *make_batch(sc.gbs, **EVAL)).item()
    for r in ranks:
        assert_losses_close([r["eval"]], [want])


@pytest.mark.parametrize("sc", CASES, ids=lambda sc: sc.id)
def test_each_new_length_is_compiled_once_on_every_rank(results, sc):
    ranks = [r[sc.id] for r in results]
    inputs = 2  # input_ids, labels
    for r in ranks:
        assert r["compiled"] == [((8,),) * inputs, ((12,),) * inputs]
    if sc.pp == 4:  # the middle stages took part without data
        assert [r["feeds"] for r in ranks].count(False) == 2


@pytest.mark.parametrize("sc", CASES, ids=lambda sc: sc.id)
def test_a_length_above_the_position_table_is_refused_naming_both(results, sc):
    table = "table 'rope_cos'" if sc.model == "llama" else "position embedding 'wpe'"
    for r in results:
        message = r[sc.id]["error"]
        assert "sequence length 24" in message and f"{table}" in message and "16 rows" in message, (
            message
        )


@pytest.mark.parametrize("name", HF_LAYOUTS)
def test_padded_hugging_face_batches_of_varying_length_train_as_on_one_device(results, name):
    losses, ref = train_dicts(hf_llama(), HF_BATCHES)
    for r in results:
        assert r[name]["losses"] == results[0][name]["losses"]
        assert r[name]["compiled"] == [((8,),) * 3, ((12,),) * 3]
    assert_losses_close(results[0][name]["losses"], losses)
    assert_weights_close(results[0][name]["state"], ref.state_dict())


def test_a_batch_refused_on_the_stages_with_data_stops_every_stage(results):
    """Middle stages read no data: they learn of the refusal in the shape agreement
    instead of waiting for activations that never come."""
    sc = next(sc for sc in CASES if sc.pp == 4)
    for r in (r[sc.id] for r in results):
        want = (
            "a batch must hold 2 tensors"
            if r["feeds"]
            else "another pipeline stage refused its batch"
        )
        assert want in r["refused"], r["refused"]
