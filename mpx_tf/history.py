"""Scaler history, stuck detection and the Keras callback of :class:`mpx_tf.LossScaleOptimizer`.

History (opt-in, ``LossScaleOptimizer.record_history()``): each step writes the
state after it (the scale's float32 bits, ``growth_tracker``,
``consecutive_nonfinite``, the step number) into one row of an int64 ring-buffer variable, inside
the traced step (no host read); :meth:`LossScaleOptimizer.history` reads it in
one transfer.  Its variables are held by a plain object, so they are not part of
the optimizer's saved variables.  Enable it before the step is traced (or call
``model.make_train_function(force=True)``); :class:`ScalerHistoryCallback`
does both for ``model.fit``.  Off (the default), nothing is added to the step.

Stuck detection (``ScalerConfig.max_consecutive_skips``): :meth:`scale_loss`
records whether the loss was finite in a small variable, and each step calls
the core's :func:`mpx.check_stuck`: directly when running eagerly (raising
:class:`mpx.ScalerStuckError` itself), through a ``tf.py_function`` inside a
``tf.function`` (warn mode warns; raise mode raises there, and TensorFlow
re-raises it as ``tf.errors.InvalidArgumentError`` whose message holds the
``ScalerStuckError`` text).  Off, nothing is added to the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from mpx.errors import MPXError, UnsupportedTypeError
from mpx.history import ScalerHistory
from mpx.scaling import COUNTER_MAX, ScalerConfig
from mpx.stuck import check_stuck
from mpx_tf import _compat

__all__ = ["HistoryBuffer", "LossFlag", "ScalerHistoryCallback", "stuck_check"]


class HistoryBuffer:
    """The last ``capacity`` states after each step: an int64 ``capacity x 4`` variable and a row count."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= COUNTER_MAX:
            raise MPXError(f"capacity: expected an int in [1, 2**31 - 1] (steps kept), got {capacity!r}")
        self.capacity = capacity
        with tf.init_scope():
            self.rows = tf.Variable(tf.zeros((capacity, 4), tf.int64), trainable=False, name="mpx_history")
            self.recorded = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="mpx_history_rows")

    def record(self, scale: Any, tracker: Any, consecutive: Any, steps: Any) -> None:
        """Write the state after this step (tensors) into the next row (graph ops only)."""
        row = tf.stack([tf.cast(tf.bitcast(scale, tf.int32), tf.int64), tf.cast(tracker, tf.int64),
                        tf.cast(consecutive, tf.int64), tf.cast(steps, tf.int64)])  # fmt: skip
        index = tf.math.floormod(self.recorded, self.capacity)
        self.rows.scatter_nd_update(tf.reshape(index, (1, 1)), tf.reshape(row, (1, 4)))
        self.recorded.assign_add(1)

    def read(self, config: ScalerConfig) -> ScalerHistory:
        """The recorded steps, oldest first (one read of the buffer; :meth:`mpx.ScalerHistory.from_rows`)."""
        return ScalerHistory.from_rows(config, self.rows.numpy(), int(self.recorded.numpy()))


class LossFlag:
    """Whether the last loss given to ``scale_loss`` was finite: an int8 variable, -1 unknown, 0 no, 1 yes."""

    def __init__(self) -> None:
        with tf.init_scope():
            self.flag = tf.Variable(tf.constant(-1, tf.int8), trainable=False, name="mpx_loss_finite")

    def note(self, loss: Any) -> None:
        self.flag.assign(tf.cast(tf.reduce_all(tf.math.is_finite(loss)), tf.int8))

    def take(self) -> Any:
        """The flag, reset to unknown for the next step."""
        value = tf.identity(self.flag.value())
        with tf.control_dependencies([value]):
            self.flag.assign(tf.constant(-1, tf.int8))
        return value


