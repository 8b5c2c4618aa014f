"""The kernels (mpx.kernels) against plain float64 statements of each rule, and both numpy tables against each other.

The core's reference functions (``mpx.scaler_update``, ``mpx.float8.quantize``, ``compute_scale``,
``float8_update``) *are* the kernels run with the numpy table, so they are checked here against
oracles: the rules written the obvious way, in Python floats (float64), as the docs state them.
``NumpyOps(exact_float32=False, float64=False)`` runs every kernel the way the XLA and TensorFlow
tables do (products from the bits, no float64): :mod:`kernel_parity` requires its bits to equal
the reference table's, as every backend's parity test does for its own table.
"""

import math

import kernel_parity
import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mpx
from mpx.kernels import NUMPY_OPS, NumpyOps
from mpx.kernels import float8 as kf
from mpx.kernels import ring as kr
from mpx.kernels import scale as ks

BITS_OPS = NumpyOps(exact_float32=False, float64=False)
TABLES = pytest.mark.parametrize("o", [NUMPY_OPS, BITS_OPS], ids=["numpy", "numpy-bits"])
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

# numpy's reference table against its integer-arithmetic twin, on every kernel
globals().update(kernel_parity.make_tests(lambda: BITS_OPS, max_examples=150))


# -- oracles: the rules in Python floats ------------------------------------------------------------


def f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def oracle_scale_product(scale: float, factor: float) -> float:
    """torch's rule: one float64 product, one rounding to float32."""
    return f32(float(scale) * float(factor))


def oracle_scaler_update(config: mpx.ScalerConfig, state: mpx.ScalerState, finite: bool) -> mpx.ScalerState:
    """DESIGN.md's pseudocode, with the bounds and the non-finite-growth rule, and DeepSpeed's modes
    (the first growth ``first_growth_delay`` steps later; the hysteresis budget refilled on growth only)."""
    cap = mpx.COUNTER_MAX
    scale, tracker, since = state.scale, state.growth_tracker, state.nonfinite_since_growth
    consecutive = 0 if finite else min(state.consecutive_nonfinite + 1, cap)
    by_growth = config.hysteresis_reset == "growth"
    if config.kind == "dynamic":
        lo, hi = config.bounds
        if finite:
            tracker += 1
            if tracker == config.growth_interval + config.first_growth_delay:
                grown = oracle_scale_product(scale, config.growth_factor)
                if math.isfinite(grown):
                    scale = min(grown, hi)
                tracker = config.first_growth_delay
                since = 0
        else:
            tracker = 0
            since = min(since + 1, cap) if by_growth else 0
            if (since if by_growth else consecutive) >= config.hysteresis:
                scale = max(oracle_scale_product(scale, config.backoff_factor), lo)
    skipped = (not finite) and config.skip_nonfinite
    return mpx.ScalerState(
        scale, tracker, consecutive, min(state.steps + 1, cap), min(state.skipped_steps + int(skipped), cap), since
    )


def oracle_compute_scale(recipe: mpx.Float8Recipe, amax: float, fmt: str, previous: float = 1.0) -> float:
    """mpx.float8's module docs: float64, then one rounding to float32."""
    amax = float(amax)
    if recipe.scaling == "current":
        if not math.isfinite(amax):
            return 1.0
        amax = max(amax, kf.CURRENT_AMAX_FLOOR)
    elif not math.isfinite(amax) or amax <= 0.0:
        return f32(previous)
    value = math.ldexp(mpx.float8.fp8_max(fmt) / amax, -recipe.margin)
    scale = F32_MAX if value >= F32_MAX else f32(value)
    scale = max(scale, F32_TINY)
    if recipe.power_of_two:
        scale = math.ldexp(1.0, math.frexp(scale)[1] - 1)
    return scale


def oracle_quantize(x: np.ndarray, scale: float, fmt: str) -> np.ndarray:
    limit = np.float32(mpx.float8.fp8_max(fmt))
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        scaled = np.asarray(x, np.float32) * np.float32(scale)
    return np.clip(scaled, -limit, limit).astype(mpx.float8.FORMATS[fmt])


# -- the loss scale -----------------------------------------------------------------------------------


TINY_BITS = int(np.float32(2.0**-126).view(np.int32))


