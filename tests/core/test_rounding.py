"""The rounding kernels (mpx.kernels.rounding) with the numpy table: round to nearest against ml_dtypes' cast,
stochastic rounding (exact values unchanged, the two neighbours only, unbiased, reproducible from its counters)
and optimi's Kahan step against bfloat16 arithmetic."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpx.kernels import NUMPY_OPS as o
from mpx.kernels import rounding as kr

BF16 = ml_dtypes.bfloat16
BITS = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64).map(
    lambda b: np.asarray(b, np.int32).view(np.float32)
)


def _neighbours(x):
    """The bfloat16 values at or below and at or above finite ``x`` (as float32), by truncating the bits."""
    b = x.view(np.int32)
    down = (b & -65536).view(np.float32)  # towards zero
    up = np.where((b & 0xFFFF) == 0, b, (b & -65536) + 65536).view(np.float32)  # away from zero
    return down, up


@settings(max_examples=60, deadline=None)
@given(BITS)
def test_round_to_nearest_is_the_bfloat16_cast(x):
    with np.errstate(invalid="ignore"):
        got, want = kr.round_bf16(o, x), x.astype(BF16).astype(np.float32)
    assert got.dtype == np.float32
    assert (np.isnan(got) == np.isnan(want)).all()
    ok = ~np.isnan(want)
    assert (got[ok].view(np.int32) == want[ok].view(np.int32)).all()


@settings(max_examples=60, deadline=None)
@given(BITS, st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1), st.integers(0, 2**16))
def test_stochastic_rounding_picks_a_neighbour_and_keeps_exact_values(x, seed, step, param):
    got = kr.stochastic_round_bf16(o, x, seed=seed, step=step, param=param)
    assert got.dtype == np.float32 and (got.view(np.int32) & 0xFFFF == 0).all()
    finite = np.isfinite(x)
    down, up = _neighbours(x[finite])
    g = got[finite].view(np.int32)
    assert ((g == down.view(np.int32)) | (g == up.view(np.int32))).all()
    exact = x[finite].astype(BF16).astype(np.float32) == x[finite]  # representable: never changed
    assert (g[exact] == x[finite][exact].view(np.int32)).all()
    assert np.array_equal(np.isnan(got), np.isnan(x)) and (got[np.isinf(x)] == x[np.isinf(x)]).all()
    again = kr.stochastic_round_bf16(o, x, seed=seed, step=np.int32(step), param=param)
    assert np.array_equal(again.view(np.int32), got.view(np.int32))  # a pure function of its counters


@pytest.mark.parametrize("value", [1.001953125, -3.14159, 1e-3, 7.0e-39, 0.3333333])
def test_stochastic_rounding_is_unbiased(value):
    """Over 2**16 elements (and over 2000 steps of one element) the mean lands within 4 standard errors."""
    x = np.full(1 << 16, value, np.float32)
    down, up = _neighbours(x[:1])
    gap, frac = (
        float(up[0]) - float(down[0]),
        (float(x[0]) - float(down[0])) / (float(up[0]) - float(down[0])),
    )
    se = abs(gap) * np.sqrt(frac * (1 - frac) / x.size)
    r = kr.stochastic_round_bf16(o, x, seed=1234, step=7, param=3).astype(np.float64)
    assert abs(r.mean() - float(x[0])) < 4 * se + 1e-45
    assert abs(r.var() - gap**2 * frac * (1 - frac)) < 0.05 * gap**2 * frac * (1 - frac) + 1e-90
    steps = np.stack([kr.stochastic_round_bf16(o, x[:1], seed=5, step=s, param=0) for s in range(2000)])
    assert abs(steps.astype(np.float64).mean() - float(x[0])) < 4 * abs(gap) * np.sqrt(
        frac * (1 - frac) / 2000
    )


def test_the_counters_each_change_the_bits():
    index = np.arange(4096, dtype=np.int32)
    base = kr.random_bits(o, index, seed=0, step=0, param=0)
    assert base.dtype == np.int32 and base.min() >= 0 and base.max() < 2**16
    assert len(np.unique(base)) > 3900  # close to a random function's 4096 * (1 - 1/e) ... distinct per index
    for change in ({"seed": 1}, {"step": 1}, {"param": 1}, {"seed": 1 << 16}, {"step": 1 << 16}):
        other = kr.random_bits(o, index, **({"seed": 0, "step": 0, "param": 0} | change))
        assert (other != base).mean() > 0.99, change


def _kahan_reference(w, c, u):
    """optimi's write-back in ml_dtypes' bfloat16 arithmetic (each op in float32, rounded to bfloat16)."""
    c1 = (c.astype(np.float32) + u).astype(BF16)
    w1 = w + c1
    return w1, c1 + (w - w1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 32).flatmap(lambda n: st.tuples(*(st.lists(st.floats(-1e3, 1e3, width=32), min_size=n,
                                                                 max_size=n) for _ in range(3)))))  # fmt: skip
def test_kahan_add_is_optimis_write_back_in_bfloat16_arithmetic(values):
    w, c = (np.asarray(v, np.float32).astype(BF16) for v in values[:2])
    c = (c.astype(np.float32) * 2.0**-9).astype(BF16)
    u = np.asarray(values[2], np.float32) * np.float32(2.0**-7)
    w1, c2 = kr.kahan_add(o, w.astype(np.float32), c.astype(np.float32), u)
    rw, rc = _kahan_reference(w, c, u)
    assert np.array_equal(w1.view(np.int32), rw.astype(np.float32).view(np.int32))
    assert np.array_equal(c2.view(np.int32), rc.astype(np.float32).view(np.int32))


def test_kahan_keeps_updates_that_round_to_nearest_loses():
    w = np.full(64, 1.0, np.float32)
    c = np.zeros(64, np.float32)
    plain = w.copy()
    u = np.float32(1e-4)  # far below bfloat16's gap at 1.0 (2**-7)
    for _ in range(1000):
        w, c = kr.kahan_add(o, w, c, u)
        plain = kr.round_bf16(o, plain + u)
    assert (plain == 1.0).all()  # every update lost
    # the weight and its (bfloat16) compensation keep them, to a few percent of the 0.1 added
    assert np.allclose(w.astype(np.float64) + c, 1.1, atol=5e-3) and (w > 1.09).all()
