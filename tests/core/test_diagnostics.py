"""mpx.diagnostics: the framework-neutral arithmetic (thresholds, headroom, advice, report ordering)."""

import logging
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx.diagnostics import (
    DiagnosticsError,
    NonfiniteSite,
    advise,
    headroom_log2,
    nonfinite_report,
    underflow_reference,
)


def test_thresholds_come_from_dtype_info():
    tiny = mpx.dtype_info("float16").smallest_normal
    sub = mpx.dtype_info("float16").smallest_subnormal
    g = np.array([tiny, np.nextafter(np.float32(tiny), 0), sub, sub / 2, sub * 0.51, 0.0], np.float32)
    layer = underflow_reference({"g": g}, scale=1.0, scaled=True).layers[0]
    # tiny is normal, and so is the float32 just below it (it rounds up to tiny in float16); sub is
    # subnormal; sub/2 rounds (to even) to 0; 0.51*sub rounds up to sub: classified after the cast
    assert (layer.zero_fraction, layer.subnormal_fraction, layer.lost_fraction) == (2 / 6, 2 / 6, 1 / 6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=50), st.integers(-4, 20),
       st.sampled_from(["float16", "bfloat16"]))  # fmt: skip
def test_reference_against_a_direct_numpy_count(values, scale_exp, compute):
    g = np.array(values, np.float32)
    scale = 2.0**scale_exp
    s = g * np.float32(scale)
    with np.errstate(over="ignore"):
        c = np.abs(s.astype(ml_dtypes.bfloat16 if compute == "bfloat16" else np.float16).astype(np.float64))
    tiny = mpx.dtype_info(compute).smallest_normal
    layer = underflow_reference([("g", g)], scale=scale, compute_dtype=compute).layers[0]
    assert layer.zero_fraction == np.mean(c == 0)
    assert layer.subnormal_fraction == np.mean((c > 0) & (c < tiny))
    assert layer.lost_fraction == np.mean((c == 0) & (s != 0))
    assert layer.max_abs_scaled == float(np.max(np.abs(s)))


def test_headroom():
    assert headroom_log2(65504.0) == 0.0
    assert headroom_log2(65504.0 / 1024) == 10.0
    assert headroom_log2(0.0) == math.inf
    assert headroom_log2(float("inf")) == -math.inf and headroom_log2(float("nan")) == -math.inf


def test_advice_rules():
    assert "too low" in advise("float16", 1.0, 0.05, 10.0)
    assert "2**9" in advise("float16", 1.0, 0.05, 10.0)
    assert advise("float16", 1.0, 0.005, 10.0) is None  # under 1% lost: fine
    assert advise("float16", 1.0, 0.05, 1.5) is None  # no room to raise it
    assert "too high" in advise("float16", 2.0**16, 0.0, 0.5)
    assert "too high" in advise("float16", 2.0**16, 0.0, -3.0)
    assert "does not help" in advise("bfloat16", 1.0, 0.05, 100.0)
    assert advise("bfloat16", 1.0, 0.0, 100.0) is None


def test_report_totals_and_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="mpx.diagnostics"):
        report = underflow_reference({"a": np.zeros(3, np.float32), "b": np.full(1, 1e-9, np.float32)},
                                     scale=1.0, log=True)  # fmt: skip
    assert report.underflow_fraction == 1.0 and report.lost_fraction == 0.25
    assert report.headroom_log2 == headroom_log2(np.float32(1e-9))
    assert report.by_name()["a"].size == 3 and report.by_name()["b"].lost_fraction == 1.0
    (line,) = [r for r in caplog.records if r.name == "mpx.diagnostics"]
    assert "100.00% zero or subnormal" in line.getMessage() and "worst 'b'" in line.getMessage()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "x"])
def test_bad_scale_raises(bad):
    with pytest.raises(DiagnosticsError, match="scale"):
        underflow_reference({"a": np.ones(2, np.float32)}, scale=bad)
    assert issubclass(DiagnosticsError, mpx.MPXError)


def test_nonfinite_report_prefers_forward_then_backward_order(caplog):
    g = NonfiniteSite("gradient", "w", math.inf, 0, 1)
    b = NonfiniteSite("backward", "layer2", math.inf, 0, 4)
    f = NonfiniteSite("forward", "layer1", math.inf, 0, 2)
    assert nonfinite_report("x", [g, b], log=False).origin == "w"  # the backward pass's order decides
    assert nonfinite_report("x", [b, g], log=False).origin == "layer2"
    with caplog.at_level(logging.INFO, logger="mpx.diagnostics"):
        report = nonfinite_report("x", [b, f, g], scale=8.0)
    assert report.origin == "layer1" and report.first.kind == "forward"
    assert report.gradient_sites == (g,)
    assert caplog.records[-1].levelno == logging.WARNING
    assert "forward output of 'layer1'" in caplog.records[-1].getMessage() and "loss scale 8" in report.summary()
    clean = nonfinite_report("x", [], checked=3, log=False)
    assert clean.finite and clean.origin is None and "all finite (3 checked" in str(clean)