@settings(max_examples=300, deadline=None)
@given(kernel_parity.FACTORS, st.lists(st.integers(0x00800000, 0x7F7FFFFF), min_size=1, max_size=32))
# the exact product 2**-126 - 2**-150 is a tie between float32's largest subnormal and 2**-126: the float64
# rule rounds it (to even) up to 2**-126, the bits path calls it below 2**-126 (0); both floor to 2**-126
@example(0.5, [0x00FFFFFF])
def test_scale_product_equals_the_float64_rule_both_ways(factor, scale_bits):
    """Every product at or above 2**-126 is the float64 rule's float32, bit for bit; below it (where the
    callers floor the scale at 2**-126) the result is 0, or 2**-126 itself when float32's subnormal
    rounding carries the product up to it: floored at 2**-126, every table agrees."""
    scales = np.asarray(scale_bits, np.int32).view(np.float32)
    split = mpx.scaling.split_factor(factor)
    for o in (NUMPY_OPS, BITS_OPS):
        got = ks.scale_product_bits(o, scales, factor, split)
        for s, g in zip(scales, got, strict=True):
            exact = float(s) * factor  # the float64 product, as the bits path rounds it first
            want = oracle_scale_product(float(s), factor)
            want_bits = 0 if want < 2.0**-126 else int(np.float32(want).view(np.int32))
            if exact >= 2.0**-126:
                assert g == want_bits, (o, s, factor)
            else:
                assert g in (0, want_bits) and max(int(g), TINY_BITS) == max(want_bits, TINY_BITS), (o, s, factor)


@TABLES
def test_product_bits_double_rounding_case(o):
    """3 * f is exactly 4 + 2**-22 + 2**-53, just above a float32 tie: the float64 product is the tie,
    which rounds to even, 4.0 (not 4 + 2**-21, the once-rounded exact product)."""
    f = 1.333333412806193
    got = ks.scale_product_bits(o, np.float32([3.0]), f, mpx.scaling.split_factor(f))
    assert got.view(np.float32)[0] == 4.0


@settings(max_examples=200, deadline=None)
@given(kernel_parity.scaler_configs(), st.lists(st.booleans(), min_size=1, max_size=40))
def test_scaler_update_is_the_oracle(config, flags):
    got = want = mpx.scaler_init(config)
    for finite in flags:
        got, want = mpx.scaler_update(config, got, finite), oracle_scaler_update(config, want, finite)
        assert got == want


@TABLES
def test_counters_saturate(o):
    cap = mpx.COUNTER_MAX
    state = ks.ScaleState(o.float32(8.0), o.int32(0), o.int32(cap), o.int32(cap), o.int32(cap), o.int32(0))
    out = ks.update(o, mpx.ScalerConfig(init_scale=8.0), state, np.bool_(False))
    assert [int(v) for v in out[1:]] == [0, cap, cap, cap, 0]
    state = ks.ScaleState(o.float32(8.0), o.int32(0), o.int32(cap), o.int32(cap), o.int32(cap), o.int32(cap))
    out = ks.update(o, mpx.ScalerConfig(init_scale=8.0, hysteresis_reset="growth"), state, np.bool_(False))
    assert [int(v) for v in out[1:]] == [0, cap, cap, cap, cap]


# -- FP8 -------------------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(kernel_parity.FLOAT32, min_size=1, max_size=50),
    kernel_parity.SCALE,
    st.sampled_from(["e4m3", "e5m2"]),
)
def test_quantize_is_the_oracle(values, scale, fmt):
    x = np.asarray(values, np.float32)
    want = oracle_quantize(x, scale, fmt)
    for got in (mpx.float8.quantize(x, scale, fmt), kf.quantize(BITS_OPS, x, np.float32(scale), fmt)):
        kernel_parity.assert_same_bits(got, want, f"quantize({values}, {scale}, {fmt})")


@settings(max_examples=400, deadline=None)
@given(kernel_parity.RECIPES, kernel_parity.AMAX, st.sampled_from(["e4m3", "e5m2"]), kernel_parity.SCALE)
def test_compute_scale_is_the_oracle(recipe, amax, fmt, previous):
    want = oracle_compute_scale(recipe, f32(amax), fmt, previous)
    got = mpx.float8.compute_scale(recipe, amax, fmt, previous)
    assert got == want or (math.isnan(got) and math.isnan(want)), (recipe, amax, fmt, got, want)


