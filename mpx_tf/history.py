"""TensorBoard scalars of :class:`mpx_tf.LossScaleOptimizer`'s scaler history (``tf.summary``).

The history itself (a ring buffer written inside each step) and stuck detection
are :mod:`mpx_keras.history`'s, the same on every Keras backend; its names are
re-exported here.  :class:`ScalerHistoryCallback` is TensorFlow's own part: it
writes the recorded steps to a TensorBoard log and adds the scale to ``fit``'s
epoch logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from mpx.errors import UnsupportedTypeError
from mpx.history import ScalerHistory
from mpx_keras.history import HistoryBuffer, LossFlag, check_stuck_in_step
from mpx_tf import _compat

__all__ = ["HistoryBuffer", "LossFlag", "ScalerHistoryCallback", "check_stuck_in_step"]


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
        from mpx_keras.loss_scale_optimizer import LossScaleOptimizer

        opt = getattr(self.model, "optimizer", None)
        if not isinstance(opt, LossScaleOptimizer):
            raise UnsupportedTypeError(
                "ScalerHistoryCallback: the model's optimizer must be an mpx_tf (or mpx_keras) LossScaleOptimizer, "
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
