"""Replicas and accumulation for mpx_tf: the reduce dtype and one decision per accumulation window.

- :func:`set_reduce_dtype` makes a Keras optimizer's cross-replica gradient
  sum (the ``all_reduce`` its TensorFlow backend runs inside ``apply``) run in
  a policy's ``reduce_dtype``: each replica's gradient is cast to it before the
  sum and the sum cast back to the gradient's dtype after, once per optimizer
  step (with ``gradient_accumulation_steps``, once per window).
- :class:`Window` is how :class:`mpx_tf.LossScaleOptimizer` follows the core's
  accumulation semantics (:mod:`mpx.accumulation`) when the inner optimizer has
  ``gradient_accumulation_steps=k``: the scale is constant inside a window, the
  finiteness of the window (the accumulated gradients plus the last
  micro-batch's, on every replica, summed over replicas) is tested once at the
  window's last micro-batch, and a non-finite window is skipped whole.

Keras's TensorFlow optimizer has no public hook for either: both use its
private members (``_all_reduce_sum_gradients``, ``_accumulated_gradients``,
``_iterations``, ``_get_variable_index``, ``_clip_gradients``...), reached
through :mod:`mpx_tf._compat` only, which raises
:class:`mpx.FrameworkVersionError` when this Keras lacks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

import mpx
from mpx.dtypes import canonical_dtype
from mpx.errors import MPXError, UnsupportedTypeError
from mpx_keras.accumulation import Window as KerasWindow
from mpx_tf import _compat
from mpx_tf._compat import optimizer_member as _member

__all__ = ["set_reduce_dtype"]

#: The dtypes a tf.distribute all-reduce accepts for gradients.
_REDUCE_DTYPES = ("float16", "bfloat16", "float32", "float64")
_ALL_REDUCE = "_all_reduce_sum_gradients"


def reduce_dtype_of(value: Any) -> str | None:
    """``value`` (a dtype name/alias, an :class:`mpx.Policy`, a policy spec string or None) as a reduce dtype.

    Raises:
        MPXError: for a dtype the tf.distribute all-reduce cannot sum.
    """
    if value is None:
        return None
    if isinstance(value, mpx.Policy):
        dtype = value.reduce_dtype
    elif isinstance(value, str) and ("=" in value or value.startswith("mixed")):
        dtype = mpx.get_policy(value).reduce_dtype
    else:
        dtype = canonical_dtype(value, field="reduce_dtype")
    if dtype not in _REDUCE_DTYPES:
        raise MPXError(
            f"reduce_dtype: tf.distribute cannot all-reduce gradients in {dtype}; "
            f"allowed: {', '.join(_REDUCE_DTYPES)}"
        )
    return dtype


def set_reduce_dtype(optimizer: keras.optimizers.Optimizer, reduce_dtype: Any) -> None:
    """Run ``optimizer``'s cross-replica gradient sum in ``reduce_dtype`` (None: the gradients' own dtype).

    Args:
        optimizer: a Keras optimizer (for an :class:`mpx_tf.LossScaleOptimizer`, its inner one).
        reduce_dtype: a dtype (``"bfloat16"``, ``"float16"``, ``"float32"``), an
            :class:`mpx.Policy` or policy spec (its ``reduce_dtype``), or None to undo.

    Each replica's gradient is cast to ``reduce_dtype``, summed across replicas
    by the strategy's own all-reduce in that dtype, and the sum cast back to
    the gradient's dtype before clipping and ``update_step``.  With one replica
    (no strategy) nothing is reduced and nothing is cast.  Call it before the
    training step is traced.

    Raises:
        MPXError: for a dtype the all-reduce cannot sum.
        UnsupportedTypeError: when ``optimizer`` is not a Keras optimizer.
        FrameworkVersionError: for a Keras without the hook.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UnsupportedTypeError(
            f"optimizer: expected a keras.optimizers.Optimizer, got {type(optimizer).__name__}."
        )
    dtype = reduce_dtype_of(reduce_dtype)
    _compat.check_optimizer(optimizer, [_ALL_REDUCE])
    if _ALL_REDUCE in vars(optimizer):  # undo an earlier call
        del optimizer.__dict__[_ALL_REDUCE]
    if dtype is None:
        return
    native = _member(optimizer, _ALL_REDUCE)

    def all_reduce_sum_in(grads_and_vars: Any) -> list[Any]:
        ctx = tf.distribute.get_replica_context()
        pairs = list(grads_and_vars)
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return native(pairs)
        dtypes = [None if g is None else g.dtype for g, _ in pairs]
        cast = [(None if g is None else tf.cast(g, dtype), v) for g, v in pairs]
        reduced = native(cast)
        return [(None if g is None else tf.cast(g, d), v) for (g, v), d in zip(reduced, dtypes, strict=True)]

    optimizer.__dict__[_ALL_REDUCE] = all_reduce_sum_in  # an instance hook, untracked