def test_compute_scale_edges():
    r = mpx.Float8Recipe()
    assert mpx.float8.compute_scale(r, 2.0**-149, "e4m3") == F32_MAX  # 448 / tiny overflows: the ceiling
    assert mpx.float8.compute_scale(mpx.Float8Recipe(margin=20), F32_MAX, "e4m3") == F32_TINY  # the floor
    assert mpx.float8.compute_scale(r, 0.0, "e4m3", 3.0) == 3.0  # keeps the previous scale
    assert mpx.float8.compute_scale(mpx.Float8Recipe(margin=10**6), 1.0, "e4m3") == F32_TINY
    current = mpx.Float8Recipe(scaling="current")
    assert mpx.float8.compute_scale(current, math.nan, "e4m3") == 1.0
    assert mpx.float8.compute_scale(current, 0.0, "e4m3") == f32(448 / 1e-12)


@settings(max_examples=150, deadline=None)
@given(kernel_parity.RECIPES, st.lists(kernel_parity.AMAX, min_size=1, max_size=12), st.booleans())
def test_float8_update_is_the_oracle(recipe, amaxes, skip_some):
    """float8_update against the docs' rule: record finite amaxes, scale from the window's max or the last."""
    state = mpx.float8_init(recipe, {"x": "grad"})
    scale, history = 1.0, [0.0] * (recipe.amax_history_len if recipe.scaling == "delayed" else 0)
    for i, amax in enumerate(amaxes):
        skipped = skip_some and i % 3 == 2
        state = mpx.float8_update(recipe, state, {"x": amax}, skipped=skipped)
        if skipped:
            pass
        elif recipe.scaling == "current":
            scale = oracle_compute_scale(recipe, f32(amax), recipe.format_of("grad"), scale)
        else:
            if math.isfinite(amax):
                history = [f32(amax), *history][: recipe.amax_history_len]
            window = history[0] if recipe.amax_compute == "most_recent" else max(history)
            scale = oracle_compute_scale(recipe, window, recipe.format_of("grad"), scale)
        assert state.tensors["x"].scale == scale and list(state.tensors["x"].amax_history) == history


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(kernel_parity.AMAX, min_size=2, max_size=2), min_size=1, max_size=5))
def test_reduce_amaxes_nan_wins(rows):
    got = mpx.float8.reduce_amaxes({"a": a, "b": b} for a, b in rows)
    for key, column in (("a", [r[0] for r in rows]), ("b", [r[1] for r in rows])):
        column = [f32(v) for v in column]
        want = math.nan if any(math.isnan(v) for v in column) else max(column)
        assert got[key] == want or (math.isnan(got[key]) and math.isnan(want))


def test_quantize_keeps_subnormal_products_in_both_tables():
    """A subnormal x times a scale that makes it an FP8 normal: XLA would flush x; the bits path does not."""
    x = np.float32([2.0**-130, -(2.0**-128)])
    for o in (NUMPY_OPS, BITS_OPS):
        q = kf.quantize(o, x, np.float32(2.0**127), "e4m3")
        assert q.dtype == ml_dtypes.float8_e4m3fn and q.astype(np.float32).tolist() == [0.125, -0.5]


# -- the history ring ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), min_size=1, max_size=12))
def test_ring_keeps_the_last_capacity_written_rows(capacity, when):
    config = mpx.ScalerConfig(growth_interval=2)
    flags = [i % 4 != 3 for i in range(len(when))]
    ref = mpx.ScalerHistory.reference(config, flags)
    rows, recorded = np.zeros((capacity, 4), np.int32), np.int32(0)
    written = []
    for i, write in enumerate(when):
        row = kr.row(NUMPY_OPS, np.float32(ref.scale[i]), i % 2, 0 if flags[i] else 1, ref.steps[i])
        rows, recorded = kr.record(NUMPY_OPS, rows, recorded, row, np.bool_(write))
        if write:
            written.append(i)
    history = mpx.ScalerHistory.from_rows(config, rows, int(recorded))
    keep = written[-capacity:]
    assert history.steps == [ref.steps[i] for i in keep]
    assert history.scale == [ref.scale[i] for i in keep]


def test_ring_capacity_is_checked():
    with pytest.raises(mpx.MPXError, match=r"capacity: expected an int in \[1, 2\*\*31 - 1\]"):
        kr.check_capacity(0)
    assert kr.check_capacity(3) == 3
