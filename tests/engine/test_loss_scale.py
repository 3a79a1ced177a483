"""fp16 loss scaling: config validation, and the dynamic scale's update rule (hysteresis
before backing off, growth after clean runs, the floor, a static scale) and its state
round trip, step by step against hand-computed scales."""

import pytest

from fxmeg.errors import ConfigError
from fxmeg.loss_scale import LossScaleConfig, LossScaler


def _scales(scaler: LossScaler, found_infs) -> list[float]:
    out = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        out.append(scaler.scale)
    return out


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(static=0.0), "static must be > 0"),
        (dict(static=-8.0), "static must be > 0"),
        (dict(min_scale=0.0), "0 < min_scale <= initial"),
        (dict(initial=0.5, min_scale=1.0), "0 < min_scale <= initial"),
        (dict(growth_factor=1.0), "growth_factor > 1"),
        (dict(backoff_factor=1.0), "0 < backoff_factor < 1"),
        (dict(backoff_factor=0.0), "0 < backoff_factor < 1"),
        (
            dict(growth_interval=0),
            "growth_interval=0: clean steps before the loss scale grows must be a positive",
        ),
        (
            dict(hysteresis=0),
            "hysteresis=0: overflowing steps tolerated .* must be a positive integer",
        ),
        (dict(hysteresis=2.0), "must be an int, got float 2.0; pass hysteresis=2"),
    ],
)
def test_invalid_configs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LossScaleConfig(**kwargs)


def test_megatron_defaults():
    c = LossScaleConfig()
    assert (c.static, c.initial, c.min_scale) == (None, 2.0**32, 1.0)
    assert (c.growth_factor, c.backoff_factor, c.growth_interval, c.hysteresis) == (
        2.0,
        0.5,
        1000,
        2,
    )
    assert LossScaler(c).scale == 2.0**32


def test_static_scale_never_moves():
    s = LossScaler(LossScaleConfig(static=128.0, growth_interval=1, hysteresis=1))
    assert _scales(s, [True, True, False, False, False]) == [128.0] * 5


def test_without_hysteresis_every_overflow_backs_off():
    s = LossScaler(LossScaleConfig(initial=1024.0, hysteresis=1, growth_interval=100))
    assert _scales(s, [True, True, False, True]) == [512.0, 256.0, 256.0, 128.0]


def test_hysteresis_tolerates_overflows_until_a_growth_resets_it():
    s = LossScaler(LossScaleConfig(initial=1024.0, hysteresis=3, growth_interval=3))
    # two overflows tolerated; the third and every later one back off (clean steps in
    # between do not refill the tolerance, only a growth does)
    assert _scales(s, [True, True, True, False, True, True]) == [
        1024.0,
        1024.0,
        512.0,
        512.0,
        256.0,
        128.0,
    ]
    assert _scales(s, [False, False, False]) == [128.0, 128.0, 256.0]  # growth refills it
    assert _scales(s, [True, True, True]) == [256.0, 256.0, 128.0]


def test_growth_after_growth_interval_clean_steps_in_a_row():
    s = LossScaler(LossScaleConfig(initial=4.0, growth_factor=3.0, growth_interval=3, hysteresis=5))
    assert _scales(s, [False] * 7) == [4.0, 4.0, 12.0, 12.0, 12.0, 36.0, 36.0]
    # an overflow (tolerated: no backoff) restarts the count of clean steps
    assert _scales(s, [True, False, False, True, False, False, False]) == [36.0] * 6 + [108.0]


def test_scale_never_drops_under_min_scale():
    s = LossScaler(LossScaleConfig(initial=16.0, min_scale=3.0, backoff_factor=0.25, hysteresis=1))
    assert _scales(s, [True, True, True]) == [4.0, 3.0, 3.0]


def test_state_round_trip_keeps_the_trackers():
    config = LossScaleConfig(initial=64.0, hysteresis=2, growth_interval=4)
    a = LossScaler(config)
    _scales(a, [True, False, False])  # one overflow tolerated, two clean steps counted
    state = a.state_dict()
    assert state == {"scale": 64.0, "growth": 2, "hysteresis": 1}
    b = LossScaler(config)
    b.load_state_dict(state)
    # restored trackers: the next overflow backs off at once; two more clean steps grow
    assert _scales(b, [False, False]) == [64.0, 128.0]
    c = LossScaler(config)
    c.load_state_dict(state)
    assert _scales(c, [True]) == [32.0]
    fresh = LossScaler(config)  # without the trackers, the same steps differ
    assert _scales(fresh, [True]) == [64.0]
