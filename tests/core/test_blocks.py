"""Block-scaled kernels (#31 item 2) against a straightforward numpy + ml_dtypes reference.

The reference works per block in float64 with ml_dtypes casts (``np.frexp`` for exponents, a
float64 product, one rounding cast); the kernels work on float32 bits over the array-ops table.
Inputs: random, subnormal, NaN, inf, all-zero and mixed-magnitude blocks, shapes that no block
divides, every element format, scale format and rule, both reduction axes.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpx.blocks import PRESETS, BlockRecipe
from mpx.kernels import blocks as kb
from mpx.kernels import elements as ke
from mpx.kernels.array_ops import NUMPY_OPS, NumpyOps

NP = NUMPY_OPS
FLUSHING = NumpyOps(exact_float32=False, float64=False)  # the XLA/TF way of computing: same bits
DT = {name: getattr(ml_dtypes, t) for name, t in {
    "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn",
    "e2m3": "float6_e2m3fn", "e3m2": "float6_e3m2fn"}.items()}  # fmt: skip
RECIPES = {  # the nearest-rounding presets (stochastic rounding and the RHT: test_blocks_random.py)
    **{name: r for name, r in PRESETS.items() if r.rounding == "nearest" and not r.hadamard},
    "mxfp8_even": BlockRecipe(scale_rule="even"),
    "mxfp8_e5m2": BlockRecipe(element="e5m2", grad_element="e4m3"),
    "mxfp6_e2m3": BlockRecipe(element="e2m3", scale_rule="rceil"),
    "mxfp6_e3m2": BlockRecipe(element="e3m2", input_block="4x4", weight_block="tensor", grad_block="row"),
    "nvfp4_one_level": BlockRecipe(element="e2m1", input_block="1x16", weight_block="16x16", scale="e4m3",
                                   scale_rule="nearest"),
    "fp8_f32": BlockRecipe(input_block="1x8", scale="float32", scale_rule="nearest"),
}  # fmt: skip


def _code(value: float, fmt: str) -> int:
    """The reference element code: saturate, then ml_dtypes' round-to-nearest-even cast."""
    limit = ke.max_value(fmt)
    if math.isnan(value):
        nan = ke.ELEMENT_FORMATS[fmt].nan_code
        return ke.ELEMENT_FORMATS[fmt].max_code if nan is None else nan
    v = np.float64(min(max(value, -limit), limit))
    return int(np.asarray(v).astype(DT[fmt]).view(np.uint8))


_code_v = np.vectorize(_code, otypes=[np.int32])


def _exponent(a: float) -> int:
    """floor(log2 a) of a float32 as its exponent field reads it (a subnormal or zero: -127)."""
    if math.isinf(a):
        return 128
    return -127 if a < 2.0**-126 else math.frexp(a)[1] - 1


def _e8m0(amax: float, fmt: str, rule: str) -> int:
    f = ke.ELEMENT_FORMATS[fmt]
    if math.isnan(amax):
        return 255
    if rule == "rceil":
        if math.isinf(amax):
            return 254
        d = float(np.float32(amax) / np.float32(f.max_value))  # IEEE float32, subnormals kept
        if d == 0.0:
            return 0
        m, e = math.frexp(d)
        return min(max(e - 1 if m == 0.5 else e, -127), 127) + 127
    if rule == "even" and not math.isinf(amax):  # torchao EVEN: round the mantissa to the element's bits
        b = int(np.float32(amax).view(np.int32)) + (1 << (22 - f.mbits))
        amax = float(np.int32(b & 0x7F800000).view(np.float32))
    return min(max(_exponent(amax) - f.max_exp, -127), 128) + 127


def _pow2_scale(amax: float, fmt: str, pow2: bool) -> float:
    if not math.isfinite(amax):
        return 1.0
    s = float(np.float32(ke.max_value(fmt) / max(amax, 1e-12)))
    s = min(s, float(np.finfo(np.float32).max))
    return math.ldexp(1.0, math.frexp(s)[1] - 1) if pow2 else s


