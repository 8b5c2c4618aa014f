"""8-bit block-quantized optimizer state (mpx.kernels.blockwise) with the numpy table: the error bound, the codes,
the small-block rule, the bytes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mpx.kernels import NUMPY_OPS as o
from mpx.kernels import blockwise as kb


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=1, max_size=600).map(
        lambda v: np.asarray(v, np.float32)
    ),
    st.sampled_from([32, 64, 256]),
)
def test_quantize_stays_within_half_a_code_and_keeps_nonzeros(x, block):
    q, absmax = kb.quantize(o, x, block)
    rows = -(-x.size // block)
    assert (
        q.dtype == np.int8
        and q.shape == (rows, block)
        and absmax.dtype == np.float32
        and absmax.shape == (rows,)
    )
    assert (np.abs(q.astype(np.int32)) <= 127).all() and (q.reshape(-1)[x.size :] == 0).all()
    back = kb.dequantize(o, q, absmax, x.size)
    assert back.dtype == np.float32 and back.shape == x.shape
    padded = np.concatenate([x, np.zeros(rows * block - x.size, np.float32)]).reshape(rows, block)
    want_absmax = np.abs(padded).max(axis=1)
    kept = want_absmax >= kb.MIN_ABSMAX
    assert np.array_equal(absmax, np.where(kept, want_absmax, 0))
    step = np.repeat(np.where(kept, want_absmax, kb.MIN_ABSMAX), block)[: x.size].astype(np.float64) / 127
    err = np.abs(back.astype(np.float64) - x)
    codes = q.reshape(-1)[: x.size].astype(np.int32)
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    near = np.abs(x) * 127 / np.maximum(step * 127, np.finfo(np.float64).tiny) < 0.5
    kept_x = np.repeat(kept, block)[: x.size]
    # half a code, except a nonzero element that would round to 0: it keeps +-1 (its sign), off by < a code
    ones = kept_x & normal & near
    assert (err[~ones] <= step[~ones] * (0.5 + 1e-4)).all()
    assert (codes[ones] == np.sign(x[ones])).all() and (err[ones] < step[ones] * (1 + 1e-4)).all()
    assert not (codes[kept_x & normal] == 0).any()
    # the largest element of a kept block comes back as +-127 codes: its absmax, to float32's rounding
    top = np.argmax(np.abs(padded), axis=1)
    assert (np.abs(q[np.arange(rows), top][kept].astype(np.int32)) == 127).all()


def test_small_blocks_and_subnormals_are_zeros():
    x = np.float32([1e-36, -1e-37, 0.0, 0.0, 2.0**-119, 1.0, 1e-40, -1.0])
    q, absmax = kb.quantize(o, x, 4)
    assert (
        absmax.tolist() == [0.0, 1.0] and q[0].tolist() == [0, 0, 0, 0] and q[1].tolist() == [1, 127, 0, -127]
    )  # 2**-119 is a normal nonzero element of a kept block: +1; the subnormal 1e-40 counts as zero
    step = float(np.float32(1 / 127))
    assert kb.dequantize(o, q, absmax, 8).tolist() == [0.0, 0.0, 0.0, 0.0, step, 1.0, 0.0, -1.0]


def test_rounding_to_codes_is_half_to_even():
    # absmax 127 makes the scale exactly 1: the codes are the values rounded, ties to even
    # (except that a nonzero element keeps a nonzero code: 0.5, -0.5 and 0.49999997 give +-1, 0.0 gives 0)
    x = np.float32([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999998, 0.49999997, -126.5, 126.5, 0.0])
    q, _ = kb.quantize(o, x, 12)
    assert q[0].tolist() == [127, 1, 2, 2, -1, -2, -2, 3, 1, -126, 126, 0]


def test_bytes_per_element():
    assert kb.state_bytes(256, 256) == 260 and kb.state_bytes(257, 256) == 520 and kb.state_bytes(1, 32) == 36