def stuck_check(config: ScalerConfig, scale: Any, consecutive: Any, flag: Any) -> None:
    """:func:`mpx.check_stuck` after a step (tensors): in Python when eager, else through a ``tf.py_function``."""
    if tf.executing_eagerly():
        check_stuck(config, scale.numpy(), consecutive.numpy(), flag.numpy(), stacklevel=5)
        return

    def body(s: Any, c: Any, f: Any) -> Any:
        check_stuck(config, s.numpy(), c.numpy(), f.numpy(), stacklevel=5)
        return tf.constant(0, tf.int32)

    tf.py_function(body, [scale, consecutive, flag], tf.int32)


def _scalar(tag: str, value: float, step: int) -> None:
    """A TensorBoard scalar: what ``tf.summary.scalar`` writes, without needing the tensorboard package."""
    pb = _compat.summary_pb2
    meta = pb.SummaryMetadata(
        plugin_data=pb.SummaryMetadata.PluginData(plugin_name="scalars"), data_class=pb.DATA_CLASS_SCALAR
    )
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=meta)


class ScalerHistoryCallback(keras.callbacks.Callback):
    """A Keras callback: the loss scale per step to TensorBoard, and per epoch to ``History``.

    Args:
        log_dir: a TensorBoard log directory (``tf.summary`` scalars
            ``{prefix}/scale``, ``{prefix}/skipped``, ``{prefix}/growth``,
            ``{prefix}/backoff`` at each optimizer step); None for no TensorBoard.
        prefix: the tag prefix (default ``loss_scaler``).
        capacity: steps the optimizer's ring buffer keeps between epochs (default 65536).

    At ``on_train_begin`` it starts the optimizer's :meth:`record_history`
    (rebuilding the train function if it was already traced); at each epoch's
    end it reads the steps recorded (one transfer), writes them to TensorBoard
    and adds ``loss_scale`` (the scale at the epoch's end) and
    ``skipped_steps`` (skipped in the epoch) to the epoch's logs, so
    ``model.fit(...).history`` holds them.  :attr:`history` is the whole run's
    :class:`mpx.ScalerHistory`.
    """

    def __init__(self, log_dir: str | Path | None = None, *, prefix: str = "loss_scaler", capacity: int = 65536
                 ) -> None:  # fmt: skip
        super().__init__()
        self.log_dir = None if log_dir is None else str(log_dir)
        self.prefix = prefix
        self.capacity = capacity
        self.history: ScalerHistory | None = None
        self._writer: Any = None
        self._last = 0

    def _optimizer(self) -> Any:
        from mpx_tf.loss_scale_optimizer import LossScaleOptimizer

        opt = getattr(self.model, "optimizer", None)
        if not isinstance(opt, LossScaleOptimizer):
            raise UnsupportedTypeError(
                "ScalerHistoryCallback: the model's optimizer must be an mpx_tf.LossScaleOptimizer, "
                f"got {type(opt).__name__}."
            )
        return opt

    def on_train_begin(self, logs: Any = None) -> None:
        opt = self._optimizer()
        if not opt.recording_history:
            opt.record_history(capacity=self.capacity)
            self.model.make_train_function(force=True)
        self.history = ScalerHistory(opt.config)
        self._last = opt.state.steps
        if self.log_dir is not None and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        opt = self._optimizer()
        recorded = opt.history()
        new = [i for i, s in enumerate(recorded.steps) if s > self._last]
        chunk = ScalerHistory(recorded.config, *([getattr(recorded, k)[i] for i in new]
                                                 for k in ("steps", "scale", "skipped", "growth", "backoff")))  # fmt: skip
        self.history = chunk if self.history is None else self.history.extend(chunk)
        if chunk.steps:
            self._last = chunk.steps[-1]
        if self._writer is not None:
            with self._writer.as_default():
                for i, step in enumerate(chunk.steps):
                    _scalar(f"{self.prefix}/scale", chunk.scale[i], step)
                    for name in ("skipped", "growth", "backoff"):
                        _scalar(f"{self.prefix}/{name}", int(getattr(chunk, name)[i]), step)
            self._writer.flush()
        if logs is not None:
            logs["loss_scale"] = opt.get_scale()
            logs["skipped_steps"] = sum(chunk.skipped)

    def on_train_end(self, logs: Any = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
