"""Stochastic rounding and the random Hadamard transform of the block-scaled kernels (#31 item 1).

Stochastic rounding: the two neighbours only, exactly representable values unchanged, unbiased
(measured against a binomial bound), reproducible from ``(seed, step, index)`` and the same bits on
the flushing table.  The Hadamard transform: equal to a float64 ``x S H`` within float32 rounding,
orthogonal (the weight-gradient product is kept), Transformer Engine's fixed signs, padding.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from mpx.blocks import PRESETS, BlockRecipe
from mpx.kernels import blocks as kb
from mpx.kernels import elements as ke
from mpx.kernels import hadamard as kh
from mpx.kernels.array_ops import NUMPY_OPS, NumpyOps
from mpx.kernels.rounding import random_bits

NP = NUMPY_OPS
FLUSHING = NumpyOps(exact_float32=False, float64=False)
FORMATS = sorted(ke.ELEMENT_FORMATS)
SR = {
    "nvfp4_sr": BlockRecipe(element="e2m1", input_block="1x16", weight_block="16x16", grad_block="1x16",
                            scale="e4m3_f32", scale_rule="nearest", rounding="stochastic"),
    "mxfp8_sr": BlockRecipe(rounding="stochastic"),
    "mxfp4_rceil_sr": BlockRecipe(element="e2m1", scale_rule="rceil", rounding="stochastic"),
    "blockwise_sr": BlockRecipe(input_block="1x128", weight_block="128x128", grad_block="1x128",
                                scale="pow2", rounding="stochastic"),
}  # fmt: skip
H16 = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], np.float64) / 4


def _sr(x, fmt, seed=1, step=0, param=0):
    x = np.asarray(x, np.float32)
    bits = random_bits(NP, NP.iota(x), seed=seed, step=step, param=param)
    return ke.encode(NP, x, fmt, 0, bits)


def _neighbours(x, fmt):
    """The representable values just below and above |x| (as magnitudes), from the format's table."""
    grid = ke.decode(NP, np.arange(ke.ELEMENT_FORMATS[fmt].max_code + 1, dtype=np.int32), fmt)
    grid = np.unique(grid[np.isfinite(grid)]).astype(np.float64)
    a = np.minimum(np.abs(np.asarray(x, np.float64)), grid[-1])
    lo = grid[np.searchsorted(grid, a, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, a, side="left"), len(grid) - 1)]
    return lo, hi


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e5, 1e5, width=32), min_size=1, max_size=64),
    st.sampled_from(FORMATS),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**31 - 1),
)
def test_stochastic_encode_picks_a_neighbour_and_keeps_exact_values(xs, fmt, seed, step) -> None:
    x = np.asarray(xs, np.float32)
    got = np.abs(ke.decode(NP, _sr(x, fmt, seed, step), fmt).astype(np.float64))
    lo, hi = _neighbours(x, fmt)
    assert np.all((got == lo) | (got == hi)), (x, got, lo, hi)
    exact = lo == np.abs(x.astype(np.float64))
    assert np.array_equal(got[exact], lo[exact])
    # the same bits again, and on the table that flushes subnormals (XLA's and TF's arithmetic)
    bits = random_bits(FLUSHING, FLUSHING.iota(x), seed=seed, step=step, param=0)
    assert np.array_equal(ke.encode(FLUSHING, x, fmt, 0, bits), _sr(x, fmt, seed, step))


@pytest.mark.parametrize(("fmt", "value"), [("e2m1", 0.2), ("e2m1", -4.7), ("e4m3", 0.3), ("e5m2", 1e-6),
                                            ("e2m3", 0.01), ("e3m2", -0.013)])  # fmt: skip
def test_stochastic_encode_is_unbiased(fmt, value) -> None:
    n = 1 << 17
    x = np.full(n, value, np.float32)
    got = ke.decode(NP, _sr(x, fmt, seed=9, step=3), fmt).astype(np.float64)
    lo, hi = _neighbours(x[:1], fmt)
    p = (abs(float(x[0])) - lo[0]) / (hi[0] - lo[0])
    assert 0 < p < 1 and set(np.abs(got)) == {lo[0], hi[0]}
    sd = (hi[0] - lo[0]) * np.sqrt(p * (1 - p) / n)
    assert abs(got.mean() - float(x[0])) < 4.5 * sd + (hi[0] - lo[0]) * 2.0**-16


def test_stochastic_rounding_is_keyed_by_seed_step_and_index() -> None:
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    r = SR["nvfp4_sr"]
    q = kb.quantize(NP, x, r, "grad", 1, seed=5, step=2, index=3)
    assert np.array_equal(q.codes, kb.quantize(NP, x, r, "grad", 1, seed=5, step=2, index=3).codes)
    for other in ({"seed": 6, "step": 2, "index": 3}, {"seed": 5, "step": 3, "index": 3},
                  {"seed": 5, "step": 2, "index": 4}):  # fmt: skip
        assert not np.array_equal(q.codes, kb.quantize(NP, x, r, "grad", 1, **other).codes)
    # inputs and weights round to nearest whatever the seed; the scales are the nearest rule's
    for role in ("input", "weight"):
        assert np.array_equal(
            kb.quantize(NP, x, r, role, 1, seed=5).codes, kb.quantize(NP, x, _nearest(r), role, 1).codes
        )
    assert np.array_equal(q.scales, kb.quantize(NP, x, _nearest(r), "grad", 1).scales)


