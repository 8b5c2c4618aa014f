"""The low-precision element formats mpx quantizes to: their short names, dtypes and largest values.

A leaf module (numpy and ml_dtypes only) that the recipes (:mod:`mpx.float8`) and the
kernels (:mod:`mpx.kernels`) both read.

>>> fp8_max("e4m3"), fp8_max("e5m2"), DTYPE_NAMES["e4m3"]
(448.0, 57344.0, 'float8_e4m3fn')
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from mpx.errors import Float8Error

__all__ = ["DTYPE_NAMES", "FORMATS", "fp8_max"]

#: The FP8 formats by short name: numpy dtypes (ml_dtypes).
FORMATS: dict[str, np.dtype] = {
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
#: The dtype name of each format, as an :class:`mpx.kernels.ArrayOps` table's ``cast`` takes it.
DTYPE_NAMES: dict[str, str] = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_MAX = {name: float(ml_dtypes.finfo(dtype).max) for name, dtype in FORMATS.items()}


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def fp8_max(fmt: str) -> float:
    """The largest finite value of a format (``"e4m3"``: 448, ``"e5m2"``: 57344).

    Raises:
        Float8Error: for an unknown format, naming the allowed ones.
    """
    if not isinstance(fmt, str) or fmt not in _MAX:
        raise Float8Error(f"fmt: {_show(fmt)} is not allowed; allowed: {', '.join(FORMATS)}")
    return _MAX[fmt]
