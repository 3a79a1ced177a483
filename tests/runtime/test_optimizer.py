"""Optimizer pieces at world size 1: schedules in samples, the loss scaler, precisions."""

import math

import pytest
import torch

import fxmeg
from fxmeg.errors import ConfigError
from fxmeg.loss_scale import LossScaleConfig, LossScaler
from fxmeg.lr_schedule import LRSchedule, ParamScheduler
from fxmeg.runtime.optimizer.optimizer import param_groups
from tests.harness.helpers import (
    assert_losses_close,
    assert_weights_close,
    learnable_batch,
    make_batch,
    optimizer,
    reference_groups,
)
from tests.harness.models import make_model
from tests.parity.mixed_precision import gather_masters, master_pieces
from tests.parity.mixed_precision import reference as mixed_reference

W, D, MAX, MIN = 100, 1000, 3e-4, 3e-5


@pytest.mark.parametrize("samples,want", [
    (0, 0.0), (50, MAX / 2), (100, MAX),                      # linear warmup from 0
    (550, MIN + (MAX - MIN) * (1 - 450 / 900)),               # linear decay
    (1000, MIN), (5000, MIN),                                 # after decay
])
def test_linear(samples, want):
    assert LRSchedule(MAX, MIN, W, decay_samples=D).lr(samples) == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("samples", [100, 300, 550, 999])
def test_cosine(samples):
    ratio = (samples - W) / (D - W)
    want = MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * ratio) + 1)
    assert LRSchedule(MAX, MIN, W, decay_samples=D, style="cosine").lr(samples) == pytest.approx(
        want
    )


def test_inverse_square_root_and_constant():
    s = LRSchedule(MAX, MIN, W, decay_samples=D, style="inverse-square-root")
    assert s.lr(400) == pytest.approx(MAX * math.sqrt(100) / math.sqrt(400))
    assert s.lr(999) == pytest.approx(max(MIN, MAX * 10 / math.sqrt(999)))
    c = LRSchedule(MAX, warmup_samples=W, style="constant")
    assert c.lr(50) == pytest.approx(MAX / 2) and c.lr(10**6) == MAX


@pytest.mark.parametrize("style,coeff", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5**r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r)),
])
def test_wsd(style, coeff):
    s = LRSchedule(
        MAX, MIN, W, decay_samples=D, style="WSD", wsd_decay_samples=200, wsd_style=style
    )
    assert s.lr(500) == MAX and s.lr(800) == MAX  # stable until the last 200 samples
    assert s.lr(900) == pytest.approx(MIN + (MAX - MIN) * coeff(0.5))


def test_weight_decay_increment():
    lin = LRSchedule(MAX, decay_samples=D, start_wd=0.0, end_wd=0.1, wd_style="linear")
    assert lin.weight_decay(250) == pytest.approx(0.025) and lin.weight_decay(2000) == 0.1
    cos = LRSchedule(MAX, decay_samples=D, start_wd=0.0, end_wd=0.1, wd_style="cosine")
    assert cos.weight_decay(250) == pytest.approx(0.1 * 0.5 * (math.cos(math.pi * 0.75) + 1))
    assert LRSchedule(MAX, decay_samples=D).weight_decay(10) is None


def test_scheduler_sets_groups_and_respects_no_decay_groups():
    p, q = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW(
        [{"params": [p], "wd_mult": 1.0}, {"params": [q], "weight_decay": 0.0, "wd_mult": 0.0}]
    )
    sched = ParamScheduler(LRSchedule(MAX, decay_samples=D, start_wd=0.05, end_wd=0.05), opt)
    assert [g["lr"] for g in opt.param_groups] == [MAX, MAX]  # no warmup: max_lr at once
    sched.step(500)
    assert opt.param_groups[0]["lr"] == pytest.approx(MAX * 0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(style="cosinus"), "style"),
        (dict(decay_samples=50, warmup_samples=100), "decay_samples"),
        (dict(start_wd=0.1), "start_wd"),
        (dict(style="WSD", wsd_decay_samples=5000), "wsd_decay_samples"),
    ],
)
def test_bad_schedule_is_refused(bad, field):
    kwargs = dict(max_lr=1.0, decay_samples=D) | bad
    with pytest.raises(ConfigError, match=field):
        LRSchedule(**kwargs)


