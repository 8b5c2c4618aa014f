"""Is a Keras model's float16 compute loss scaled?  :func:`check_model` and :class:`LossScaleMonitor`.

Keras's ``compile`` wraps the optimizer in loss scaling only when the compiled
model's own dtype policy is exactly ``mixed_float16``: a float32 model around a
float16 backbone trains float16 gradients without loss scaling, and Keras says
nothing.  :func:`check_model` finds the layers that compute in float16 and
says whether the model's optimizer scales the loss; :class:`LossScaleMonitor`
warns about it when training begins and writes the scale into the logs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from mpx.errors import UnsupportedTypeError
from mpx_keras._layer_kinds import walk

__all__ = ["LossScaleMonitor", "ModelCheck", "UnscaledFloat16Warning", "check_model"]


class UnscaledFloat16Warning(UserWarning):
    """A model computes in float16 but its optimizer does no loss scaling."""


@dataclass(frozen=True)
class ModelCheck:
    """What :func:`check_model` found.

    Attributes:
        float16_layers: paths of the layers whose compute dtype is float16 (model order).
        loss_scaling: whether the model's optimizer scales the loss (an mpx or Keras
            ``LossScaleOptimizer``, or an optimizer with a ``loss_scale_factor``); None when
            the model has no optimizer (not compiled).
        message: one sentence saying what is wrong, or None when nothing is.
    """

    float16_layers: tuple[str, ...] = field(default=())
    loss_scaling: bool | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return self.message is None


def _float16_layers(model: keras.layers.Layer) -> list[str]:
    found = []
    for path, layer in walk(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and policy.compute_dtype == "float16" and (layer.weights or path):
            found.append(path or layer.name)
    return found


def _scales_loss(optimizer: Any) -> bool:
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        from mpx_keras.loss_scale_optimizer import LossScaleOptimizer

        return not (isinstance(optimizer, LossScaleOptimizer) and optimizer.config.kind == "none")
    return getattr(optimizer, "loss_scale_factor", None) is not None


def check_model(model: keras.layers.Layer) -> ModelCheck:
    """Whether a Keras model that computes in float16 has loss scaling.

    Looks at every layer's compute dtype and at ``model.optimizer`` (after
    ``compile``).  Returns a :class:`ModelCheck`; its ``message`` names the
    float16 layers (the first five) when the optimizer does no loss scaling.

    Raises:
        UnsupportedTypeError: when ``model`` is not a Keras layer or model.
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    layers = tuple(_float16_layers(model))
    optimizer = getattr(model, "optimizer", None)
    scaling = None if optimizer is None else _scales_loss(optimizer)
    message = None
    if layers and scaling is False:
        shown = ", ".join(repr(p) for p in layers[:5]) + (
            f" and {len(layers) - 5} more" if len(layers) > 5 else ""
        )
        message = (
            f"{len(layers)} layer(s) of model {model.name!r} compute in float16 ({shown}) but its optimizer "
            f"{type(optimizer).__name__} does no loss scaling, so small float16 gradients underflow to zero; "
            "wrap it: mpx_keras.LossScaleOptimizer(optimizer) (Keras wraps it only when the model's own "
            "policy is mixed_float16)."
        )
    return ModelCheck(layers, scaling, message)


class LossScaleMonitor(keras.callbacks.Callback):
    """A Keras callback: the loss scale and skipped steps into the logs each batch, and a float16 check.

    At ``on_train_begin`` it warns (:class:`UnscaledFloat16Warning`, :func:`check_model`'s
    message) when a layer computes in float16 and the model's optimizer does no loss
    scaling.  After each training batch it adds ``loss_scale`` (the scale, a float) and
    ``skipped_steps`` (steps skipped since training began) to the batch's logs, and the
    same at each epoch's end, so ``model.fit(...).history`` holds them.  Reading the
    scale is a host read each batch.  History and the stuck check need no callback
    (the optimizer does both inside its steps, :mod:`mpx_keras.history`), except the
    stuck check of a step XLA compiles on TensorFlow (``jit_compile=True``), which
    cannot reach the host: this callback runs it after each batch
    (:meth:`mpx_keras.LossScaleOptimizer.check_stuck`).

    Args:
        warn: keyword only; whether ``on_train_begin`` warns (default True).
    """

    def __init__(self, *, warn: bool = True) -> None:
        super().__init__()
        self.warn = warn
        self.check: ModelCheck | None = None
        self._skipped_at_begin = 0

    def _scaler(self) -> Any:
        opt = getattr(self.model, "optimizer", None)
        return opt if hasattr(opt, "get_scale") and hasattr(opt, "state") else None

    def _keras_scale(self) -> float | None:
        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, keras.optimizers.LossScaleOptimizer):  # Keras's own
            return float(np.float32(keras.ops.convert_to_numpy(opt.dynamic_scale.value)))
        return None

    def on_train_begin(self, logs: Any = None) -> None:
        self.check = check_model(self.model)
        if self.warn and self.check.message is not None:
            warnings.warn(self.check.message, UnscaledFloat16Warning, stacklevel=2)
        scaler = self._scaler()
        self._skipped_at_begin = scaler.state.skipped_steps if scaler is not None else 0

    def _write(self, logs: Any) -> None:
        if logs is None:
            return
        scaler = self._scaler()
        if scaler is None:
            scale = self._keras_scale()
            if scale is not None:
                logs["loss_scale"] = scale
            return
        state = scaler.state
        logs["loss_scale"] = state.scale
        logs["skipped_steps"] = state.skipped_steps - self._skipped_at_begin
        if hasattr(scaler, "check_stuck"):  # steps XLA compiled on TensorFlow cannot check themselves
            scaler.check_stuck()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._write(logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._write(logs)
