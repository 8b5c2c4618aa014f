"""Scaler history and stuck detection for :class:`mpx_jax.LossScale` / :func:`mpx_jax.with_loss_scaling`.

History: :class:`HistoryRecorder` takes the loss scale after each step (a
``LossScale`` or the optimizer state holding one) and keeps the state's
arrays on device (one tiny stack per step, dispatched asynchronously: no host
sync, nothing added to the compiled step, safe under buffer donation);
:meth:`HistoryRecorder.history` reads everything in one ``jax.device_get``.
``callback`` (a plain function) is called with each ``every`` steps' new
:class:`mpx.ScalerHistory`, e.g. to log them.

Stuck detection (``ScalerConfig.max_consecutive_skips``): only with the option
on, :meth:`LossScale.update` adds a ``jax.debug.callback`` that calls
:func:`mpx.check_stuck` (the one check every backend runs) on the host with the new consecutive count,
the scale and whether the loss was finite (``update(finite, loss_finite=...)``;
``with_loss_scaling``'s update takes ``loss=`` for it, the loss or the scaled
loss).  Warn mode warns from the callback.  Raise mode raises
:class:`mpx.ScalerStuckError` there; inside ``jax.jit`` JAX re-raises it as a
``jax.errors.JaxRuntimeError`` whose message holds the ``ScalerStuckError``
text (a traced value cannot raise a Python exception of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mpx.errors import MPXError
from mpx.history import ScalerHistory
from mpx.scaling import ScalerConfig
from mpx.stuck import check_stuck

__all__ = ["HistoryRecorder", "stuck_callback"]


def stuck_callback(config: ScalerConfig, scale: Any, consecutive: Any, loss_finite: Any = None) -> None:
    """Add the host-side stuck check, :func:`mpx.check_stuck` in a ``jax.debug.callback``, for the state
    after a step (``loss_finite``: a bool scalar or None, sent as the int flag 1/0/-1)."""
    flag = jnp.int8(-1) if loss_finite is None else jnp.asarray(loss_finite).astype(jnp.int8)

    def host_check(scale: Any, consecutive: Any, flag: Any) -> None:
        check_stuck(config, scale, consecutive, flag, stacklevel=2)

    jax.debug.callback(host_check, scale, consecutive, flag)


class HistoryRecorder:
    """Records the loss scale's state after each step, on device; reads it back in one transfer.

    Args:
        callback: a function called with an :class:`mpx.ScalerHistory` of the
            steps recorded since its last call, every ``every`` records (one
            transfer each time); None (default) for none.
        every: records between callback calls (default 100).

    >>> import mpx, mpx_jax
    >>> ls, rec = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=1)), HistoryRecorder()
    >>> for finite in (True, False):
    ...     ls = ls.update(finite)
    ...     rec.record(ls)
    >>> rec.history().scale
    [131072.0, 65536.0]
    """

    def __init__(self, callback: Callable[[ScalerHistory], Any] | None = None, *, every: int = 100) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise MPXError(f"every: expected an int >= 1 (records between callback calls), got {every!r}")
        self.callback = callback
        self.every = every
        self._config: ScalerConfig | None = None
        self._chunks: list[
            jax.Array
        ] = []  # stacked rows (n, 4) int32: scale bits, tracker, consecutive, steps
        self._rows: list[jax.Array] = []
        self._sent = 0  # rows already given to the callback

    def record(self, loss_scale_or_state: Any) -> None:
        """Record the state after a step: a :class:`~mpx_jax.LossScale`, or anything
        :func:`mpx_jax.get_loss_scale` reads (an optax state, an ``nnx.Optimizer`` or its ``opt_state``)."""
        from mpx_jax.loss_scale import LossScale, plain_loss_scale
        from mpx_jax.opt_state import get_loss_scale

        ls = loss_scale_or_state
        ls = plain_loss_scale(ls) if isinstance(ls, LossScale) else get_loss_scale(ls)
        if self._config is not None and ls.config != self._config:
            raise MPXError(
                "record: this recorder holds another config's history; use one recorder per scaler"
            )
        self._config = ls.config
        self._rows.append(_row(ls.loss_scale, ls.growth_tracker, ls.consecutive_nonfinite, ls.steps))
        if len(self._rows) >= 256:
            self._chunks.append(jnp.stack(self._rows))
            self._rows = []
        if self.callback is not None and len(self) - self._sent >= self.every:
            self.callback(self.history(start=self._sent))
            self._sent = len(self)

    def __len__(self) -> int:
        return sum(int(c.shape[0]) for c in self._chunks) + len(self._rows)

    def history(self, start: int = 0) -> ScalerHistory:
        """The recorded steps (from the ``start``-th record on) as an :class:`mpx.ScalerHistory`; one transfer."""
        if self._config is None:
            raise MPXError("history: nothing recorded yet; call recorder.record(opt_state) after each step")
        parts = jax.device_get([*self._chunks, *self._rows])
        rows = np.concatenate([np.asarray(p).reshape(-1, 4) for p in parts])[start:]
        return ScalerHistory.from_rows(self._config, rows, len(rows))


@jax.jit
def _row(scale: jax.Array, tracker: jax.Array, consecutive: jax.Array, steps: jax.Array) -> jax.Array:
    return jnp.stack([lax.bitcast_convert_type(scale, jnp.int32), tracker, consecutive, steps])
