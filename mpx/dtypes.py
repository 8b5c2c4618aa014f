"""Canonical floating dtype names, their aliases and their numeric limits.

>>> canonical_dtype("bf16")
'bfloat16'
>>> dtype_info("float16").max
65504.0
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mpx.errors import DTypeError

__all__ = [
    "CANONICAL_DTYPES",
    "FLOATING_DTYPES",
    "HALF_DTYPES",
    "DTypeInfo",
    "canonical_dtype",
    "dtype_info",
    "is_half",
    "numpy_dtype",
    "widest_dtype",
]

#: Dtypes a policy may use, narrowest first.
FLOATING_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
#: The half-precision compute dtypes.
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
#: Every canonical name, including the float8 names reserved for later policies.
CANONICAL_DTYPES: tuple[str, ...] = (*FLOATING_DTYPES, "float8_e4m3fn", "float8_e5m2")

_ALIASES: dict[str, str] = {
    **{name: name for name in CANONICAL_DTYPES},
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "full": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "f64": "float64",
    "fp64": "float64",
    "double": "float64",
}

_NUMPY: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_BY_NUMPY: dict[np.dtype, str] = {dt: name for name, dt in _NUMPY.items()}


def _allowed(names: Iterable[str]) -> str:
    return ", ".join(names)


def _framework_dtype_name(value: Any) -> str | None:
    """The dtype name of a framework's dtype object, read without importing it."""
    module = type(value).__module__ or ""
    root = module.split(".", 1)[0]
    if root == "torch":  # torch.float16 prints as "torch.float16"
        text = str(value)
        return text[len("torch.") :] if text.startswith("torch.") else text
    if root in ("tensorflow", "keras"):
        name = getattr(value, "name", None)
        return name if isinstance(name, str) else None
    if root == "jax" and isinstance(value, type):
        # jnp.float32, jnp.bfloat16: classes of metaclass _ScalarMeta, each holding its numpy dtype
        dtype = getattr(value, "dtype", None)
        return dtype.name if isinstance(dtype, np.dtype) else None
    return None


def canonical_dtype(value: Any, *, field: str = "dtype", allowed: Iterable[str] = FLOATING_DTYPES) -> str:
    """Return the canonical name of ``value``, a dtype name, alias or dtype object.

    Accepts the canonical names, the aliases (``f32 fp32 float full``,
    ``f16 fp16 half``, ``bf16``, ``f64 fp64 double``), numpy and ml_dtypes
    dtypes and scalar types, and torch/TensorFlow dtype objects.  ``allowed``
    limits the result (default: the four floating dtypes a policy may use).

    Raises:
        DTypeError: naming ``field``, when ``value`` is not an allowed floating dtype.

    >>> canonical_dtype("half", field="compute")
    'float16'
    >>> canonical_dtype("int8", field="compute")
    Traceback (most recent call last):
    ...
    mpx.errors.DTypeError: compute: 'int8' is not a floating dtype; allowed: float16, bfloat16, float32, float64
    """
    allowed = tuple(allowed)
    name: str | None
    if isinstance(value, str):
        name = _ALIASES.get(value)
        if name is None:
            hint = " (names are lower-case)" if value.lower() in _ALIASES else ""
            raise DTypeError(
                f"{field}: {value!r} is not a floating dtype{hint}; allowed: {_allowed(allowed)}"
            )
    else:
        name = _framework_dtype_name(value)
        if name is None:
            # Only real dtypes: np.dtype(None) and np.dtype(float) would silently mean float64.
            is_dtype = isinstance(value, np.dtype) or (
                isinstance(value, type) and issubclass(value, np.generic)
            )
            try:
                if not is_dtype:
                    raise TypeError
                np_dtype = np.dtype(value)
            except TypeError:
                raise DTypeError(
                    f"{field}: {value!r} (a {type(value).__name__}) is not a dtype; "
                    f"allowed: {_allowed(allowed)}"
                ) from None
            name = _BY_NUMPY.get(np_dtype, np_dtype.name)
        if name not in _NUMPY:
            raise DTypeError(f"{field}: {name!r} is not a floating dtype; allowed: {_allowed(allowed)}")
    if name not in allowed:
        raise DTypeError(f"{field}: {name!r} is not allowed here; allowed: {_allowed(allowed)}")
    return name


def numpy_dtype(name: Any) -> np.dtype:
    """The numpy (or ml_dtypes) dtype for a canonical name or alias."""
    return _NUMPY[canonical_dtype(name, allowed=CANONICAL_DTYPES)]


def is_half(name: Any) -> bool:
    """Whether ``name`` is a 16-bit floating dtype (float16 or bfloat16)."""
    return canonical_dtype(name, allowed=CANONICAL_DTYPES) in HALF_DTYPES


_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


def widest_dtype(dtypes: Iterable[Any], *, field: str = "input_dtypes") -> str:
    """The dtype that holds every one of ``dtypes`` exactly, by the usual promotion.

    float16 with bfloat16 promotes to float32, as in torch, numpy-style JAX and TF.

    >>> widest_dtype(["float16", "bfloat16"])
    'float32'
    """
    names = [canonical_dtype(d, field=field) for d in dtypes]
    if not names:
        raise DTypeError(f"{field}: at least one dtype is required")
    best = max(names, key=_RANK.__getitem__)
    if _RANK[best] == 0 and len(set(names)) > 1:
        return "float32"
    return best


@dataclass(frozen=True)
class DTypeInfo:
    """Numeric limits of one dtype, under numpy.finfo's names (all Python floats)."""

    name: str
    bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float


def dtype_info(name: Any) -> DTypeInfo:
    """Limits of a canonical dtype (or alias): ``max``, ``smallest_normal``, ``smallest_subnormal``, ``eps``, ``bits``.

    >>> info = dtype_info("bf16")
    >>> info.bits, info.eps
    (16, 0.0078125)
    """
    canon = canonical_dtype(name, field="name", allowed=CANONICAL_DTYPES)
    fi = ml_dtypes.finfo(_NUMPY[canon])
    return DTypeInfo(
        name=canon,
        bits=int(fi.bits),
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_subnormal),
        eps=float(fi.eps),
    )