def reference(
    x: np.ndarray, recipe: BlockRecipe, role: str, axis: int
) -> tuple[np.ndarray, np.ndarray, float]:
    fmt, (br, bc) = recipe.element_of(role), recipe.block_of(role)
    xt = (x if axis == 1 else x.T).astype(np.float32)
    rows, cols = xt.shape
    br, bc = br or rows, bc or cols
    nr, nc = -(-rows // br), -(-cols // bc)
    codes = np.zeros(xt.shape, np.int32)
    scales = np.zeros((nr, nc), np.float32 if recipe.scale in ("pow2", "float32") else np.int32)
    ts = None
    if recipe.scale == "e4m3_f32":
        t_amax = float(np.max(np.abs(xt)))
        ts = (
            max(float(np.float32(t_amax) / np.float32(2688.0)), 2.0**-126)
            if not math.isnan(t_amax)
            else t_amax
        )
        ts = float(np.float32(ts))
    for i in range(nr):
        for j in range(nc):
            blk = xt[i * br : (i + 1) * br, j * bc : (j + 1) * bc].astype(np.float64)
            amax = float(np.max(np.abs(blk)))
            if recipe.scale == "e8m0":
                c = _e8m0(amax, fmt, recipe.scale_rule)
                scales[i, j] = c
                mult = 1.0 if recipe.scale_rule == "rceil" and c == 0 else math.ldexp(1.0, 127 - max(c, 1))
                vals = np.full(blk.shape, np.nan) if c == 255 else blk * mult
            elif recipe.scale in ("pow2", "float32"):
                s = _pow2_scale(amax, fmt, recipe.scale == "pow2")
                scales[i, j] = np.float32(1.0) / np.float32(s)
                vals = (blk.astype(np.float32) * np.float32(s)).astype(np.float64)
            else:
                bs = np.float32(np.float32(max(amax, 6 * 2.0**-126)) / np.float32(6.0))
                if ts is not None:
                    bs = np.float32(bs / np.float32(ts))
                c = _code(float(np.clip(bs, 2.0**-6, 448.0)), "e4m3")
                scales[i, j] = c
                sf = np.float32(np.uint8(c).view(DT["e4m3"]))
                r = np.float32(1.0) / sf if ts is None else (np.float32(1.0) / np.float32(ts)) / sf
                vals = (
                    np.full(blk.shape, np.nan)
                    if np.isnan(sf)
                    else (blk.astype(np.float32) * r).astype(np.float64)
                )
            codes[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = _code_v(vals, fmt)
    return (codes if axis == 1 else codes.T), scales, ts


def _block_values(draw, n: int) -> np.ndarray:
    kind = draw(st.sampled_from(["random", "subnormal", "special", "zero", "mixed", "bits"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "random":
        return (rng.standard_normal(n) * np.exp(rng.uniform(-60, 60))).astype(np.float32)
    if kind == "subnormal":
        return (rng.integers(-(2**23), 2**23, n).astype(np.int32) & np.int32(-0x7F800001)).view(np.float32)
    if kind == "zero":
        return np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0))
    if kind == "bits":
        return rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32).view(np.float32)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-80, 80, n))).astype(np.float32)
    if kind == "special":
        x[rng.integers(0, n, 3)] = rng.choice([np.nan, np.inf, -np.inf, 0.0, 448.0, 6.0, 3.4e38], 3)
    return x


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(RECIPES)))
    rows, cols = draw(st.sampled_from([(1, 1), (3, 40), (33, 17), (130, 20), (16, 64)]))
    parts = [_block_values(draw, rows) for _ in range(cols)]  # column by column: zero/NaN blocks either axis
    x = np.stack(parts, axis=1)
    return x, name, draw(st.sampled_from(["input", "weight", "grad"])), draw(st.sampled_from([0, 1]))


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.int32) if a.dtype == np.float32 else a,
                                                 b.view(np.int32) if b.dtype == np.float32 else b)  # fmt: skip


@settings(max_examples=120, deadline=None)
@given(cases())
def test_quantize_matches_the_numpy_reference(case) -> None:
    x, name, role, axis = case
    recipe = RECIPES[name]
    codes, scales, ts = reference(x, recipe, role, axis)
    q = kb.quantize(NP, x, recipe, role, axis)
    assert _same(q.scales, scales), (name, role, axis, q.scales, scales)
    assert _same(q.codes, codes), (name, role, axis, np.argwhere(q.codes != codes)[:4])
    assert (ts is None) == (q.tensor_scale is None)
    if ts is not None:  # a NaN tensor scale (a NaN in x) matches as NaN: its payload is the division's
        assert _same(q.tensor_scale, np.float32(ts)) or (np.isnan(ts) and np.isnan(q.tensor_scale))
    # the flushing table (XLA's and TF's arithmetic) gives the same bits
    f = kb.quantize(FLUSHING, x, recipe, role, axis)
    assert _same(f.codes, q.codes) and _same(f.scales, q.scales)
    back, back_f = kb.dequantize(NP, q, recipe, role, axis), kb.dequantize(FLUSHING, q, recipe, role, axis)
    nan = np.isnan(back)
    assert np.array_equal(nan, np.isnan(back_f)) and _same(np.where(nan, 0, back), np.where(nan, 0, back_f))


