"""PyTorch's table for the core's kernels (:mod:`mpx.kernels`): torch tensors on any device.

Every number mpx_torch produces in training (the loss scale's update, FP8 quantize, the
scale from an amax, the amax history, the MAX of amaxes, ``max(|x|)``, the scaler-history
ring) is a kernel of :mod:`mpx.kernels` run with a :class:`TorchOps`; this module maps the
table's operations onto torch's and holds nothing else.

* Every operation is a tensor op: no host read (``.item()``, ``.tolist()``), no Python
  branch on a value, so the kernels trace under dynamo and add no host sync.  Row indices
  (:meth:`TorchOps.get_row`, :meth:`TorchOps.set_row`) are tensors (``index_select`` and
  ``index_copy_``).
* A Python number meets a tensor as torch's weakly typed scalar (the tensor's dtype).  The
  few constants a kernel makes on its own (:meth:`TorchOps.int32`, :meth:`TorchOps.float32`
  of a Python number) are made by ``torch.full`` on the table's device: a fill on the
  device, never a host-to-device copy (which would wait for the device).
* ``exact_float32``: torch's float32 arithmetic keeps subnormals (on the CPU unless
  ``torch.set_flush_denormal(True)``; CUDA kernels are built without flush-to-zero).
  ``float64``: every device but Apple's MPS has float64.  The kernel parity tests
  (``tests/torch/test_kernel_parity.py``) check both against the numpy table.

>>> import torch
>>> from mpx.kernels import float8 as kf
>>> o = ops_for(torch.device("cpu"))
>>> kf.quantize(o, torch.tensor([1.0, 3.0, -1e9]), 224.0, "e4m3").float().tolist()
[224.0, 448.0, -448.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from mpx.kernels.array_ops import DTYPE_NAMES, ArrayOps

__all__ = ["TORCH_DTYPES", "TorchOps", "ops_for"]

#: The torch dtype of each dtype name a table's ``cast``/``bitcast`` takes (:data:`mpx.kernels.DTYPE_NAMES`).
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
_FP8_NUMPY = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.float8_e5m2: ml_dtypes.float8_e5m2}
_F32_MAX = float(np.finfo(np.float32).max)
# the smallest magnitude that rounds to float32 infinity: float32's max plus half its last step
_F32_OVERFLOW = math.ldexp(2.0 - 2.0**-24, 127)
_Number = (bool, int, float)


def _f32_value(x: float) -> float:
    """A Python float rounded to float32's range as a cast does (``torch.full`` refuses values past float32's
    max, which a cast rounds to the max or to an infinity)."""
    if math.isfinite(x) and abs(x) > _F32_MAX:
        return math.copysign(math.inf if abs(x) >= _F32_OVERFLOW else _F32_MAX, x)
    return x


def _binary(op: Any, a: Any, b: Any, flipped: Any = None) -> Any:
    """``op(a, b)``; torch takes a Python number second only, so a number ``a`` gives ``op(b, a)`` for a
    symmetric ``op`` and ``flipped(b, a)`` otherwise (``rsub`` for ``sub``, ``gt`` for ``lt``...)."""
    if isinstance(a, _Number):
        return (flipped or op)(b, a)
    return op(a, b)


def _scalar_dtype(x: Any) -> torch.dtype:
    """A lone Python number's dtype, as the numpy table types it: bool, int32 or float32."""
    return torch.bool if isinstance(x, bool) else torch.int32 if isinstance(x, int) else torch.float32


