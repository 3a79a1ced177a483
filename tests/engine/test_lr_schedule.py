"""Learning-rate and weight-decay schedules in samples: each style against its closed
form at a few sample counts, validation, and the scheduler that applies them to an
optimizer (lr / wd multipliers, state round trip)."""

import math

import pytest
import torch

from fxmeg.errors import ConfigError
from fxmeg.lr_schedule import LRSchedule, ParamScheduler

# warmup 100 samples from 0.1 to 1.0, decay to 0.1 by sample 1100
DECAY = dict(max_lr=1.0, min_lr=0.1, warmup_samples=100, init_lr=0.1, decay_samples=1100)


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_is_linear_from_init_lr(style):
    extra = {"wsd_decay_samples": 200} if style == "WSD" else {}
    s = LRSchedule(**DECAY, style=style, **extra)
    for samples, want in [(0, 0.1), (25, 0.325), (50, 0.55), (100, 1.0)]:
        assert close(s.lr(samples), want), (style, samples)


def test_constant_holds_max_lr_after_warmup():
    s = LRSchedule(max_lr=3e-4, min_lr=1e-5, warmup_samples=10, style="constant")
    assert close(s.lr(5), 1.5e-4)
    assert all(s.lr(n) == 3e-4 for n in (11, 1000, 10**9))
    assert LRSchedule(max_lr=2.0, style="constant").lr(0) == 2.0  # no warmup: max at once


def test_linear_decay():
    s = LRSchedule(**DECAY, style="linear")
    # ratio = (samples - 100) / 1000; lr = 0.1 + 0.9 * (1 - ratio)
    for samples, want in [(350, 0.775), (600, 0.55), (1000, 0.19), (1100, 0.1), (5000, 0.1)]:
        assert close(s.lr(samples), want), samples


def test_cosine_decay():
    s = LRSchedule(**DECAY, style="cosine")
    for samples, want in [
        (350, 0.1 + 0.9 * 0.5 * (1 + math.sqrt(0.5))),  # a quarter of the way: cos(pi / 4)
        (600, 0.55),  # half way: cos(pi / 2) = 0
        (850, 0.1 + 0.9 * 0.5 * (1 - math.sqrt(0.5))),
        (1100, 0.1),
        (99999, 0.1),
    ]:
        assert close(s.lr(samples), want), samples
    # monotone after warmup
    lrs = [s.lr(n) for n in range(100, 1101, 50)]
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == len(lrs)


def test_inverse_square_root():
    s = LRSchedule(max_lr=1.0, min_lr=0.3, warmup_samples=100, decay_samples=10**6,
                   style="inverse-square-root")
    assert close(s.lr(400), 0.5)  # sqrt(100 / 400)
    assert close(s.lr(900), 1 / 3)
    assert close(s.lr(10_000), 0.3)  # 0.1 is under the floor
    no_warmup = LRSchedule(max_lr=1.0, decay_samples=100, style="inverse-square-root")
    assert no_warmup.lr(0) == 1.0 and close(no_warmup.lr(16), 0.25)
    assert no_warmup.lr(101) == 0.0  # past decay_samples: min_lr


@pytest.mark.parametrize("wsd_style,mid", [
    ("linear", 0.5),
    ("cosine", 0.5),
    ("exponential", math.sqrt(2) - 1),  # 2 * 0.5 ** 0.5 - 1
    ("minus_sqrt", 1 - math.sqrt(0.5)),
])
def test_wsd_holds_then_anneals(wsd_style, mid):
    s = LRSchedule(**DECAY, style="WSD", wsd_decay_samples=200, wsd_style=wsd_style)
    # stable from the end of warmup up to the anneal start, 1100 - 200 = 900
    assert all(s.lr(n) == 1.0 for n in (101, 500, 900))
    assert close(s.lr(1000), 0.1 + 0.9 * mid)  # half way through the anneal
    assert close(s.lr(1100), 0.1)  # every shape ends exactly at min_lr
    assert s.lr(1101) == 0.1
    assert s.lr(901) < 1.0


