"""Diagnostics on any Keras backend: where non-finite values first appeared (:func:`watch`) and underflow.

The figures are ``keras.ops`` on the backend's tensors, read back in one
transfer (float32 counts: exact below 2**24 elements per tensor).  ``watch``
wraps every layer's ``call`` for the duration of a ``with`` block (removed on
exit): each layer's outputs are checked, and, where the backend can, the
gradient that flows back into its inputs (``backward``: TensorFlow through a
``tf.custom_gradient`` identity, torch through tensor hooks; jax computes
gradients only inside traced functions, where nothing can be recorded, so
``backward=True`` there raises :class:`mpx.MPXError` naming the backend).  Run
the step eagerly (torch always is; a custom loop or ``run_eagerly=True`` on
TensorFlow and jax).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

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
from mpx_keras import _compat

__all__ = ["Watch", "underflow_stats", "watch"]

ops = keras.ops
_HALF = ("float16", "bfloat16")
#: Keras backend -> the backend name in mpx's reports.
_REPORT_BACKEND = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}


def _dtype(t: Any) -> str:
    return keras.backend.standardize_dtype(t.dtype)


def _floating(t: Any) -> bool:
    """A backend tensor (or Keras variable) of a floating dtype; KerasTensors and non-tensors are not."""
    if isinstance(t, keras.Variable):
        t = t.value
    return (
        ops.is_tensor(t) and not isinstance(t, keras.KerasTensor) and keras.backend.is_float_dtype(_dtype(t))
    )


def _concrete(t: Any) -> bool:
    """Whether ``t`` has a value now (not traced)."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(t, jax.core.Tracer)
    return True


def _row(t: Any) -> Any:
    """``[finite, max|x| (NaN ignored), NaN count, inf count]`` as float32 on the tensor's device."""
    if isinstance(t, keras.Variable):
        t = t.value
    x = ops.cast(t, "float32") if _dtype(t) in _HALF else t
    nan = ops.isnan(x)
    a = ops.where(nan, ops.zeros_like(x), ops.abs(x))
    size = int(np.prod(x.shape)) if x.shape is not None else 0
    top = ops.cast(ops.max(a), "float32") if size else ops.zeros((), "float32")
    n_nan = ops.sum(ops.cast(nan, "float32"))
    n_inf = ops.sum(ops.cast(ops.isinf(x), "float32"))
    return ops.stack([ops.cast(ops.equal(n_nan + n_inf, 0.0), "float32"), top, n_nan, n_inf])


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
    """The scale of a LossScaleOptimizer (its ``get_scale()``) or of a number; None for None."""
    if scaler is None:
        return None
    if hasattr(scaler, "get_scale"):
        return float(scaler.get_scale())
    if ops.is_tensor(scaler):
        scaler = ops.convert_to_numpy(scaler)
    return check_scale(scaler)


class Watch:
    """The handle a ``watch`` block returns: :meth:`check_gradients`, then :meth:`report`."""

    def __init__(self, model: keras.layers.Layer, *, scaler: Any = None, backward: bool | None = None,
                 log: bool = True) -> None:  # fmt: skip
        if not isinstance(model, keras.layers.Layer):
            raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
        backend = keras.config.backend()
        if backward is None:
            backward = backend != "jax"
        if backward and backend == "jax":
            raise _compat.unsupported_on_backend(
                "watch(backward=True)",
                "jax computes gradients only inside traced functions, where nothing can be recorded; "
                "use backward=False and pass the step's gradients to check_gradients()",
            )
        self.model = model
        self.scaler = scaler
        self.backward = backward
        self.log = log
        self._rows: list[tuple[str, str, str, Any]] = []
        self._wrapped: list[keras.layers.Layer] = []
        self._report: NonfiniteReport | None = None
        self._traced = 0

    def _note(self, kind: str, name: str, t: Any) -> None:
        if _concrete(t):
            self._rows.append((kind, name, _dtype(t), _row(t)))
        else:  # a traced value cannot leave the trace
            self._traced += 1

    def _tag(self, name: str, t: Any) -> Any:
        """``t`` unchanged, with the gradient flowing back into it recorded (TensorFlow, torch)."""
        if not _floating(t) or not _concrete(t):
            return t
        backend = keras.config.backend()
        if backend == "torch":
            if t.requires_grad:
                t = t.view_as(t)  # a new node: the hook sees this layer's input gradient only
                t.register_hook(lambda g: self._note("backward", name, g))
            return t
        import tensorflow as tf

        @tf.custom_gradient
        def identity(x: Any) -> Any:
            def grad(dy: Any) -> Any:
                self._note("backward", name, dy)
                return dy

            return tf.identity(x), grad

        return identity(t)

    def _wrap(self, name: str, layer: keras.layers.Layer) -> None:
        original = layer.call

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.backward:
                args = tuple(keras.tree.map_structure(functools.partial(self._tag, name), a) for a in args)
            out = original(*args, **kwargs)
            for t in keras.tree.flatten(out):
                if _floating(t):
                    self._note("forward", name, t)
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
                self._note("gradient", getattr(v, "path", None) or v.name, ops.convert_to_tensor(g))

    def report(self) -> NonfiniteReport:
        """Where non-finite values first appeared: layer outputs, then input gradients, then variable gradients.

        One transfer; logs one line on ``mpx.diagnostics``.

        Raises:
            DiagnosticsError: when the watched step was traced (nothing could be recorded).
        """
        rows = list(self._rows)
        if self._traced and not rows:
            raise DiagnosticsError(
                "model: the watched step was traced (tf.function, jax.jit, or fit on jax), where nothing "
                "can be recorded; run it eagerly (a custom loop, or compile(run_eagerly=True))"
            )
        host = ops.convert_to_numpy(ops.stack([r[3] for r in rows])).tolist() if rows else []
        order = {"forward": 0, "backward": 1, "gradient": 2}
        sites = [NonfiniteSite(kind, name, top, int(nan), int(inf), dtype)
                 for (kind, name, dtype, _), (finite, top, nan, inf) in zip(rows, host, strict=True) if not finite]  # fmt: skip
        sites.sort(key=lambda s: order[s.kind])  # stable: keeps the order within each kind
        self._report = nonfinite_report(
            _REPORT_BACKEND.get(keras.config.backend(), keras.config.backend()), sites,
            checked=len({(r[0] == "gradient", r[1]) for r in rows}), scale=_scale_of(self.scaler), log=self.log,
        )  # fmt: skip
        return self._report


