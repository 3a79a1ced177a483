"""Gradient buffers and the reduction event log, at world size 1 (no processes)."""

import fxmeg
from tests.harness.helpers import assert_overlapped, make_batch
from tests.harness.models import make_model


def _engine(**kw):
    return fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), global_batch_size=8, **kw)


def test_every_main_grad_is_a_view_of_exactly_one_buffer():
    engine = _engine(bucket_size=3000)
    buffers = engine.context.ddp.all()
    for name, p in engine.named_parameters.items():
        owners = [
            b
            for b in buffers
            if p.main_grad.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr()
        ]
        assert len(owners) == 1, name
        slot = owners[0].layout.slot(name)
        assert p.main_grad.data_ptr() == owners[0].data[slot.offset:].data_ptr()
        assert p.main_grad.shape == p.shape


def test_buffers_survive_steps_without_reallocation():
    engine = _engine(bucket_size=3000)
    ptrs = [b.data.data_ptr() for b in engine.context.ddp.all()]
    views = {n: p.main_grad.data_ptr() for n, p in engine.named_parameters.items()}
    for seed in range(3):
        engine.train_step(make_batch(8, seed=seed))
    assert [b.data.data_ptr() for b in engine.context.ddp.all()] == ptrs
    assert {n: p.main_grad.data_ptr() for n, p in engine.named_parameters.items()} == views
    assert all(p.grad is None for p in engine.named_parameters.values())
    engine.context.ddp.zero_grad_buffer()
    assert all(float(b.data.abs().sum()) == 0.0 for b in engine.context.ddp.all())


def test_reductions_wait_for_the_last_microbatch_and_follow_bucket_order():
    engine = _engine(bucket_size=3000)
    engine.train_step(make_batch(8, seed=0))
    (buf,) = engine.context.ddp.all()
    assert len(buf.layout.buckets) >= 4
    assert_overlapped(engine.context.ddp.events.log, buf.layout, chunk=0)


def test_without_overlap_everything_is_reduced_at_the_end_in_one_bucket():
    engine = _engine(overlap_grad_reduce=False, bucket_size=3000)
    engine.train_step(make_batch(8, seed=0))
    log = engine.context.ddp.events.log
    (buf,) = engine.context.ddp.all()
    assert len(buf.layout.buckets) == 1
    assert log[-1] == ("issue", "chunk0/0") and sum(k == "issue" for k, _ in log) == 1
