"""Scaler history and stuck detection of :class:`mpx_keras.LossScaleOptimizer`, inside traced steps too.

History (opt-in, ``LossScaleOptimizer.record_history()``): each optimizer step
writes the state after it and its events (the scale's float32 bits, the kernel's event
bits, ``consecutive_nonfinite``, the step number) into one row of an int32 ring-buffer
variable (:class:`HistoryBuffer`), by the core's ring kernel
(:func:`mpx.kernels.ring.record`, with the optimizer's table) inside the step: eagerly,
inside ``tf.function``, ``torch.compile`` and the jax trainer's jitted
``stateless_apply`` alike, with no host read.  ``history()`` reads the buffer on
the host in one transfer and decodes it with :meth:`mpx.ScalerHistory.from_rows`.
On jax the buffer's two variables join the optimizer's ``variables`` while
recording (the jax trainer threads only those through its pure step); they are
never saved with the optimizer.  Off (the default), nothing is added to a step.

Stuck detection (``ScalerConfig.max_consecutive_skips``): :func:`mpx.check_stuck`
runs on the host after each optimizer step that moved the scaler:

- a step that runs eagerly (torch; custom loops on jax and TensorFlow) checks in
  Python and raises :class:`mpx.ScalerStuckError` itself; the loss given to
  ``scale_loss`` tells a non-finite loss apart from overflowing gradients;
- a ``tf.function`` step (TensorFlow's ``fit``) checks through a
  ``tf.py_function``; :class:`LossFlag` (an int8 variable written by
  ``scale_loss``) carries whether the loss was finite; raise mode raises there
  and TensorFlow re-raises it as ``tf.errors.InvalidArgumentError`` holding the
  ``ScalerStuckError`` text;
- the jax trainer's jitted ``stateless_apply`` checks through
  ``jax.debug.callback``; jax re-raises a raise-mode error as a
  ``JaxRuntimeError`` holding the text.  The loss is differentiated in another
  trace there, so the message leaves its cause open;
- a step XLA compiles on TensorFlow (``fit`` with ``jit_compile=True``) cannot
  call the host: it checks nothing itself, and
  ``LossScaleOptimizer.check_stuck()`` checks its state between steps on the host
  (:class:`mpx_keras.LossScaleMonitor` calls it after each batch).

Warn mode warns from each of these.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import mpx
from mpx.kernels import ArrayOps, ring

__all__ = ["FloorMark", "HistoryBuffer", "LossFlag", "check_floor_in_step", "check_stuck_in_step"]

ops = keras.ops


def _variable(value: Any, dtype: str, name: str) -> keras.Variable:
    return keras.Variable(
        value, dtype=dtype, trainable=False, autocast=False, aggregation="only_first_replica", name=name
    )


class HistoryBuffer:
    """The last ``capacity`` states after each step: an int32 ``capacity x 4`` variable and a row count.

    Args:
        capacity: steps kept (an int in [1, 2**31 - 1]).

    Raises:
        MPXError: for a bad ``capacity``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = ring.check_capacity(capacity)
        self.rows = _variable(np.zeros((capacity, len(ring.ROW_FIELDS)), np.int32), "int32", "mpx_history")
        self.recorded = _variable(np.int32(0), "int32", "mpx_history_rows")

    @property
    def variables(self) -> list[keras.Variable]:
        """The buffer's two variables (rows, then the count of rows written)."""
        return [self.rows, self.recorded]

    def record(self, o: ArrayOps, state: Any, events: Any, when: Any = None) -> None:
        """Write the state after this step (a :class:`mpx.kernels.scale.ScaleState` of tensors) and the step's
        ``events`` (:func:`mpx.kernels.scale.events`) into the next row, by :func:`mpx.kernels.ring.record`
        with the table ``o``.

        ``when``: a bool scalar tensor; when given, the row is written only where it is
        True (an accumulation window's last micro-batch), without a branch.
        """
        row = ring.row(o, state.scale, events, state.consecutive_nonfinite, state.steps)
        rows, recorded = ring.record(o, self.rows.value, self.recorded.value, row, when)
        self.rows.assign(rows)
        self.recorded.assign(recorded)

    def read(self, config: mpx.ScalerConfig) -> mpx.ScalerHistory:
        """The recorded steps, oldest first (one read of the buffer; :meth:`mpx.ScalerHistory.from_rows`)."""
        rows = ops.convert_to_numpy(self.rows.value)
        return mpx.ScalerHistory.from_rows(config, rows, int(ops.convert_to_numpy(self.recorded.value)))