@settings(max_examples=40, deadline=None)
@given(cases())
def test_dequantize_is_element_times_scale(case) -> None:
    x, name, role, axis = case
    recipe = RECIPES[name]
    q = kb.quantize(NP, x, recipe, role, axis)
    back = kb.dequantize(NP, q, recipe, role, axis)
    fmt, (br, bc) = recipe.element_of(role), recipe.block_of(role)
    ct = q.codes if axis == 1 else q.codes.T
    br, bc = br or ct.shape[0], bc or ct.shape[1]
    elem = np.asarray(ct.astype(np.uint8)).view(DT[fmt]).astype(np.float64)
    if recipe.scale == "e8m0":
        s = np.where(q.scales == 255, np.nan, np.ldexp(1.0, q.scales.astype(np.int64) - 127))
    elif recipe.scale in ("pow2", "float32"):
        s = q.scales.astype(np.float64)
    else:
        s = q.scales.astype(np.uint8).view(DT["e4m3"]).astype(np.float32)
        if q.tensor_scale is not None:
            s = s * np.float32(q.tensor_scale)
    full = np.repeat(np.repeat(s, br, 0), bc, 1)[: ct.shape[0], : ct.shape[1]]
    want = (elem * full).astype(np.float32)
    want = np.where(np.abs(want) < 2.0**-126, np.copysign(np.float32(0), want), want).astype(np.float32)
    want = want if axis == 1 else want.T
    nan = np.isnan(want)
    assert np.array_equal(nan, np.isnan(back)) and _same(np.where(nan, 0, back), np.where(nan, 0, want))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64),
    st.sampled_from(sorted(DT)),
    st.integers(-140, 140),
)
def test_element_codes_match_ml_dtypes(raw, fmt, shift) -> None:
    x = np.asarray(raw, np.int64).astype(np.int32).view(np.float32)
    want = _code_v(x.astype(np.float64) * 2.0**shift, fmt)
    got = ke.encode(NP, x, fmt, shift)
    assert np.array_equal(got, want) and np.array_equal(ke.encode(FLUSHING, x, fmt, shift), want)
    dec = ke.decode(NP, got, fmt)
    ref = got.astype(np.uint8).view(DT[fmt]).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(nan, np.isnan(dec)) and _same(np.where(nan, 0, dec), np.where(nan, 0, ref))


def test_zero_nan_inf_blocks_are_as_documented() -> None:
    x = np.zeros((3, 32), np.float32)
    x[0, 1] = -0.0
    x[1, 3], x[1, 4] = np.nan, 1.0
    x[2, 5], x[2, 6] = np.inf, 1.0
    floor = kb.quantize(NP, x, PRESETS["mxfp8"], "input")
    rceil = kb.quantize(NP, x, PRESETS["mxfp8_rceil"], "input")
    assert floor.scales[:, 0].tolist() == [0, 255, 255 - 8] and rceil.scales[:, 0].tolist() == [0, 255, 254]
    assert (floor.codes[1] == 0x7F).all() and floor.codes[2, 5] == 0x7E  # NaN block; inf saturates
    fp4 = kb.quantize(NP, x, PRESETS["mxfp4"], "input")
    assert (fp4.codes[1] == 0x7).all()  # no NaN in FP4: the largest code, the scale says NaN
    assert np.isnan(kb.dequantize(NP, fp4, PRESETS["mxfp4"], "input")[1]).all()
    nv = kb.quantize(NP, x[[0]], PRESETS["nvfp4"], "input")  # an all-zero tensor: floors, no NaN
    assert float(nv.tensor_scale) == 2.0**-126 and (nv.codes & 0x7 == 0).all() and nv.codes[0, 1] == 0x8


def test_bad_axis_and_unknown_element_raise() -> None:
    import mpx

    with pytest.raises(mpx.Float8Error, match="axis"):
        kb.quantize(NP, np.zeros((2, 2), np.float32), PRESETS["mxfp8"], "input", axis=2)
    with pytest.raises(mpx.Float8Error, match="element"):
        ke.encode(NP, np.zeros(2, np.float32), "e9m9")
