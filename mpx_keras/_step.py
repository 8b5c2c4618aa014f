"""The pure parts of :class:`mpx_keras.LossScaleOptimizer`'s step, on ``keras.ops`` (any Keras backend).

Keras's LossScaleOptimizer arguments mapped onto an :class:`mpx.ScalerConfig`
(:func:`keras_arguments`), the finiteness test, the unscaling, and :func:`branch` (a
``keras.ops.cond``, or a Python branch where jax runs eagerly).  The scaler's transition
itself is the core's kernel, :func:`mpx.kernels.scale.update`, run with a backend's table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

import mpx
from mpx.errors import MPXError, ScalerConfigError, UnsupportedTypeError
from mpx_keras import _compat

__all__ = [
    "GROWTH_VARIABLE",
    "STATE_VARIABLES",
    "all_finite",
    "branch",
    "check_inner",
    "divide",
    "keras_arguments",
]

ops = keras.ops
HALF = ("float16", "bfloat16")

#: Keras's base-optimizer arguments its LossScaleOptimizer accepts at their defaults only (older
#: saved configs carry them) and refuses otherwise, advising to set them on the inner optimizer.
INNER_ONLY = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def keras_arguments(
    cfg: mpx.ScalerConfig,
    initial_scale: float | None,
    dynamic_growth_steps: int | None,
    dynamic: Any,
    kwargs: dict[str, Any],
    allowed: str = "name",
) -> mpx.ScalerConfig:
    """The config after Keras's LossScaleOptimizer arguments; raises for those mpx cannot honour."""
    if dynamic is not True:
        raise MPXError(
            f"dynamic: only True is accepted (Keras 3's LossScaleOptimizer is always dynamic), got {dynamic!r}; "
            "for a fixed scale pass config=mpx.ScalerConfig(kind='static', init_scale=...)"
        )
    for arg, default in INNER_ONLY.items():
        if arg in kwargs and kwargs.pop(arg) != default:
            advice = (
                " (mpx's scaler then moves once per optimizer step and skips a window with a "
                "non-finite micro-batch whole)"
                if arg == "gradient_accumulation_steps"
                else ""
            )
            raise MPXError(
                f"LossScaleOptimizer does not support `{arg}`. Instead, set `{arg}` on the `inner_optimizer`{advice}."
            )
    if kwargs:
        raise MPXError(
            f"LossScaleOptimizer: unknown arguments {', '.join(repr(k) for k in kwargs)}; allowed: "
            f"inner_optimizer, config (an mpx.ScalerConfig, its dict, or a policy), {allowed}, and "
            "Keras's initial_scale, dynamic_growth_steps, dynamic=True"
        )
    changes: dict[str, Any] = {}
    if initial_scale is not None:
        changes["init_scale"] = float(initial_scale)
    if dynamic_growth_steps is not None:
        changes["growth_interval"] = dynamic_growth_steps
    if not changes:
        return cfg
    if cfg.kind != "dynamic":
        raise ScalerConfigError(
            f"initial_scale / dynamic_growth_steps: they configure a dynamic scaler, but config.kind is {cfg.kind!r}"
        )
    return mpx.ScalerConfig.from_dict({**cfg.to_dict(), **changes})


def check_inner(inner_optimizer: Any) -> None:
    """Raise :class:`mpx.UnsupportedTypeError` unless ``inner_optimizer`` is a plain Keras optimizer."""
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise UnsupportedTypeError(
            f"inner_optimizer: expected a keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}."
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise UnsupportedTypeError(
            "inner_optimizer: it is already a LossScaleOptimizer; wrap the plain optimizer once."
        )
    _compat.check_optimizer(inner_optimizer, _METHODS)


#: The Keras optimizer internals this (backend-neutral) optimizer calls.
_METHODS = ("_overwrite_variable_with_gradient",)

#: The state variables, in order: (attribute, saved name, dtype).
STATE_VARIABLES = (
    ("dynamic_scale", "dynamic_scale", "float32"),
    ("step_counter", "step_counter", "int32"),  # mpx's growth_tracker (Keras's name)
    ("consecutive_nonfinite", "consecutive_nonfinite", "int32"),
    ("total_steps", "steps", "int32"),
    ("skipped_steps", "skipped_steps", "int32"),
)
#: The sixth state variable, made only for ``hysteresis_reset="growth"`` (so a default config's
#: variables and saved files are as they were).
GROWTH_VARIABLE = ("nonfinite_since_growth", "nonfinite_since_growth", "int32")


def all_finite(grads: Sequence[Any]) -> Any:
    """A bool scalar tensor: every element of every (not None) gradient is finite."""
    flags = [ops.all(ops.isfinite(g)) for g in grads if g is not None]
    return ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)


def is_concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (eager), not a traced placeholder (``tf.function``, jax tracing)."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True  # torch runs eagerly (torch.compile traces through Python branches)


def branch(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``true_fn()`` if ``pred`` else ``false_fn()``: ``keras.ops.cond`` on TensorFlow and torch; on jax
    a Python branch on the concrete flag (``apply`` runs eagerly there: a traced jax step calls
    :meth:`LossScaleOptimizer.stateless_apply`, whose branches are pure)."""
    if keras.config.backend() != "jax":
        return ops.cond(pred, true_fn, false_fn)
    if not is_concrete(pred):
        raise _compat.unsupported_on_backend(
            "LossScaleOptimizer.apply() inside a traced (jitted) function",
            "variables cannot be assigned inside jax tracing; call stateless_apply (as Keras's jax trainer "
            "does) with the variables' values",
        )
    return true_fn() if bool(pred) else false_fn()


def divide(g: Any, scale: Any) -> Any:
    """``g / scale``; a half gradient is unscaled in float32, then cast back."""
    dtype = keras.backend.standardize_dtype(g.dtype)
    if dtype in HALF:
        return ops.cast(ops.divide(ops.cast(g, "float32"), scale), dtype)
    return ops.divide(g, ops.cast(scale, dtype))
