"""The engine at world size 1: parity with plain PyTorch, batches, errors."""

import pytest
import torch

import fxmeg
from fxmeg.errors import BatchError, ConfigError
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    make_batch,
    optimizer,
    reference,
)
from tests.harness.models import make_model

GBS, STEPS = 8, 5


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("mbs", [8, 2], ids=["m1", "m4"])
def test_parity_with_plain_pytorch(name, mbs):
    model = make_model(name)
    batches = [make_batch(GBS, seed=s) for s in range(STEPS)]
    ref_losses, ref_norms, ref_state = reference(model, batches)
    engine = fxmeg.parallelize(
        model, tuple(t[:mbs] for t in batches[0]), global_batch_size=GBS, optimizer=optimizer
    )
    assert engine.config.num_microbatches == GBS // mbs
    results = [engine.train_step(b) for b in batches]
    assert_losses_close([r.loss for r in results], ref_losses)
    assert_losses_close([r.grad_norm for r in results], ref_norms, rtol=1e-4)
    assert_weights_close(engine.full_state_dict(), ref_state)
    assert [r.num_tokens for r in results] == [int((b[1] != -100).sum()) for b in batches]
    assert not any(r.skipped for r in results) and results[0].lr == 1e-3


def test_micro_batch_iterator_equals_global_batch():
    model = make_model("llama")
    ids, labels = make_batch(GBS, seed=0)
    a = fxmeg.parallelize(make_model("llama"), (ids[:2], labels[:2]), global_batch_size=GBS)
    b = fxmeg.parallelize(model, (ids[:2], labels[:2]), global_batch_size=GBS)
    ra = a.train_step((ids, labels))
    rb = b.train_step(iter([(ids[i : i + 2], labels[i : i + 2]) for i in range(0, GBS, 2)]))
    assert ra.loss == rb.loss and ra.grad_norm == rb.grad_norm


def test_eval_step_is_the_token_weighted_loss():
    model = make_model("gpt")
    ids, labels = make_batch(12, seed=4)
    engine = fxmeg.parallelize(model, (ids[:2], labels[:2]), global_batch_size=GBS)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    r = engine.eval_step((ids, labels))  # 12 rows: 6 micro-batches, not the training 4
    assert r.num_tokens == int((labels != -100).sum())
    assert abs(r.loss - model(ids, labels).item()) <= 1e-6 * r.loss
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_full_state_dict_has_every_state_dict_name():
    model = make_model("gpt")
    engine = fxmeg.parallelize(model, make_batch(2, seed=0))
    sd = engine.full_state_dict()
    assert list(sd) == list(model.state_dict())  # tied lm_head.weight included
    assert torch.equal(sd["lm_head.weight"], sd["wte.weight"])


def test_indivisible_global_batch_is_refused_before_capture():
    class Uncapturable(torch.nn.Module):  # would fail capture if we got that far
        def forward(self, x, y):
            return x.sum() if x.sum() > 0 else y.sum()

    with pytest.raises(ConfigError) as err:
        fxmeg.parallelize(Uncapturable(), (torch.ones(2, 3), torch.ones(2, 3)), global_batch_size=7)
    assert "global_batch_size=7 is not divisible by micro_batch_size * dp = 2 * 1" in str(err.value)


def test_example_batch_must_match_micro_batch_size():
    with pytest.raises(ConfigError, match="batch dimension is 2, but micro_batch_size=4"):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), micro_batch_size=4)


def test_world_size_must_match_layout():
    with pytest.raises(ConfigError, match=r"tp \* pp \* dp = 1 \* 2 \* 1 = 2 does not match"):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), pp=2, dp=1)


def test_batch_with_wrong_shape_is_refused():
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), global_batch_size=4)
    ids, labels = make_batch(4, seed=0)
    with pytest.raises(BatchError, match=r"'input_ids' has shape \(4, 15\).*expected \(4, 16\)"):
        engine.train_step((ids[:, :15], labels))
    with pytest.raises(BatchError, match=r"'input_ids' has shape \(6, 16\)"):
        engine.train_step((torch.cat([ids, ids[:2]]), torch.cat([labels, labels[:2]])))


