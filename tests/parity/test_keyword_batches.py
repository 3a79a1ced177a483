"""Keyword batches on real gloo ranks: a Hugging Face Llama trained on padded dict batches
(input_ids, attention_mask, labels; with left padding also position_ids) at
tp=2 x pp=2 x dp=2, in one spawn of 8 ranks, against plain single-device training that
calls the model with the same dicts. Pads are token 0, the embedding's padding row (no
gradient); their labels are -100 (no loss); the mask keeps them out of attention. The
mask is an input like the others: the first chunk reads it and builds the 4-D attention
mask, which crosses the cut, and tensor parallelism keeps it whole (it broadcasts over
heads). Right padding is what fine-tuning collators make, but a causal model's real
tokens never see the pads after them, so only left padding shows a lost mask (5e-4 on
the loss): it runs with sdpa (a boolean mask; pad queries see no key) and with eager
attention (an additive float mask), and with sequence parallelism (the mask stays whole while the
hidden states are split along the sequence). In the same spawn, Megatron's masks as the
trainer feeds them (``--eod-mask-loss --reset-position-ids --reset-attention-mask``: the
documents packed in a window do not see each other, positions restart, no loss on an
end-of-document input; a 4-D mask input) at tp2 x pp2 x dp2 and cp2 x tp2 x dp2 (keys and values
all-gathered, and through the ring: cp_comm_type p2p); and SFT
conversations as the trainer lays them out (--sft, loss on the assistant turns alone:
tests/data/test_sft.py), packed (examples kept apart by positions and a 4-D mask) and padded
(each step its own length, variable_seq_lengths), at tp2 x pp2 x dp2."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import fxmeg
from tests.harness.distributed import run_world
from tests.harness.helpers import assert_losses_close, assert_weights_close, optimizer, train_dicts
from tests.harness.models import hf_model

LAYOUT = dict(tp=2, pp=2, dp=2)
MBS, M, STEPS, SEQ, PAD = 2, 2, 3, 16, 0
GBS = MBS * M * LAYOUT["dp"]
CASES = ("right-sdpa", "left-sdpa", "left-eager", "left-sdpa-sp")  # sp: sequence parallelism too
MASKED = {"megatron-masks": LAYOUT, "megatron-masks-cp": dict(cp=2, tp=2, dp=2),
          "megatron-masks-cp-p2p": dict(cp=2, tp=2, dp=2, cp_comm_type="p2p")}  # the ring
SFT = {"sft-packed": LAYOUT, "sft-padded": LAYOUT | dict(variable_seq_lengths=True)}
EOD = 1


def model(case: str) -> torch.nn.Module:
    attention = "sdpa" if case in MASKED or case in SFT else case.split("-")[1]
    return hf_model("llama", n_layer=4, pad_token_id=PAD, attn_implementation=attention)


def padded(rows: int, *, seed: int, side: str) -> dict[str, torch.Tensor]:
    """A batch padded to SEQ: row r holds 4 + (3 * r + seed) % 13 real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (rows, SEQ), generator=g)
    mask = torch.zeros(rows, SEQ, dtype=torch.long)
    for r in range(rows):
        n = 4 + (3 * r + seed) % (SEQ - 3)
        mask[r, :n] = 1
    if side == "left":
        mask = mask.flip(1)
    ids[mask == 0] = PAD
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if side == "left":  # positions count real tokens, as generate() makes them
        batch["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    return batch


def batches(case: str) -> list[dict[str, torch.Tensor]]:
    if case in MASKED:
        return megatron_batches(masks=True)
    if case in SFT:
        return sft_batches(case.split("-")[1])
    return [padded(GBS, seed=10 * s + len(case), side=case.split("-")[0]) for s in range(STEPS)]


def megatron_batches(*, masks: bool) -> list[dict[str, torch.Tensor]]:
    """The trainer's batches (``model_batch`` of ``train_data``) of documents 1 to 11 tokens
    long, each ending in EOD, with Megatron's three mask switches (or none)."""
    import numpy as np

    from fxmeg.data.indexed import write_indexed
    from fxmeg.train.trainer import TrainConfig, model_batch, train_data

    prefix = os.path.join(tempfile.mkdtemp(prefix="fxmeg-masks-"), "data")
    rng = np.random.default_rng(5)
    write_indexed(
        prefix,
        (np.append(rng.integers(2, 128, int(rng.integers(1, 12))), EOD) for _ in range(80)),
        np.uint16,
    )
    switches = (
        dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
        if masks
        else {}
    )
    cfg = TrainConfig.from_flat(
        data=prefix,
        split="90,10,0",
        seq_len=SEQ,
        global_batch_size=GBS,
        micro_batch_size=MBS,
        train_iters=STEPS,
        eval_iters=1,
        vocab_size=128,
        eod_id=EOD,
        **switches,
    )
    data = train_data(cfg)
    shutil.rmtree(os.path.dirname(prefix))
    return [
        model_batch(data.fields("train", range(s * GBS, (s + 1) * GBS)), keywords=True)
        for s in range(STEPS)
    ]


def sft_batches(layout: str) -> list[dict[str, torch.Tensor]]:
    """The trainer's batches of 40 random conversations (tests/harness/sft_data.py) in
    ``layout``."""
    from fxmeg.train.trainer import TrainConfig, model_batch, train_data
    from tests.harness import sft_data

    root = tempfile.mkdtemp(prefix="fxmeg-sft-")
    lines = sft_data.write_lines(os.path.join(root, "c.jsonl"), sft_data.conversations(40, seed=4))
    cfg = TrainConfig.from_flat(
        sft=True,
        sft_layout=layout,
        data_path=lines,
        split="80,20,0",
        seq_len=4 * SEQ,
        tokenizer_model=sft_data.write_tokenizer(os.path.join(root, "tok")),
        chat_template=sft_data.write_template(os.path.join(root, "chat.jinja")),
        global_batch_size=GBS,
        micro_batch_size=MBS,
        train_iters=STEPS,
        eval_iters=1,
        variable_seq_lengths=layout == "padded",
        sft_pad_multiple=4,
    )
    data = train_data(cfg)
    shutil.rmtree(root)
    return [
        model_batch(data.fields("train", range(s * GBS, (s + 1) * GBS)), keywords=True)
        for s in range(STEPS)
    ]


def run(rank: int) -> dict:
    out = {}
    for case in (*CASES, *MASKED, *SFT):
        data = batches(case)
        engine = fxmeg.parallelize(
            model(case),
            {k: t[:MBS] for k, t in data[0].items()},
            global_batch_size=GBS,
            optimizer=optimizer,
            **(MASKED | SFT).get(case, LAYOUT),
            sequence_parallel=case.endswith("-sp"),
        )
        steps = [engine.train_step(b) for b in data]
        out[case] = dict(losses=[s.loss for s in steps], tokens=[s.num_tokens for s in steps],
                         eval=engine.eval_step(data[0]).loss, state=engine.full_state_dict())
    return out


def reference(case: str) -> tuple[list[float], float, dict]:
    losses, ref = train_dicts(model(case), batches(case))
    with torch.no_grad():
        final = ref(**batches(case)[0], use_cache=False).loss.item()
    return losses, final, ref.state_dict()


@pytest.fixture(scope="module")
def results():
    return run_world(8, run)


@pytest.mark.parametrize("case", CASES)
def test_padded_dict_batches_train_as_on_one_device(results, case):
    ranks = [r[case] for r in results]
    for r in ranks:  # every rank reports the same steps
        assert r["losses"] == ranks[0]["losses"] and r["eval"] == ranks[0]["eval"]
    losses, final, state = reference(case)
    # each labelled token counts once: shift by one (HF), pads and the first token carry no loss
    want_tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in batches(case)]
    assert ranks[0]["tokens"] == want_tokens
    assert_losses_close(ranks[0]["losses"], losses)
    assert_losses_close([ranks[0]["eval"]], [final])
    assert_weights_close(ranks[0]["state"], state)