def _nearest(r: BlockRecipe) -> BlockRecipe:
    return dataclasses.replace(r, rounding="nearest")


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(sorted(SR)), st.integers(0, 2**16), st.sampled_from([0, 1]))
def test_stochastic_quantize_is_unbiased_and_table_independent(name, data_seed, axis) -> None:
    recipe = SR[name]
    rng = np.random.default_rng(data_seed)
    x = (rng.standard_normal((20, 40)) * np.exp(rng.uniform(-8, 8))).astype(np.float32)
    x[3] = 0.0
    runs = []
    for step in range(32):
        q = kb.quantize(NP, x, recipe, "grad", axis, seed=11, step=step, index=1)
        if step < 2:
            f = kb.quantize(FLUSHING, x, recipe, "grad", axis, seed=11, step=step, index=1)
            assert np.array_equal(f.codes, q.codes) and np.array_equal(f.scales, q.scales)
        runs.append(kb.dequantize(NP, q, recipe, "grad", axis).astype(np.float64))
    runs = np.stack(runs)
    near = kb.dequantize(NP, kb.quantize(NP, x, _nearest(recipe), "grad", axis), recipe, "grad", axis)
    step_size = np.abs(runs.max(0) - runs.min(0))
    # each element takes at most its two neighbours (one of them the nearest); the mean is x within a
    # few binomial sigmas (the largest, p = 1/2), on average about one
    assert np.all(np.abs(runs - near) <= step_size * (1 + 1e-9))
    moved = step_size > 0
    assert moved.mean() > 0.3
    err = np.abs(runs.mean(0) - x)[moved] / (step_size[moved] * 0.5 / np.sqrt(32))
    assert np.mean(err) < 1.2 and np.all(err < 6)
    assert np.all(runs[:, 3] == 0.0)


def test_quantize_without_a_seed_raises_naming_it() -> None:
    x = np.ones((4, 16), np.float32)
    with pytest.raises(mpx.Float8Error, match="seed"):
        kb.quantize(NP, x, PRESETS["nvfp4_te"], "grad", 1)
    with pytest.raises(mpx.Float8Error, match="seed"):
        kb.quantize(NP, x, PRESETS["nvfp4_te"], "input", 0)
    with pytest.raises(mpx.Float8Error, match="index"):
        kb.quantize(NP, x, PRESETS["nvfp4_te"], "grad", 1, seed=0, index=65535)
    kb.quantize(NP, x, PRESETS["nvfp4_te"], "input", 1)  # the forward operands need none


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.sampled_from([0, 1]), st.integers(0, 2**16))
def test_rht_is_x_s_h_and_keeps_the_product(m, n, axis, seed) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n) if axis == 0 else (n, m)).astype(np.float32)
    mask = kh.sign_mask(NP, seed=seed, step=3)
    y = kh.rht(NP, x, mask, axis)
    mp = -(-m // 16) * 16
    xt = x if axis == 1 else x.T
    xp = np.zeros((n, mp))
    xp[:, :m] = xt
    ref = (xp.reshape(-1, 16) @ np.diag(np.where(mask == 1, -1.0, 1.0)) @ H16).reshape(n, mp)
    got = y if axis == 1 else y.T
    assert got.shape == (n, mp) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=4 * 2.0**-23 * np.abs(xp).sum(1, keepdims=True).max())
    assert np.array_equal(kh.rht(FLUSHING, x, mask, axis).view(np.int32), y.view(np.int32))
    # the weight-gradient product of two transformed operands is the original's
    if axis == 0:
        dy = rng.standard_normal((m, 3)).astype(np.float32)
        prod = kh.rht(NP, dy, mask, 0).T.astype(np.float64) @ y
        np.testing.assert_allclose(prod, dy.T.astype(np.float64) @ x, atol=1e-4 * m)


def test_rht_signs_te_vector_and_specials() -> None:
    a, b = kh.sign_mask(NP, seed=1, step=0), kh.sign_mask(NP, seed=1, step=1)
    assert a.shape == (16,) and set(a.tolist()) <= {0, 1} and not np.array_equal(a, b)
    assert np.array_equal(a, kh.sign_mask(NP, seed=1, step=0))
    e = np.eye(16, dtype=np.float32)
    te = kh.rht(NP, e, np.asarray(kh.TE_SIGNS, np.int32), 1)  # rows of S H: TE's rht matrix
    signs = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)
    assert np.array_equal(te, np.diag(signs) @ H16)
    x = np.zeros((2, 16), np.float32)
    x[0, 5], x[1, 2], x[1, 3] = np.inf, 2.0**-140, 2.0**-125
    y = kh.rht(NP, x, np.zeros(16, np.int32), 1)
    assert np.all(np.isinf(y[0]) | np.isnan(y[0])) and np.all(y[1] == 0.0)  # subnormals are signed zeros


def test_nvfp4_te_wgrad_operands_are_transformed_and_padded() -> None:
    r = PRESETS["nvfp4_te"]
    rng = np.random.default_rng(4)
    x, dy = rng.standard_normal((20, 32)).astype(np.float32), rng.standard_normal((20, 16)).astype(np.float32)
    assert kb.randomized(r, "input", 0) == (False, True) and kb.randomized(r, "grad", 0) == (True, True)
    assert kb.randomized(r, "grad", 1) == (True, False) and kb.randomized(r, "weight", 0) == (False, False)
    qx = kb.quantize(NP, x, r, "input", 0, seed=2, step=5)
    qd = kb.quantize(NP, dy, r, "grad", 0, seed=2, step=5, index=1)
    assert qx.codes.shape == (32, 32) and qd.codes.shape == (32, 16)
    dw = kb.dequantize(NP, qd, r, "grad", 0).T.astype(np.float64) @ kb.dequantize(NP, qx, r, "input", 0)
    exact = dy.T.astype(np.float64) @ x
    assert np.abs(dw - exact).max() < 0.5 * np.abs(exact).max()