def watch(
    model: keras.layers.Layer, *, scaler: Any = None, backward: bool | None = None, log: bool = True
) -> Watch:
    """A context manager that finds where non-finite values first appear in a Keras model's step, per layer.

    ``scaler`` (a LossScaleOptimizer, read with its ``get_scale()``, or a number; default None)
    adds the loss scale to the report.  ``backward`` (default None: True on TensorFlow and torch,
    False on jax) also checks the gradient flowing into each layer's inputs.  Returns a
    :class:`Watch`; its ``report()`` is an :class:`mpx.diagnostics.NonfiniteReport` whose
    ``origin`` is the layer path (``"encoder.dense_1"``).

    Raises:
        UnsupportedTypeError: when ``model`` is not a Keras layer or model.
        MPXError: for ``backward=True`` on jax.
    """
    return Watch(model, scaler=scaler, backward=backward, log=log)


def underflow_stats(grads: Sequence[Any], scale: Any, *, variables: Sequence[Any] | None = None,
                    names: Sequence[str] | None = None, compute_dtype: Any = "float16", scaled: bool = True,
                    log: bool = True) -> UnderflowReport:  # fmt: skip
    """Per variable: the fraction of gradient elements zero or subnormal in ``compute_dtype`` at ``scale``.

    ``grads`` are backend tensors: the gradients of the scaled loss when
    ``scaled`` (the default), else multiplied by ``scale`` here in float32;
    named by ``variables`` (their ``path``) or ``names`` (default: their index).
    ``scale`` is a number or a LossScaleOptimizer.  Computed with ``keras.ops``
    on the device and read back in one transfer; see :mod:`mpx.diagnostics`.
    """
    value = check_scale(scale) if scale is None else _scale_of(scale)
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    if names is None:
        names = [getattr(v, "path", None) or v.name for v in variables] if variables is not None else [
            str(i) for i in range(len(grads))]  # fmt: skip
    if len(names) != len(grads):
        raise DiagnosticsError(f"names: {len(names)} names for {len(grads)} gradients")
    pairs = [(n, ops.convert_to_tensor(g)) for n, g in zip(names, grads, strict=True) if g is not None]
    tiny = dtype_info(compute).smallest_normal
    rows = []
    for _, g in pairs:
        s = ops.cast(g, "float32")
        if not scaled:
            s = s * value
        c = ops.abs(ops.cast(ops.cast(s, compute), "float32"))
        zero = ops.equal(c, 0.0)
        top = ops.max(ops.abs(s)) if int(np.prod(s.shape)) else ops.zeros((), "float32")
        rows.append(ops.stack([ops.sum(ops.cast(zero, "float32")),
                               ops.sum(ops.cast(ops.logical_and(c > 0, c < tiny), "float32")),
                               ops.sum(ops.cast(ops.logical_and(zero, ops.not_equal(s, 0.0)), "float32")),
                               ops.cast(top, "float32")]))  # fmt: skip
    counts = (
        ops.convert_to_numpy(ops.stack(rows)).astype(np.float64) if rows else np.zeros((0, 4))
    )  # one transfer
    return build_underflow_report(
        _REPORT_BACKEND.get(keras.config.backend(), keras.config.backend()), [n for n, _ in pairs],
        [int(np.prod(g.shape)) for _, g in pairs], counts, scale=value, compute_dtype=compute, log=log,
    )  # fmt: skip
