"""The core's accumulation reference: windows, one transition per window, a bad window skipped whole."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx


def test_one_transition_per_window():
    cfg = mpx.ScalerConfig(init_scale=8.0, growth_interval=2)
    flags = [True, True, True, True, False, True, True, True, True, True]
    assert mpx.accumulation_trace(cfg, flags, 2) == [
        {"applied": True, "scale": 8.0},
        {"applied": True, "scale": 16.0},  # the 2nd good window grows, not the 4th micro-batch
        {"applied": False, "scale": 8.0},  # one bad micro-batch skips its window whole
        {"applied": True, "scale": 8.0},
        {"applied": True, "scale": 16.0},
    ]


def test_steps_1_is_the_plain_scaler():
    cfg = mpx.ScalerConfig(init_scale=4.0, growth_interval=1, hysteresis=2)
    flags = [True, False, False, True, False]
    scaler = mpx.LossScaler(cfg)
    want = []
    for f in flags:
        scaler.update(f)
        want.append({"applied": f, "scale": scaler.get_scale()})
    assert mpx.accumulation_trace(cfg, flags, 1) == want


def test_without_skipping_every_window_applies():
    cfg = mpx.ScalerConfig(kind="none")
    assert [w["applied"] for w in mpx.accumulation_trace(cfg, [True, False, True, True], 2)] == [True, True]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=12), st.integers(1, 4))
def test_trace_is_the_scaler_over_window_flags(steps, windows, interval):
    cfg = mpx.ScalerConfig(init_scale=2.0**8, growth_interval=interval)
    micro = []
    for i, good in enumerate(windows):
        bad_at = None if good else i % steps
        micro += [j != bad_at for j in range(steps)]
    trace = mpx.accumulation_trace(cfg, micro, steps)
    assert [w["applied"] for w in trace] == windows == mpx.window_flags(micro, steps)
    scaler = mpx.LossScaler(cfg)
    for good, w in zip(windows, trace, strict=True):
        scaler.update(good)
        assert w["scale"] == scaler.get_scale()


@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, True, np.bool_(True), "2", None])
def test_bad_steps_raise_naming_the_field(bad):
    with pytest.raises(mpx.MPXError, match=r"^accumulate: expected an int >= 1"):
        mpx.check_accumulation_steps(bad)


def test_numpy_ints_are_steps():
    assert mpx.check_accumulation_steps(np.int64(4), "gradient_accumulation_steps") == 4


def test_a_partial_window_is_an_error():
    with pytest.raises(mpx.MPXError, match="5 micro-batches is not a whole number of windows of 2"):
        mpx.window_flags([True] * 5, 2)