class TorchOps(ArrayOps):
    """The :class:`mpx.kernels.ArrayOps` of torch tensors (see the module docs).

    Args:
        device: where the constants a kernel makes from Python numbers live (the device of the
            tensors it is handed; default the CPU).  :func:`ops_for` keeps one table per device.
    """

    name = "torch"
    exact_float32 = True

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cpu" if device is None else device)
        self.float64 = self.device.type != "mps"

    def __repr__(self) -> str:
        return f"TorchOps({str(self.device)!r})"

    # -- values ------------------------------------------------------------------------
    def _full(self, x: Any, dtype: torch.dtype) -> torch.Tensor:
        value = _f32_value(float(x)) if dtype == torch.float32 and not isinstance(x, bool) else x
        return torch.full((), value, dtype=dtype, device=self.device)

    def _tensor(self, x: Any, like: Any = None) -> torch.Tensor:
        """``x`` as a tensor: a Python number takes ``like``'s dtype and device (a lone one the numpy rule)."""
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (np.ndarray, np.generic)):
            return self.from_numpy(np.asarray(x))
        if isinstance(like, torch.Tensor):
            return torch.full((), x, dtype=like.dtype, device=like.device)
        return self._full(x, _scalar_dtype(x))

    def int32(self, x: Any) -> Any:
        if isinstance(x, _Number):
            return self._full(int(x), torch.int32)
        return self._tensor(x).to(torch.int32)

    def float32(self, x: Any) -> Any:
        if isinstance(x, _Number):
            return self._full(x, torch.float32)
        return self._tensor(x).to(torch.float32)

    def cast(self, x: Any, dtype: str) -> Any:
        target = TORCH_DTYPES[dtype]
        if isinstance(x, _Number):
            x = self._full(x, torch.float64 if isinstance(x, float) and self.float64 else _scalar_dtype(x))
        return self._tensor(x).to(target)

    def bitcast(self, x: Any, dtype: str) -> Any:
        return self._tensor(x).view(TORCH_DTYPES[dtype])

    def from_numpy(self, x: np.ndarray) -> Any:
        x = np.array(x, order="C")  # a copy (0-d stays 0-d)
        for torch_dtype, np_dtype in _FP8_NUMPY.items():
            if x.dtype == np_dtype:  # torch reads no ml_dtypes array: carry the bytes
                return torch.from_numpy(x.view(np.uint8)).view(torch_dtype).to(self.device)
        return torch.from_numpy(x).to(self.device)

    def to_numpy(self, x: Any) -> np.ndarray:
        if not isinstance(x, torch.Tensor):
            return np.asarray(x)
        x = x.detach().cpu()
        if x.dtype in _FP8_NUMPY:
            return x.view(torch.uint8).numpy().view(_FP8_NUMPY[x.dtype])
        return x.numpy()

    # -- elementwise ---------------------------------------------------------------------
    def where(self, cond: Any, a: Any, b: Any) -> Any:
        if isinstance(a, _Number) and isinstance(b, _Number):
            a = self._tensor(a)
        return torch.where(self._tensor(cond), a, b)

    def add(self, a: Any, b: Any) -> Any:
        return _binary(torch.add, a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return _binary(torch.sub, a, b, torch.rsub)

    def mul(self, a: Any, b: Any) -> Any:
        return _binary(torch.mul, a, b)

    def div(self, a: Any, b: Any) -> Any:
        return torch.div(self._tensor(a, b), b)

    def rem(self, a: Any, b: Any) -> Any:
        return torch.remainder(self._tensor(a, b), b)

    def shr(self, a: Any, n: Any) -> Any:
        return torch.bitwise_right_shift(self._tensor(a, n), n)

    def shl(self, a: Any, n: Any) -> Any:
        return torch.bitwise_left_shift(self._tensor(a, n), n)

    def bit_and(self, a: Any, b: Any) -> Any:
        return _binary(torch.bitwise_and, a, b)

    def bit_or(self, a: Any, b: Any) -> Any:
        return _binary(torch.bitwise_or, a, b)

    def bit_xor(self, a: Any, b: Any) -> Any:
        return _binary(torch.bitwise_xor, a, b)

    def lt(self, a: Any, b: Any) -> Any:
        return _binary(torch.lt, a, b, torch.gt)

    def le(self, a: Any, b: Any) -> Any:
        return _binary(torch.le, a, b, torch.ge)

    def eq(self, a: Any, b: Any) -> Any:
        return _binary(torch.eq, a, b)

    def ne(self, a: Any, b: Any) -> Any:
        return _binary(torch.ne, a, b)

    def logical_and(self, a: Any, b: Any) -> Any:
        return torch.logical_and(self._tensor(a), self._tensor(b))

    def logical_or(self, a: Any, b: Any) -> Any:
        return torch.logical_or(self._tensor(a), self._tensor(b))

    def logical_not(self, a: Any) -> Any:
        return torch.logical_not(self._tensor(a))

    def maximum(self, a: Any, b: Any) -> Any:
        if isinstance(b, _Number):
            return torch.clamp(self._tensor(a), min=b)
        if isinstance(a, _Number):
            return torch.clamp(b, min=a)
        return torch.maximum(a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        if isinstance(b, _Number):
            return torch.clamp(self._tensor(a), max=b)
        if isinstance(a, _Number):
            return torch.clamp(b, max=a)
        return torch.minimum(a, b)

    def clip(self, x: Any, lo: float, hi: float) -> Any:
        return torch.clamp(self._tensor(x), lo, hi)  # a NaN stays a NaN

    # -- reductions and structure ---------------------------------------------------------
    def max(self, x: Any) -> Any:
        return torch.amax(x)

    def stack(self, xs: Sequence[Any]) -> Any:
        like = next((x for x in xs if isinstance(x, torch.Tensor)), None)
        return torch.stack([self._tensor(x, like) for x in xs])

    def max_last(self, x: Any) -> Any:
        return torch.amax(x, dim=-1, keepdim=True)

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        return torch.reshape(x, shape)

    def transpose(self, x: Any, perm: tuple[int, ...]) -> Any:
        return torch.permute(x, perm)

    def pad(self, x: Any, shape: tuple[int, ...]) -> Any:
        widths = [w for m, n in zip(reversed(x.shape), reversed(shape), strict=True) for w in (0, n - m)]
        return torch.nn.functional.pad(x, widths) if any(widths) else x

    def crop(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x[tuple(slice(0, n) for n in shape)]

    def first(self, x: Any) -> Any:
        return x[0]

    def push_front(self, x: Any, value: Any) -> Any:
        return torch.cat([self._tensor(value, x).to(x.dtype).reshape(1), x[:-1]])

    def get_row(self, rows: Any, index: Any) -> Any:
        return torch.index_select(rows, 0, self._tensor(index).reshape(1)).reshape(rows.shape[1:])

    def resize(self, x: Any, n: int) -> Any:
        pad = n - x.shape[0]
        return x[:n] if pad <= 0 else torch.cat([x, torch.zeros(pad, dtype=x.dtype, device=x.device)])

    def iota(self, x: Any) -> Any:
        return torch.arange(x.numel(), dtype=torch.int32, device=x.device).reshape(x.shape)

    def set_row(self, rows: Any, index: Any, row: Any) -> Any:
        """``rows[index] = row`` in place (``index_copy_``: no host read of ``index``); returns ``rows``."""
        index = self._tensor(index).reshape(1).to(torch.int64)
        return rows.index_copy_(0, index, self._tensor(row, rows).reshape(1, *rows.shape[1:]))


def ops_for(device: torch.device | str) -> TorchOps:
    """The table whose constants live on ``device`` (a new one each call: a table is two attributes, and
    a module-level cache would be state that compiled code guards on)."""
    return TorchOps(device)
