"""Diagnostics for Keras 3 on TensorFlow: where non-finite values first appeared (:func:`watch`) and underflow.

``watch(model)`` wraps every layer's ``call`` for the duration of a ``with``
block: each layer's outputs are checked (forward), and its inputs pass
through an identity whose gradient checks what flows back into the layer
(backward).  The wrappers change no value and are removed on exit.  Run the
step eagerly (a custom loop outside ``tf.function``, or ``run_eagerly=True``):
the figures are eager tensors, read in one transfer by :meth:`Watch.report`.

>>> import keras, mpx_tf, tensorflow as tf
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
>>> with mpx_tf.watch(model) as w:
...     _ = model(tf.ones((1, 4)))
>>> w.report().finite
True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from mpx.diagnostics import (
    DiagnosticsError,
    NonfiniteReport,
    NonfiniteSite,
    UnderflowReport,
    build_underflow_report,
    check_scale,
    nonfinite_report,
)
from mpx.dtypes import canonical_dtype, dtype_info
from mpx.errors import UnsupportedTypeError
from mpx_tf import _compat

__all__ = ["Watch", "underflow_stats", "watch"]


def _row(t: tf.Tensor) -> tf.Tensor:
    """``[finite, max|x| (NaN ignored), NaN count, inf count]`` as float64 on the tensor's device."""
    x = tf.cast(t, tf.float32) if t.dtype in (tf.float16, tf.bfloat16) else t
    nan = tf.math.is_nan(x)
    a = tf.where(nan, tf.zeros_like(x), tf.abs(x))
    top = tf.reduce_max(a) if x.shape.num_elements() else tf.zeros((), x.dtype)
    n_nan = tf.reduce_sum(tf.cast(nan, tf.float64))
    n_inf = tf.reduce_sum(tf.cast(tf.math.is_inf(x), tf.float64))
    return tf.stack([tf.cast(n_nan + n_inf == 0, tf.float64), tf.cast(top, tf.float64), n_nan, n_inf])


def _floating(t: Any) -> bool:
    return isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating


def _walk(layer: keras.layers.Layer, prefix: str = "") -> list[tuple[str, keras.layers.Layer]]:
    out = []
    for sub in layer.layers if isinstance(layer, keras.Model) else _compat.child_layers(layer):
        if isinstance(sub, keras.layers.InputLayer):
            continue
        path = f"{prefix}.{sub.name}" if prefix else sub.name
        out.append((path, sub))
        out += _walk(sub, path)
    return out


def _scale_of(scaler: Any) -> float | None:
    """The scale of an ``mpx_tf.LossScaleOptimizer`` (its ``get_scale()``) or of a number; None for None."""
    if scaler is None:
        return None
    if hasattr(scaler, "get_scale"):
        return float(scaler.get_scale())
    return check_scale(scaler.numpy() if isinstance(scaler, (tf.Tensor, tf.Variable)) else scaler)