def test_failure_inside_the_schedule_names_rank_step_and_action():
    engine = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), global_batch_size=4)
    chunk, calls = engine.context.chunks[0], []
    forward = chunk.forward

    def second_call_fails(*args):
        calls.append(1)
        if len(calls) == 2:
            raise IndexError("index out of range in self")
        return forward(*args)

    chunk.forward = second_call_fails  # the second micro-batch's forward
    with pytest.raises(fxmeg.FxmegError) as err:
        engine.train_step(make_batch(4, seed=0))
    msg = str(err.value)
    assert "rank 0: step 2 (0F1) failed: IndexError" in msg
    assert "0F0 0B0 >>0F1<< 0GS1 0B1" in msg


def _as_dict(batch):
    ids, labels = batch
    return {"input_ids": ids, "labels": labels}


def test_dict_batches_train_exactly_as_tuples():
    """A dict example makes the model take its batch by keyword: train_step, eval_step,
    an iterator of micro-batches and verify take dicts, with the tuple path's results."""
    batches = [make_batch(GBS, seed=s) for s in range(2)]
    tuples = fxmeg.parallelize(
        make_model("llama"), tuple(t[:2] for t in batches[0]), global_batch_size=GBS
    )
    dicts = fxmeg.parallelize(
        make_model("llama"), _as_dict(t[:2] for t in batches[0]), global_batch_size=GBS
    )
    assert dicts.program.keywords and [i.name for i in dicts.program.inputs] == [
        "input_ids",
        "labels",
    ]
    for b in batches:
        assert tuples.train_step(b) == dicts.train_step(_as_dict(b))
    ids, labels = make_batch(GBS, seed=7)
    micro = iter(
        [{"labels": labels[i : i + 2], "input_ids": ids[i : i + 2]} for i in range(0, GBS, 2)]
    )
    assert tuples.train_step((ids, labels)) == dicts.train_step(micro)  # keys in any order
    assert tuples.eval_step((ids, labels)) == dicts.eval_step(_as_dict((ids, labels)))
    assert dicts.verify(_as_dict((ids, labels))).ok


def test_dict_batches_are_checked_key_by_key():
    ids, labels = make_batch(4, seed=0)
    mask = torch.ones_like(ids)
    engine = fxmeg.parallelize(
        make_model("gpt"), _as_dict(make_batch(2, seed=0)), global_batch_size=4
    )
    with pytest.raises(BatchError, match=r"has keys 'input_ids' \(missing 'labels'\)"):
        engine.train_step({"input_ids": ids})
    with pytest.raises(
        BatchError,
        match=r"unknown 'attention_mask'.*the example micro-batch has 'input_ids', 'labels'",
    ):
        engine.train_step({"input_ids": ids, "labels": labels, "attention_mask": mask})
    with pytest.raises(BatchError, match=r"'labels' has shape \(4, 15\)"):
        engine.train_step({"input_ids": ids, "labels": labels[:, :15]})
    with pytest.raises(BatchError, match="must be a dict with the example's keys"):
        engine.eval_step((ids, labels))
    tuples = fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), global_batch_size=4)
    with pytest.raises(BatchError, match=r"the example inputs were a tuple \(input_ids, labels\)"):
        tuples.train_step({"input_ids": ids, "labels": labels})


def test_example_must_be_a_tuple_or_a_dict_of_tensors():
    ids, labels = make_batch(2, seed=0)
    for bad in ([ids, labels], {}, {"input_ids": ids, "labels": labels.tolist()}):
        with pytest.raises(
            ConfigError, match="a non-empty tuple of tensors .* or a dict of tensors"
        ):
            fxmeg.parallelize(make_model("gpt"), bad)