def test_loss_scaler_hysteresis_backoff_growth():
    s = LossScaler(
        LossScaleConfig(initial=1024.0, hysteresis=2, growth_interval=3, min_scale=256.0)
    )
    s.update(found_inf=True)
    assert s.scale == 1024.0  # hysteresis absorbs the first overflow
    s.update(found_inf=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024.0  # grew after 3 clean steps, hysteresis restored
    for _ in range(5):
        s.update(found_inf=True)
    assert s.scale == 256.0  # never below min_scale
    static = LossScaler(LossScaleConfig(static=128.0))
    static.update(found_inf=True)
    assert static.scale == 128.0


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_bf16_trains_as_the_mixed_precision_oracle_for_20_steps(name):
    """bf16 parameters with fp32 masters, on labels the model can learn (so a run that
    does not train is far off): every step's loss and grad norm, and every master at
    the end, as the plain-PyTorch mixed-precision oracle's (same arithmetic up to the
    order of fp32 sums)."""
    model = make_model(name)
    batches = [learnable_batch(8, seed=s) for s in range(20)]
    ref = mixed_reference(model, batches, dtype=torch.bfloat16, micro_batch_size=2)
    engine = fxmeg.parallelize(model, tuple(t[:2] for t in batches[0]), global_batch_size=8,
                               optimizer=optimizer, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in engine.named_parameters.values())
    assert all(p.master.dtype == torch.float32 for p in engine.context.optimizer.pieces)
    steps = [engine.train_step(b) for b in batches]
    assert ref["losses"][-1] < 0.93 * math.log(128)  # the oracle learns the labels
    assert_losses_close([s.loss for s in steps], ref["losses"], rtol=2e-3)
    assert_losses_close([s.grad_norm for s in steps], ref["norms"], rtol=1e-4)
    rank = dict(pieces=master_pieces(engine), tp_rank=0, tp_specs=engine.program.tp_specs)
    masters = gather_masters([rank], {n: p.shape for n, p in model.named_parameters()}, 1)
    assert_weights_close(masters, ref["masters"], rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "llama", "hf-gpt2", "hf-qwen3"])
def test_param_groups_are_megatrons_weight_decay_groups(name):
    """fxmeg's default groups against Megatron's rule as the tests write it out
    (tests.harness.helpers.reference_groups): biases and 1-D parameters (norms) do not decay."""
    named = list(make_model(name, n_layer=2).named_parameters())
    got = [(g["param_names"], g.get("weight_decay")) for g in param_groups(named)]
    assert got == [(g["param_names"], g.get("weight_decay")) for g in reference_groups(named)]


def test_engine_schedule_counts_samples_and_reports_the_lr_used():
    sched = LRSchedule(1e-3, warmup_samples=16, decay_samples=64, style="linear")
    engine = fxmeg.parallelize(
        make_model("gpt"), make_batch(2, seed=0), global_batch_size=8, lr_schedule=sched
    )
    lrs = [engine.train_step(make_batch(8, seed=s)).lr for s in range(4)]
    assert lrs == [sched.lr(0), sched.lr(8), sched.lr(16), sched.lr(24)]
    assert lrs[0] == 0.0 and lrs[2] == 1e-3


def test_optimizer_options_are_checked():
    with pytest.raises(
        ConfigError, match="overlap_param_gather=True needs distributed_optimizer=True"
    ):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), overlap_param_gather=True)
    with pytest.raises(ConfigError, match="precision='bf_16' is not one of .*did you mean 'bf16'"):
        fxmeg.parallelize(make_model("gpt"), make_batch(2, seed=0), precision="bf_16")
