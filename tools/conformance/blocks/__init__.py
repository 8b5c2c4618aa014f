"""The conformance group ``blocks`` (issue 31, item 4): block-scaled quantization (MX, NVFP4, blockwise
and rowwise FP8) on every column.

:mod:`conformance.blocks.cases` builds the cases with their expectations from the core
(:func:`mpx.kernels.blocks.quantize` with numpy's table); the adapters run them under mpx (the core's
kernel with the backend's own table: the bytes every mpx layer of that backend quantizes with) and
natively (torchao's ``mx_formats`` emulation and rowwise float8 on torch; JAX's block quantizer behind
``jax.nn.scaled_dot_general``; nothing on TensorFlow or Keras, which have no block-scaled format).

This module is mpx-free (numpy only): the native paths use it to make the cases' inputs and to
encode what they observed.

Encoding (JSON-safe, exact): ``{"codes": sha256, "scales": sha256, "tensor_scale": bits or None}``:
the sha256 of the int32 element codes (the format's bits, sign bit at ``ebits + mbits``; every NaN
element as the format's positive NaN code) and of the scales as int32 (E8M0 and E4M3 codes, an E4M3
NaN as 0x7F; float32 scales as their bits, every NaN as 0x7FC00000), each with its shape.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["NAN_CODES", "SHAPE", "block_input", "digest", "observe"]

#: the inputs' shape: 4 rows of 128 (every 1xN block of the presets divides it)
SHAPE = (4, 128)
#: the positive NaN code of each element format with one (FP4/FP6 have none)
NAN_CODES = {"e4m3": 0x7F, "e5m2": 0x7E}
INPUT_KINDS = ("random", "zero_blocks", "specials", "zero_tensor")


def block_input(kind: str, seed: int) -> np.ndarray:
    """A float32 (4, 128) input: ``random`` (normal values, each row of its own magnitude 2**[-20, 20]),
    ``zero_blocks`` (random with row 0's first 32 and all of row 2 zero), ``specials`` (random with a NaN
    in row 1, +inf and -inf in row 3, 3e38 in row 0 and float32 subnormals in row 2) or ``zero_tensor``."""
    if kind not in INPUT_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {INPUT_KINDS}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE) * 2.0 ** rng.uniform(-20, 20, (SHAPE[0], 1))
    if kind == "zero_blocks":
        x[0, :32] = 0.0
        x[2] = 0.0
    elif kind == "specials":
        x[1, 5] = np.nan
        x[3, 7], x[3, 100] = np.inf, -np.inf
        x[0, 70] = 3e38
        x[2] = rng.standard_normal(SHAPE[1]) * 2.0**-140
    elif kind == "zero_tensor":
        x[:] = 0.0
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


def _sha(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a, dtype=np.int32)
    return hashlib.sha256(f"{a.shape}".encode() + a.tobytes()).hexdigest()


def digest(codes: np.ndarray, element: str, scales: np.ndarray, scale: str) -> tuple[str, str]:
    """The sha256 of the codes and of the scales, NaNs written one way (module docs)."""
    c = np.asarray(codes).astype(np.int64)
    if element in NAN_CODES:
        low = c & 0x7F
        nan = low == 0x7F if element == "e4m3" else low > 0x7C
        c = np.where(nan, NAN_CODES[element], c)
    s = np.asarray(scales)
    if s.dtype == np.float32:
        s = np.where(np.isnan(s), 0x7FC00000, s.view(np.int32).astype(np.int64))
    elif scale in ("e4m3", "e4m3_f32"):
        s = np.where((s.astype(np.int64) & 0x7F) == 0x7F, 0x7F, s.astype(np.int64))
    return _sha(c.astype(np.int32)), _sha(np.asarray(s).astype(np.int64).astype(np.int32))


def observe(codes: np.ndarray, element: str, scales: np.ndarray, scale: str, tensor_scale: object) -> dict:
    """What a case observes: the digests and the tensor scale's float32 bits (None without one)."""
    c, s = digest(codes, element, scales, scale)
    ts = None
    if tensor_scale is not None:
        t = np.float32(np.asarray(tensor_scale, np.float32).reshape(-1)[0])
        ts = 0x7FC00000 if np.isnan(t) else int(np.asarray(t).view(np.int32))
    return {"codes": c, "scales": s, "tensor_scale": ts}