class LossFlag:
    """Whether the last loss given to ``scale_loss`` was finite: an int8 variable, -1 unknown, 0 no, 1 yes.

    Written inside a ``tf.function`` step (TensorFlow's ``fit``), where the loss has no
    value on the host; an eager step keeps the loss itself.
    """

    def __init__(self) -> None:
        self.flag = _variable(np.int8(-1), "int8", "mpx_loss_finite")

    def note(self, loss: Any) -> None:
        self.flag.assign(ops.cast(ops.all(ops.isfinite(loss)), "int8"))

    def take(self) -> Any:
        """The flag, reset to unknown for the next step."""
        value = ops.copy(self.flag.value)
        self.flag.assign(ops.full((), -1, "int8"))
        return value


def check_stuck_in_step(
    config: mpx.ScalerConfig, scale: Any, consecutive: Any, flag: Any, moved: Any
) -> None:
    """:func:`mpx.check_stuck` on the host from inside a traced step (tensors).

    TensorFlow: a ``tf.py_function``; jax: ``jax.debug.callback``.  ``flag``: the loss
    flag tensor (int8, -1 unknown) or None; ``moved``: a bool tensor, False where the
    scaler did not move (an accumulation window's earlier micro-batches), or None.
    """
    backend = keras.config.backend()

    def body(s: Any, c: Any, f: Any, m: Any) -> None:
        if bool(np.asarray(m)):
            mpx.check_stuck(
                config, np.asarray(s), np.asarray(c), None if f is None else np.asarray(f), stacklevel=5
            )

    moved = ops.convert_to_tensor(True) if moved is None else moved
    flag = ops.full((), -1, "int8") if flag is None else flag
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_body(s: Any, c: Any, f: Any, m: Any) -> Any:
            body(s.numpy(), c.numpy(), f.numpy(), m.numpy())
            return tf.constant(0, tf.int32)

        tf.py_function(tf_body, [scale, consecutive, flag, moved], tf.int32)
    elif backend == "jax":
        import jax

        jax.debug.callback(body, scale, consecutive, flag, moved)
    else:  # torch runs the step eagerly; torch.compile traces Python, so a host check is a graph break
        body(*(ops.convert_to_numpy(t) for t in (scale, consecutive, flag, moved)))


def check_floor_in_step(config: mpx.ScalerConfig, hit: Any, steps: Any, scale: Any, moved: Any) -> None:
    """:func:`mpx.check_floor` on the host from inside a traced step, as :func:`check_stuck_in_step`:
    ``hit`` is :func:`mpx.kernels.scale.floor_hit` of the step (a bool tensor)."""
    moved = ops.convert_to_tensor(True) if moved is None else moved
    hit = ops.logical_and(ops.convert_to_tensor(hit), moved)

    def body(h: Any, n: Any, s: Any) -> None:
        mpx.check_floor(config, bool(np.asarray(h)), int(np.asarray(n)), float(np.asarray(s)))

    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        def tf_body(h: Any, n: Any, s: Any) -> Any:
            body(h.numpy(), n.numpy(), s.numpy())
            return tf.constant(0, tf.int32)

        tf.py_function(tf_body, [hit, steps, scale], tf.int32)
    elif backend == "jax":
        import jax

        jax.debug.callback(body, hit, steps, scale)
    else:
        body(*(ops.convert_to_numpy(t) for t in (hit, steps, scale)))


class FloorMark:
    """``on_floor="raise"`` in a step XLA compiles on TensorFlow (``jit_compile=True``), which cannot call the
    host: the step writes the first step number whose back-off was due at the floor (and the scale) into two
    variables, and :meth:`check`, on the host after the step (``LossScaleOptimizer.check_stuck()``, which
    :class:`mpx_keras.LossScaleMonitor` calls after each batch), raises :class:`mpx.ScalerFloorError` for it,
    the message every backend raises, naming that step.  The step itself was skipped and the scale kept at
    ``min_scale``, as everywhere; only the raise comes later: at the first host check after the step."""

    def __init__(self) -> None:
        self.step = _variable(np.int32(0), "int32", "mpx_floor_step")
        self.scale = _variable(np.float32(0.0), "float32", "mpx_floor_scale")

    def mark(self, hit: Any, steps: Any, scale: Any) -> None:
        """Inside the step: keep ``steps`` and ``scale`` where ``hit`` (a bool tensor) and no step is marked yet."""
        first = ops.logical_and(ops.convert_to_tensor(hit), ops.equal(self.step.value, 0))
        self.step.assign(ops.where(first, ops.cast(steps, "int32"), self.step.value))
        self.scale.assign(ops.where(first, ops.cast(scale, "float32"), self.scale.value))

    def check(self, config: mpx.ScalerConfig) -> None:
        """On the host: raise :class:`mpx.ScalerFloorError` for the marked step (clearing the mark), if any."""
        step = int(ops.convert_to_numpy(self.step.value))
        if step:
            scale = float(ops.convert_to_numpy(self.scale.value))
            self.step.assign(0)
            mpx.check_floor(config, True, step, scale)