class Watch:
    """The handle a ``watch`` block returns: :meth:`check_gradients`, then :meth:`report`."""

    def __init__(self, model: keras.layers.Layer, *, scaler: Any = None, backward: bool = True,
                 log: bool = True) -> None:  # fmt: skip
        if not isinstance(model, keras.layers.Layer):
            raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
        self.model = model
        self.scaler = scaler
        self.backward = backward
        self.log = log
        self._rows: list[tuple[str, str, str, tf.Tensor]] = []
        self._wrapped: list[keras.layers.Layer] = []
        self._report: NonfiniteReport | None = None
        self._traced = 0

    def _record(self, kind: str, name: str, t: tf.Tensor) -> None:
        if tf.executing_eagerly():
            self._rows.append((kind, name, t.dtype.name, _row(t)))
        else:  # inside a tf.function: a symbolic tensor cannot leave the graph
            self._traced += 1

    def _tag(self, name: str, t: Any) -> Any:
        if not _floating(t):
            return t

        @tf.custom_gradient
        def identity(x: tf.Tensor) -> Any:
            def grad(dy: tf.Tensor) -> tf.Tensor:
                self._record("backward", name, dy)
                return dy

            return tf.identity(x), grad

        return identity(t)

    def _wrap(self, name: str, layer: keras.layers.Layer) -> None:
        original = layer.call

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.backward:
                args = tuple(tf.nest.map_structure(functools.partial(self._tag, name), a) for a in args)
            out = original(*args, **kwargs)
            for t in tf.nest.flatten(out):
                if _floating(t):
                    self._record("forward", name, t)
            return out

        object.__setattr__(layer, "call", call)
        self._wrapped.append(layer)

    def __enter__(self) -> Watch:
        for name, layer in _walk(self.model):
            self._wrap(name, layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Restore every layer's own ``call`` (``__exit__`` does)."""
        for layer in self._wrapped:
            layer.__dict__.pop("call", None)
        self._wrapped.clear()

    def reset(self) -> None:
        """Forget what was seen (to watch the next step in the same block)."""
        self._rows.clear()
        self._report = None
        self._traced = 0

    def check_gradients(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> None:
        """Record the (scaled) gradients of ``variables`` (default: the model's trainable variables)."""
        variables = self.model.trainable_variables if variables is None else variables
        if len(grads) != len(variables):
            raise DiagnosticsError(f"grads: {len(grads)} gradients for {len(variables)} variables")
        for g, v in zip(grads, variables, strict=True):
            if g is not None:
                self._rows.append(("gradient", getattr(v, "path", None) or v.name, g.dtype.name,
                                   _row(tf.convert_to_tensor(g))))  # fmt: skip

    def report(self) -> NonfiniteReport:
        """Where non-finite values first appeared: layer outputs, then input gradients, then variable gradients.

        Forward sites are in the order the layers ran, backward sites in the
        order the gradient reached them; variable gradients (from
        :meth:`check_gradients`) come last, in variable order.  One transfer;
        logs one line on ``mpx.diagnostics``.
        """
        rows = list(self._rows)
        if self._traced and not rows:
            raise DiagnosticsError(
                "model: the watched step ran inside a tf.function, where nothing can be "
                "recorded; run it eagerly (outside tf.function, or compile(run_eagerly=True))"
            )
        host = tf.stack([r[3] for r in rows]).numpy().tolist() if rows else []
        order = {"forward": 0, "backward": 1, "gradient": 2}
        sites = [NonfiniteSite(kind, name, top, int(nan), int(inf), dtype)
                 for (kind, name, dtype, _), (finite, top, nan, inf) in zip(rows, host, strict=True) if not finite]  # fmt: skip
        sites.sort(key=lambda s: order[s.kind])  # stable: keeps the order within each kind
        self._report = nonfinite_report("tf", sites, checked=len({(r[0] == "gradient", r[1]) for r in rows}),
                                        scale=_scale_of(self.scaler), log=self.log)  # fmt: skip
        return self._report


def watch(model: keras.layers.Layer, *, scaler: Any = None, backward: bool = True, log: bool = True) -> Watch:
    """A context manager that finds where non-finite values first appear in a Keras model's step, per layer.

    Inside the block each layer's outputs are checked and (``backward``) the
    gradient flowing into its inputs; pass the step's gradients to
    :meth:`Watch.check_gradients` to check the variables too.  ``scaler`` (an
    ``mpx_tf.LossScaleOptimizer``, read with its ``get_scale()``, or a number;
    default None) adds the loss scale to the report, as ``mpx_torch.watch``'s.  The step must run eagerly.  Returns a :class:`Watch`; its
    ``report()`` is an :class:`mpx.diagnostics.NonfiniteReport` whose ``origin``
    is the layer path (``"encoder.dense_1"``).
    """
    return Watch(model, scaler=scaler, backward=backward, log=log)


def underflow_stats(grads: Sequence[Any], scale: Any, *, variables: Sequence[Any] | None = None,
                    names: Sequence[str] | None = None, compute_dtype: Any = "float16", scaled: bool = True,
                    log: bool = True) -> UnderflowReport:  # fmt: skip
    """Per variable: the fraction of gradient elements zero or subnormal in ``compute_dtype`` at ``scale``.

    ``grads`` are the gradients (of the scaled loss when ``scaled``, the
    default; else multiplied by ``scale`` here in float32), named by
    ``variables`` (their ``path``) or ``names`` (default: their index).
    ``scale`` is a number or an ``mpx_tf.LossScaleOptimizer``.  Computed on
    the device and read back in one transfer; see :mod:`mpx.diagnostics`.
    """
    value = check_scale(scale) if scale is None else _scale_of(scale)
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    if names is None:
        names = [getattr(v, "path", None) or v.name for v in variables] if variables is not None else [
            str(i) for i in range(len(grads))]  # fmt: skip
    if len(names) != len(grads):
        raise DiagnosticsError(f"names: {len(names)} names for {len(grads)} gradients")
    pairs = [(n, tf.convert_to_tensor(g)) for n, g in zip(names, grads, strict=True) if g is not None]
    tdt = tf.as_dtype(compute)
    tiny = dtype_info(compute).smallest_normal
    rows = []
    for _, g in pairs:
        s = tf.cast(g, tf.float32)
        if not scaled:
            s = s * tf.constant(value, tf.float32)
        c = tf.abs(tf.cast(tf.cast(s, tdt), tf.float32))
        zero = tf.equal(c, 0)
        top = tf.reduce_max(tf.abs(s)) if s.shape.num_elements() else tf.zeros(())
        rows.append(tf.stack([tf.reduce_sum(tf.cast(zero, tf.float64)),
                              tf.reduce_sum(tf.cast((c > 0) & (c < tiny), tf.float64)),
                              tf.reduce_sum(tf.cast(zero & tf.not_equal(s, 0), tf.float64)),
                              tf.cast(top, tf.float64)]))  # fmt: skip
    counts = tf.stack(rows).numpy() if rows else np.zeros((0, 4))  # the one transfer
    return build_underflow_report("tf", [n for n, _ in pairs], [int(g.shape.num_elements()) for _, g in pairs],
                                  counts, scale=value, compute_dtype=compute, log=log)  # fmt: skip