class Window(KerasWindow):
    """:class:`mpx_keras.accumulation.Window` with ``tf.IndexedSlices`` gradients and ``tf.distribute``'s
    cross-replica branches (a window of an inner optimizer with ``gradient_accumulation_steps=k``)."""

    def __init__(self, inner: keras.optimizers.Optimizer, owner: str = "mpx_tf.LossScaleOptimizer") -> None:
        _compat.check_optimizer(inner)
        super().__init__(inner, owner)

    def finite(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None) -> Any:
        """A bool tensor on one replica: the window's accumulated gradients plus ``grads`` all finite."""
        if not any(isinstance(g, tf.IndexedSlices) for g in grads):
            return super().finite(grads, self._variables(trainable_variables))
        flags = []
        for g, v in zip(grads, self._variables(trainable_variables), strict=True):
            if g is None:
                continue
            acc = self.accumulator(v)
            total = tf.convert_to_tensor(g.values if isinstance(g, tf.IndexedSlices) else g)
            if not isinstance(g, tf.IndexedSlices):
                total = total + tf.cast(acc.value, total.dtype)
            else:  # the accumulator holds the earlier micro-batches; the slices this one
                flags.append(tf.reduce_all(tf.math.is_finite(acc.value)))
            flags.append(tf.reduce_all(tf.math.is_finite(total)))
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)

    # -- the window under a strategy's merge_call (cross-replica context) ---------------------
    # Keras's own accumulation runs ops.cond(is_update_step, update, accumulate) in replica
    # context, and its update branch holds a merge_call: MirroredStrategy refuses that (natively
    # too).  Here the branch is chosen in cross-replica context, as Keras's LossScaleOptimizer
    # chooses skip or apply, and each branch does what the inner optimizer's would.
    def accumulate(self, distribution: Any, grads: Any, trainable_variables: Any) -> None:
        """A micro-batch that does not end the window: each replica adds its gradients to its accumulators."""
        for g, v in zip(grads, self._variables(trainable_variables), strict=True):
            if g is None:
                continue
            acc = self.accumulator(v)
            distribution.extended.update(
                acc.value, lambda a, g: a.assign_add(tf.cast(g, a.dtype)), args=(g,), group=False
            )
        _member(self.inner, "_iterations").assign_add(1)

    def apply(self, distribution: Any, grads: Any, trainable_variables: Any) -> None:
        """The window's last micro-batch, applied: Keras's update branch of ``_backend_apply_gradients``.

        ``(g + accumulated) / k`` on each replica, the inner optimizer's clipping and
        weight decay, its ``_backend_update_step`` (the cross-replica sum and
        ``update_step``), then accumulators to zero, constraints and ``_iterations + 1``.
        """
        inner = self.inner
        variables = self._variables(trainable_variables)

        def replica_update(grads: Any) -> None:
            pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
            total = [
                (tf.convert_to_tensor(g) + tf.cast(self.accumulator(v).value, g.dtype)) / self.steps
                for g, v in pairs
            ]
            used = [v for _, v in pairs]
            total = _member(inner, "_clip_gradients")(total)
            _member(inner, "_apply_weight_decay")(used)
            _member(inner, "_backend_update_step")(total, used, inner.learning_rate)

        distribution.extended.call_for_each_replica(replica_update, args=(grads,))
        self.reset()
        for v in variables:
            if v.constraint is not None:
                v.assign(v.constraint(v))
        _member(inner, "_iterations").assign_add(1)

    def _variables(self, trainable_variables: Any) -> list[Any]:
        if trainable_variables is not None:
            return list(trainable_variables)
        return list(_member(self.inner, "_trainable_variables"))