def test_weight_decay_schedules():
    assert LRSchedule(max_lr=1.0, style="constant").weight_decay(10) is None
    const = LRSchedule(max_lr=1.0, style="constant", start_wd=0.05, end_wd=0.05)
    assert const.weight_decay(0) == 0.05 and const.weight_decay(10**6) == 0.05
    lin = LRSchedule(**DECAY, start_wd=0.0, end_wd=0.1, wd_incr_samples=1000, wd_style="linear")
    for samples, want in [(0, 0.0), (250, 0.025), (500, 0.05), (1000, 0.1), (10**6, 0.1)]:
        assert close(lin.weight_decay(samples), want), samples
    cos = LRSchedule(**DECAY, start_wd=0.0, end_wd=0.1, wd_incr_samples=1000, wd_style="cosine")
    for samples, want in [(0, 0.0), (250, 0.05 * (1 - math.sqrt(0.5))), (500, 0.05), (1000, 0.1)]:
        assert close(cos.weight_decay(samples), want), samples
    # the increment period defaults to decay_samples (1100)
    dflt = LRSchedule(**DECAY, start_wd=0.2, end_wd=0.0, wd_style="linear")
    assert close(dflt.weight_decay(550), 0.1) and dflt.weight_decay(2000) == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(style="step"), "style='step' is not one of"),
        (dict(style="WSD", wsd_decay_samples=10, wsd_style="square"), "wsd_style='square'"),
        (dict(style="constant", wd_style="exponential"), "wd_style='exponential'"),
        (dict(style="constant", min_lr=2.0), "0 <= min_lr <= max_lr"),
        (dict(style="constant", min_lr=-1e-5), "0 <= min_lr <= max_lr"),
        (dict(style="linear"), "needs decay_samples > warmup_samples = 0; got None"),
        (
            dict(style="cosine", warmup_samples=100, decay_samples=100),
            "decay_samples > warmup_samples = 100",
        ),
        (dict(style="WSD", decay_samples=100), "needs 0 < wsd_decay_samples"),
        (
            dict(style="WSD", warmup_samples=10, decay_samples=100, wsd_decay_samples=91),
            "needs 0 < wsd_decay_samples",
        ),
        (dict(style="constant", start_wd=0.1), "start_wd and end_wd go together"),
        (
            dict(style="constant", start_wd=0.0, end_wd=0.1),
            "wd_style='constant' needs start_wd == end_wd",
        ),
        (
            dict(style="constant", start_wd=0.0, end_wd=0.1, wd_style="linear"),
            "neither is set: set wd_incr_samples",
        ),
        (
            dict(style="constant", warmup_samples=-5),
            "warmup_samples=-5: learning-rate warmup in samples must be an integer >= 0",
        ),
        (
            dict(style="linear", decay_samples=100.0),
            "must be an int, got float 100.0; pass decay_samples=100",
        ),
    ],
)
def test_invalid_schedules_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LRSchedule(max_lr=1.0, **kwargs)


def test_wsd_anneal_may_span_the_whole_decay():
    s = LRSchedule(max_lr=1.0, warmup_samples=10, decay_samples=100, style="WSD",
                   wsd_decay_samples=90, wsd_style="linear")
    assert close(s.lr(55), 0.5)


def _optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr_mult": 0.5, "wd_mult": 0.0}],
                           lr=123.0, weight_decay=7.0)


def test_scheduler_sets_every_group_by_samples():
    sched = LRSchedule(**DECAY, style="linear", start_wd=0.0, end_wd=0.1, wd_incr_samples=1000,
                       wd_style="linear")
    opt = _optimizer()
    ps = ParamScheduler(sched, opt)
    # set at construction: the first step trains with the lr at 0 samples
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    ps.step(32)
    ps.step(68)  # 100 samples: warmup done
    assert ps.samples == 100
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.5]
    ps.step(500)  # 600 samples: half way down the linear decay
    g0, g1 = opt.param_groups
    assert close(g0["lr"], 0.55) and close(g1["lr"], 0.275)
    assert close(g0["weight_decay"], 0.06) and g1["weight_decay"] == 0.0


def test_scheduler_leaves_weight_decay_alone_without_a_wd_schedule():
    opt = _optimizer()
    ParamScheduler(LRSchedule(max_lr=1.0, style="constant"), opt)
    assert [g["weight_decay"] for g in opt.param_groups] == [7.0, 7.0]
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.5]


def test_scheduler_state_round_trip():
    sched = LRSchedule(**DECAY, style="cosine", start_wd=0.1, end_wd=0.0, wd_style="cosine")
    a = ParamScheduler(sched, _optimizer())
    for _ in range(7):
        a.step(48)
    state = a.state_dict()
    assert state == {"samples": 336}
    opt = _optimizer()
    b = ParamScheduler(sched, opt)
    b.load_state_dict(state)
    assert b.samples == 336
    want_lr = 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 236 / 1000) + 1)
    assert close(opt.param_groups[0]["lr"], want_lr)
    assert close(opt.param_groups[1]["lr"], want_lr / 2)
    assert close(
        opt.param_groups[0]["weight_decay"],
        0.1 - 0.1 * 0.5 * (math.cos(math.pi * (1 - 336 / 1100)) + 1),
    )
    b.step(48)  # continues from where it stopped, not from 0
    assert b.samples == 384
