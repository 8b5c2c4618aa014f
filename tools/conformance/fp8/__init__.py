"""The conformance group ``fp8`` (issue 26, item 4): quantized bytes, scale traces and FP8 GEMMs.

:mod:`conformance.fp8.cases` builds the cases with their expectations from the core
(:mod:`mpx.float8`); :mod:`conformance.fp8.torch`, :mod:`.tf` and :mod:`.jax` run them, under mpx
(``mpx_torch.float8``, ``mpx_keras.float8``, ``mpx_jax.float8``) and natively (torchao's emulated
float8 training, Keras's ``quantize("float8")`` Dense, Flax's FP8 dot_general ops).

This module is mpx-free (numpy and ml_dtypes only): the adapters' native paths use it to make the
same inputs the cases were computed from, and to encode what they observed.

Encodings (JSON-safe, exact):

* FP8 bytes: a hex string, two characters per element, every NaN written ``nn`` (NaN compares as
  NaN: torch's e5m2 NaN byte is 0x7F, ml_dtypes' 0x7E);
* float32 numbers (amaxes, scales): their bits as ints (inf and NaN included; every NaN as
  ``0x7FC00000``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "NAN_BITS",
    "bits_to_f32",
    "encode_fp8",
    "f32_to_bits",
    "matmul_inputs",
    "quantize_inputs",
    "trace_input",
    "within_bound",
]

#: numpy (ml_dtypes) dtype of each FP8 format
FP8_DTYPES = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
#: the largest finite value of each format (float32)
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
#: the one NaN pattern observations use
NAN_BITS = 0x7FC00000
#: the input kinds of the quantize cases
QUANTIZE_KINDS = ("random", "overflow", "subnormal", "nan")


def f32_to_bits(values: object) -> list[int]:
    """The float32 bits of ``values`` as Python ints (every NaN as :data:`NAN_BITS`)."""
    arr = np.asarray(values, dtype=np.float32).reshape(-1)
    bits = arr.view(np.uint32).astype(np.int64)
    return [NAN_BITS if np.isnan(v) else int(b) for v, b in zip(arr, bits, strict=True)]


def bits_to_f32(bits: list[int]) -> np.ndarray:
    """float32 values from :func:`f32_to_bits` ints."""
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def encode_fp8(raw: object, fmt: str) -> str:
    """Hex of FP8 bytes (uint8 or an FP8 array), NaN as ``nn``: equal strings are equal values, NaN as NaN."""
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        arr = arr.astype(FP8_DTYPES[fmt]).view(np.uint8)
    arr = arr.reshape(-1)
    low = arr & 0x7F
    nan = low == 0x7F if fmt == "e4m3" else low > 0x7C
    return "".join("nn" if n else f"{b:02x}" for b, n in zip(arr.tolist(), nan.tolist(), strict=True))


def quantize_inputs(kind: str, seed: int, n: int, dtype: str = "float32") -> np.ndarray:
    """The ``n`` float32 inputs of a quantize case (rounded to bfloat16 first for ``dtype="bfloat16"``).

    ``random``: normal values of spread 2**[-4, 4]; ``overflow``: a quarter far beyond any fp8 range
    (±1e30 and ±inf among them); ``subnormal``: float32 subnormals and tiny normals; ``nan``: random
    values with NaNs (both signs) in a tenth of them.
    """
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {QUANTIZE_KINDS}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 2.0 ** rng.uniform(-4, 4, n)
    if kind == "overflow":
        big = rng.choice([1e5, 1e10, 1e30, 3e38, np.inf], size=n // 4) * rng.choice([-1.0, 1.0], size=n // 4)
        x[rng.choice(n, size=n // 4, replace=False)] = big
    elif kind == "subnormal":
        tiny = float(np.finfo(np.float32).tiny)
        x = rng.standard_normal(n) * tiny * 2.0 ** rng.uniform(-20, 2, n)
    elif kind == "nan":
        where = rng.choice(n, size=n // 10, replace=False)
        x[where] = np.where(rng.random(len(where)) < 0.5, np.nan, -np.nan)
    with np.errstate(over="ignore"):
        out = x.astype(np.float32)
    if dtype == "bfloat16":
        out = out.astype(ml_dtypes.bfloat16).astype(np.float32)
    return out


def matmul_inputs(seed: int, m: int, k: int, n: int, bad: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``a`` (m, k) and ``b`` (k, n), float32; ``bad="inf"`` puts an inf in ``a``."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * 3.0).astype(np.float32)
    b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    if bad == "inf":
        a[m // 2, k // 3] = np.inf
    return a, b


def trace_input(amax: float, shape: tuple[int, int] = (2, 4)) -> np.ndarray:
    """A float32 array whose ``max(|x|)`` is ``amax`` (its [0, 0] element; the others in [0, amax/2])."""
    x = np.zeros(shape, np.float32)
    x[0, 0] = np.float32(amax)
    if np.isfinite(amax) and amax > 0:
        x[1, 1] = np.float32(amax) * np.float32(0.5)
    return x


def within_bound(out: np.ndarray, reference: list[float | None], bound: list[float]) -> dict:
    """``{"within_bound": True}`` when every element of ``out`` is within ``bound`` of ``reference``
    (a None reference is NaN and must be NaN), else also the worst excess and the count off."""
    got = np.asarray(out, np.float64).reshape(-1)
    ref = np.asarray([np.nan if r is None else r for r in reference], np.float64)
    tol = np.asarray(bound, np.float64)
    nan_ref = np.isnan(ref)
    with np.errstate(invalid="ignore"):
        ok = np.where(nan_ref, np.isnan(got), np.abs(got - ref) <= tol)
    if ok.all():
        return {"within_bound": True}
    with np.errstate(invalid="ignore"):
        excess = np.where(nan_ref | np.isnan(got), np.inf, np.abs(got - ref) / np.maximum(tol, 1e-45))
    return {
        "within_bound": False,
        "off": int((~ok).sum()),
        "of": int(ok.size),
        "nan_expected": int(nan_ref.sum()),
        "nan_observed": int(np.isnan(got).sum()),
        "worst_over_bound": float(np.max(excess[~ok & np.isfinite(excess)], initial=0.0)),
    }


def require_native_recipe(recipe: dict, who: str) -> None:
    """Skip (with the reason) a recipe Keras's and Flax's FP8 cannot express: they have delayed scaling
    with the max of the history, margin 0, e4m3 forward and e5m2 gradients only."""
    from mpx_tools.skip import Skip

    unsupported = {
        "format": recipe["format"] != "hybrid",
        "scaling": recipe["scaling"] != "delayed",
        "amax_compute": recipe["amax_compute"] != "max",
        "margin": recipe["margin"] != 0,
        "power_of_two": recipe["power_of_two"],
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise Skip(
            f"{who} cannot express this recipe ({', '.join(f'{k}={recipe[k]!r}' for k in bad)}): it has "
            "delayed scaling with the max of the history, margin 0, e4m3 forward and e5m2 gradients only"
        )