def _as_on_one_device(results, case: str) -> tuple[list[dict], dict]:
    """Every rank reports the same steps, which count the targets of the trainer's batches
    (shift_labels) and equal plain training on them; (the batches, the reference state)."""
    ranks = [r[case] for r in results]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"] and r["eval"] == ranks[0]["eval"]
    losses, final, state = reference(case)
    data = batches(case)
    assert ranks[0]["tokens"] == [int((b["shift_labels"] != -100).sum()) for b in data]
    assert_losses_close(ranks[0]["losses"], losses)
    assert_losses_close([ranks[0]["eval"]], [final])
    assert_weights_close(ranks[0]["state"], state)
    return data, state


@pytest.mark.parametrize("case", list(MASKED))
def test_megatrons_masks_train_as_on_one_device(results, case):
    data, state = _as_on_one_device(results, case)
    # the loss mask counts: every end-of-document input is left out
    assert all(
        int((b["shift_labels"] == -100).sum()) >= int((b["input_ids"] == EOD).sum()) > 0
        for b in data
    )
    # and the masks matter: the same training without them ends outside these tolerances
    _, unmasked = train_dicts(model(case), megatron_batches(masks=False))
    with pytest.raises(AssertionError):
        assert_weights_close(unmasked.state_dict(), state)


@pytest.mark.parametrize("case", list(SFT))
def test_sft_conversations_train_as_on_one_device(results, case):
    data, _ = _as_on_one_device(results, case)
    if case == "sft-padded":  # the steps have their own lengths
        assert len({b["input_ids"].shape[1] for b in data}) > 1
