"""The scaler-history ring buffer, once for every backend.

A recording scaler keeps the last ``capacity`` steps in an int32 ``(capacity, 4)`` array,
one :func:`row` per step (:data:`ROW_FIELDS`: the scale's float32 bits after the step, the
step's ``events`` as :func:`mpx.kernels.scale.events` gives them, ``consecutive_nonfinite``,
``steps``) and a count of rows ever written; row ``i`` goes to slot ``i % capacity``.  :func:`record` writes one row on device (inside a compiled step
too: no host read); :meth:`mpx.ScalerHistory.from_rows` decodes the buffer on the host.

>>> import numpy as np
>>> from mpx.kernels.array_ops import NUMPY_OPS as o
>>> rows, n = np.zeros((2, 4), np.int32), o.int32(0)
>>> for step in (1, 2, 3):
...     rows, n = record(o, rows, n, row(o, o.float32(2.0), step, 0, step))
>>> rows[:, 3].tolist(), int(n)
([3, 2], 3)
"""

from __future__ import annotations

from typing import Any

from mpx.errors import MPXError
from mpx.kernels.array_ops import ArrayOps
from mpx.kernels.bits import to_bits
from mpx.kernels.scale import COUNTER_MAX, bump

__all__ = ["ROW_FIELDS", "check_capacity", "record", "row"]

#: What each column of a history row holds.
ROW_FIELDS = ("scale_bits", "events", "consecutive_nonfinite", "steps")


def check_capacity(capacity: Any) -> int:
    """``capacity`` (steps a ring buffer keeps) validated: an int in [1, 2**31 - 1].

    Raises:
        MPXError: naming ``capacity`` and the allowed range.
    """
    if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= COUNTER_MAX:
        raise MPXError(f"capacity: expected an int in [1, 2**31 - 1] (steps kept), got {capacity!r}")
    return capacity


def row(o: ArrayOps, scale: Any, events: Any, consecutive_nonfinite: Any, steps: Any) -> Any:
    """One history row, int32 ``(4,)``: the state after a step and the step's ``events`` (the
    int32 bits :func:`mpx.kernels.scale.events` returns)."""
    return o.stack([to_bits(o, scale), o.int32(events), o.int32(consecutive_nonfinite), o.int32(steps)])


def record(o: ArrayOps, rows: Any, recorded: Any, new_row: Any, when: Any = None) -> tuple[Any, Any]:
    """``(rows, recorded)`` after writing ``new_row`` into slot ``recorded % capacity``.

    ``rows``: the int32 ``(capacity, 4)`` buffer; ``recorded``: the int32 count of rows ever
    written (saturating at 2**31 - 1).  ``when``: None, or a bool scalar: where False nothing
    is written (an accumulation window's earlier micro-batches), without a branch.
    """
    capacity = rows.shape[0]
    index = o.rem(recorded, capacity)
    if when is not None:
        new_row = o.where(when, new_row, o.get_row(rows, index))
        return o.set_row(rows, index, new_row), bump(o, recorded, when)
    return o.set_row(rows, index, new_row), bump(o, recorded)
