"""mpx_tf's ``LossScaleOptimizer``: :class:`mpx_keras.LossScaleOptimizer` plus what is TensorFlow's own.

The state machine, the skip, gradient accumulation, history and stuck detection
are :class:`mpx_keras.LossScaleOptimizer`'s (any Keras backend).  This subclass
adds only TensorFlow's parts:

- under ``tf.distribute`` the finiteness flag is summed over all replicas before
  the decision, so every replica skips or applies together (in replica context
  with an all-reduce, or in cross-replica context under a strategy's
  ``merge_call``, as Keras's own LossScaleOptimizer chooses), accumulation
  windows included (:class:`mpx_tf.distributed.Window`);
- ``reduce_dtype=`` runs the cross-replica gradient sum in that dtype
  (:func:`mpx_tf.distributed.set_reduce_dtype`);
- ``tf.IndexedSlices`` gradients (embeddings) are unscaled and checked as slices;
- the core's kernels (the transition, the history ring) run with TensorFlow's own
  table, :data:`mpx_tf._array_ops.TF_ARRAY_OPS` (an eager step faster than through
  ``keras.ops``' wrappers).

TensorBoard scalars of the history are :class:`mpx_tf.ScalerHistoryCallback`'s
(``tf.summary``).  Saved files naming ``mpx_tf>LossScaleOptimizer`` load as this
class; files saved before the counters became int32 load too (the values are
converted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

import mpx
from mpx_keras._step import HALF, all_finite
from mpx_keras.loss_scale_optimizer import LossScaleOptimizer as KerasLossScaleOptimizer
from mpx_tf import _compat
from mpx_tf._array_ops import TF_ARRAY_OPS
from mpx_tf.distributed import Window, reduce_dtype_of, set_reduce_dtype

__all__ = ["LossScaleOptimizer"]


@keras.saving.register_keras_serializable(package="mpx_tf")
class LossScaleOptimizer(KerasLossScaleOptimizer):
    """:class:`mpx_keras.LossScaleOptimizer` with ``tf.distribute`` and the reduce dtype.

    Args:
        inner_optimizer, config, name, initial_scale, dynamic_growth_steps, dynamic:
            as :class:`mpx_keras.LossScaleOptimizer`.
        reduce_dtype: keyword only; the dtype of the cross-replica gradient sum
            under ``tf.distribute`` (a dtype, or an :class:`mpx.Policy` / spec
            for its ``reduce_dtype``); None (default) sums in the gradients' dtype.

    In a custom loop::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # unscales, checks, maybe skips

    ``iterations`` is the inner optimizer's: skipped steps do not count.  Build the
    optimizer before tracing a custom step (``optimizer.build(model.trainable_variables)``),
    or ``tf.function`` traces the first step twice to create the inner variables.

    Raises:
        as :class:`mpx_keras.LossScaleOptimizer`, and MPXError for a dtype the
        all-reduce cannot sum.
    """

    _ALLOWED = "name, reduce_dtype"
    _array_ops = TF_ARRAY_OPS
    _window_class = Window

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        config: mpx.ScalerConfig | mpx.PolicySpec | Mapping[str, Any] | None = None,
        name: str | None = None,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        dynamic: bool = True,
        reduce_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        reduce = reduce_dtype_of(reduce_dtype)
        super().__init__(
            inner_optimizer, config, name, initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps, dynamic=dynamic, **kwargs,
        )  # fmt: skip
        _compat.check_optimizer(inner_optimizer)
        self._reduce_dtype = reduce
        if reduce is not None:
            set_reduce_dtype(inner_optimizer, reduce)

    # -- the step, under tf.distribute ---------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Unscale the (scaled) ``grads``, update the scaler state, apply them unless the step is skipped.

        Every replica takes the same decision (the flag summed over replicas).
        """
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = self._build_for(trainable_variables)
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if _compat.strategy_supports_no_merge_call():
            self._replica_apply(grads, trainable_variables, variables)
        else:
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_apply, args=(grads, trainable_variables)
            )

    def _divide(self, g: Any, scale: Any) -> Any:
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(self._divide(g.values, scale), g.indices, g.dense_shape)
        g = tf.convert_to_tensor(g)
        if g.dtype.name in HALF:  # unscale in float32, then back to the gradient's dtype
            return tf.cast(tf.cast(g, tf.float32) / scale, g.dtype)
        return g / tf.cast(scale, g.dtype)

    def _all_finite(self, grads: Sequence[Any]) -> Any:
        return all_finite([_values(g) for g in grads if g is not None])

    def _combine(self, finite: Any) -> Any:
        """In replica context: the flag of every replica (one all-reduce of one number)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            nonfinite = ctx.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
            )
            finite = tf.equal(nonfinite, 0.0)
        return finite

    def _unscale_on_replica(self, grads: Any, trainable_variables: Any, check: bool) -> tuple[list[Any], Any]:
        """(unscaled gradients, their finiteness flag) on one replica (``check`` False: a window's, later)."""
        variables = (
            list(trainable_variables)
            if trainable_variables is not None
            else list(_compat.optimizer_member(self, "_trainable_variables"))
        )
        unscaled = self._unscaled(list(grads), variables, self.dynamic_scale.value)
        return unscaled, (self._all_finite(unscaled) if check else tf.constant(True))

    def _cross_replica_apply(self, distribution: Any, grads: Any, trainable_variables: Any) -> None:
        # Unscale and check on each replica, then decide once for all of them, in cross-replica
        # context as Keras does: a cond in replica context cannot hold the inner optimizer's merge_call.
        window = self._accumulation_window()
        unscaled, finite_per_replica = distribution.extended.call_for_each_replica(
            self._unscale_on_replica, args=(grads, trainable_variables, window is None)
        )

        def combined(finite_per_replica: Any) -> Any:
            nonfinite = distribution.reduce(
                tf.distribute.ReduceOp.SUM,
                distribution.extended.call_for_each_replica(
                    lambda f: tf.cast(tf.logical_not(f), tf.float32), args=(finite_per_replica,)
                ),
                axis=None,
            )
            return tf.equal(nonfinite, 0.0)

        def apply_fn() -> None:
            distribution.extended.call_for_each_replica(
                self.inner_optimizer.apply, args=(unscaled, trainable_variables)
            )

        if window is None:
            finite = combined(finite_per_replica)
            self._apply_unless_skipped(finite, apply_fn)
            self._transition(finite)
            return

        def last_fn() -> None:
            finite = combined(
                distribution.extended.call_for_each_replica(
                    window.finite, args=(unscaled, trainable_variables)
                )
            )
            self._apply_unless_skipped(
                finite, lambda: window.apply(distribution, unscaled, trainable_variables), window.skip
            )
            self._transition(finite)

        keras.ops.cond(
            window.is_last(), last_fn, lambda: window.accumulate(distribution, unscaled, trainable_variables)
        )

    # -- serialization ---------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            **({"reduce_dtype": self._reduce_dtype} if self._reduce_dtype is not None else {}),
        }


def _values(g: Any) -> Any:
    return g.values if isinstance(g, tf.IndexedSlices) else g
