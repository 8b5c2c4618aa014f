"""The core's block kernels against torchao 0.18's emulation, bit for bit (data and scales).

``torchao.prototype.mx_formats``: ``to_mx`` (FLOOR, RCEIL, EVEN; e4m3, e5m2, e2m1, e2m3, e3m2
elements, blocks of 32 along the last axis) and ``nvfp4_quantize`` (one and two scale levels).
The differences, each pinned by a test below and listed in docs/fp8.md:

* RCEIL: torchao's eager fallback takes ``ceil(log2(amax / max))`` in float32, whose log2 rounds
  to an integer for a quotient just above a large power of two; mpx rounds up from the bits, as
  Transformer Engine's ``float_to_e8m0`` and the PTX ``cvt.rp`` that torchao compiles to do;
* FP4/FP6 elements of a NaN block: torchao writes whatever bits the NaN's shift leaves, mpx the
  largest positive code (the block's scale is NaN either way);
* NVFP4 with a tensor scale: torchao divides by a zero tensor scale for an all-zero tensor (NaN
  scales); mpx floors the tensor scale at 2**-126 and the block amax at 6 * 2**-126.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.prototype.mx_formats.config import ScaleCalculationMode as Mode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

from mpx.blocks import PRESETS, BlockRecipe
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS as NP
from mpx.kernels.elements import max_value

ELEMENTS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m1": torch.float4_e2m1fn_x2,
    "e2m3": "fp6_e2m3",
    "e3m2": "fp6_e3m2",
}
MODES = {"floor": Mode.FLOOR, "rceil": Mode.RCEIL, "even": Mode.EVEN}


def _codes(data: torch.Tensor, element: str) -> np.ndarray:
    if element == "e2m1":  # two per byte, the first element in the low nibble
        u = data.view(torch.uint8).numpy()
        return np.stack([u & 0xF, u >> 4], -1).reshape(u.shape[0], -1).astype(np.int32)
    if element in ("e2m3", "e3m2"):
        return data.view(torch.uint8).numpy().astype(np.int32)
    return data.view(torch.uint8).numpy().astype(np.int32)


@st.composite
def arrays(draw, block: int, specials: bool = True) -> np.ndarray:
    rows, nblocks = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal((rows, nblocks * block)) * np.exp(rng.uniform(-85, 85, (rows, 1)))).astype(
        np.float32
    )
    kind = draw(st.sampled_from(["plain", "zero", "subnormal", "mixed", "special"]))
    if kind == "zero":
        x[0, :block] = 0.0
    elif kind == "subnormal":
        x[0] = (rng.integers(1, 2**23, x.shape[1]).astype(np.int32)).view(np.float32) * rng.choice(
            [-1, 1], x.shape[1]
        )
    elif kind == "mixed":
        x *= np.exp(rng.uniform(-40, 40, x.shape)).astype(np.float32)
    elif kind == "special" and specials:
        x[0, rng.integers(0, x.shape[1])] = draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    return x.astype(np.float32)


def _nan_blocks(x: np.ndarray, block: int) -> np.ndarray:
    return np.repeat(np.isnan(x.reshape(x.shape[0], -1, block)).any(-1), block, axis=1)


@settings(max_examples=100, deadline=None)
@given(arrays(32), st.sampled_from(sorted(ELEMENTS)), st.sampled_from(sorted(MODES)))
def test_to_mx_matches_bit_for_bit(x, element, rule) -> None:
    recipe = BlockRecipe(element=element, scale_rule=rule)
    q = kb.quantize(NP, x, recipe, "input", axis=1)
    scale, data = to_mx(torch.from_numpy(x), ELEMENTS[element], 32, MODES[rule])
    want_scales = scale.view(torch.uint8).numpy().astype(np.int32)
    want = _codes(data, element)
    if rule == "rceil":  # the named difference (module docs): where torchao's float32 log2 lands on an
        # integer that the exact quotient exceeds, mpx's code is one more; compare the rest
        with np.errstate(all="ignore"):
            d = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1) / np.float32(max_value(element))
            log2 = torch.log2(torch.from_numpy(d)).numpy()  # torchao's own float32 log2
        rounded = np.isfinite(log2) & (log2 == np.round(log2)) & (np.frexp(d)[0] != 0.5) & (d >= 2.0**-126)
        np.testing.assert_array_equal(q.scales[rounded], want_scales[rounded] + 1)
        want_scales = np.where(rounded, q.scales, want_scales)
    np.testing.assert_array_equal(q.scales, want_scales)
    nan = _nan_blocks(x, 32)
    if element in ("e2m3", "e3m2", "e2m1"):  # a NaN block's FP4/FP6 bits: the named difference
        want = np.where(nan, q.codes, want)
    np.testing.assert_array_equal(np.where(nan, 0, q.codes), np.where(nan, 0, want))


@settings(max_examples=60, deadline=None)
@given(arrays(16, specials=False), st.booleans())
def test_nvfp4_quantize_matches_bit_for_bit(x, two_level) -> None:
    t_amax = float(np.abs(x).max())
    if two_level and t_amax < 2.0**-100:  # mpx floors tiny tensor scales (the named difference)
        x = x + np.float32(1.0)
    recipe = PRESETS["nvfp4"] if two_level else BlockRecipe(
        element="e2m1", input_block="1x16", scale="e4m3", scale_rule="nearest")  # fmt: skip
    q = kb.quantize(NP, x, recipe, "input", axis=1)
    t = torch.from_numpy(x)
    ts = per_tensor_amax_to_scale(t.abs().max()) if two_level else None
    scale, data = nvfp4_quantize(t, 16, ts)
    want_scales = scale.view(torch.uint8).numpy().astype(np.int32)
    nan = (want_scales & 0x7F) == 0x7F  # an E4M3 NaN scale (torchao's NaN from inf / inf is negative)
    np.testing.assert_array_equal(nan, q.scales == 0x7F)
    np.testing.assert_array_equal(np.where(nan, 0, q.scales), np.where(nan, 0, want_scales))
    nan_el = np.repeat(nan, 16, axis=1)  # a NaN block's FP4 bits: the named difference
    np.testing.assert_array_equal(np.where(nan_el, 0, q.codes), np.where(nan_el, 0, _codes(data, "e2m1")))
    if two_level and np.isfinite(x).all():
        assert np.float32(q.tensor_scale).view(np.int32) == ts.numpy().view(np.int32)


def test_rceil_differs_where_torchaos_float32_log2_rounds() -> None:
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = np.float32(448.0 * 2.0**20) * np.float32(1 + 2.0**-23) * np.float32(1 + 2.0**-23)
    q = kb.quantize(NP, x, PRESETS["mxfp8_rceil"], "input")
    scale, _ = to_mx(torch.from_numpy(x), torch.float8_e4m3fn, 32, Mode.RCEIL)
    assert int(q.scales[0, 0]) == 127 + 21  # amax / 448 is just above 2**20: rounded up
    assert int(scale.view(torch.uint8)[0, 0]) == 127 + 20  # torchao's float32 log2 gives exactly 20.0


def test_nvfp4_zero_tensor_differs() -> None:
    x = np.zeros((1, 16), np.float32)
    q = kb.quantize(NP, x, PRESETS["nvfp4"], "input")
    t = torch.from_numpy(x)
    scale, _ = nvfp4_quantize(t, 16, per_tensor_amax_to_scale(t.abs().max()))
    assert torch.isnan(scale.float()).all()  # torchao: 0 / 0
    assert float(q.tensor_scale) == 2.0**-126 and int(q.scales[0, 0]) == 0x38  # mpx: floors (block scale 1.0)


@pytest.mark.parametrize("rule", sorted(MODES))
def test_all_zero_and_inf_blocks_match(rule) -> None:
    x = np.zeros((2, 64), np.float32)
    x[1, 3], x[1, 40] = np.inf, 5.0
    q = kb.quantize(NP, x, BlockRecipe(scale_rule=rule), "input")
    scale, data = to_mx(torch.from_numpy(x), torch.float8_e4m3fn, 32, MODES[rule])
    np.testing.assert_array_equal(q.scales, scale.view(torch.uint8).numpy().astype(np.int32))
    np.testing.assert_array_equal(q.codes, _codes(data, "e4m3"))
