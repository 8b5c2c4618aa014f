"""Gradient accumulation under :class:`mpx_keras.LossScaleOptimizer`: one decision per window.

The inner optimizer's ``gradient_accumulation_steps=k`` makes a window of k
micro-batches.  :class:`Window` is how the LossScaleOptimizer follows the core's
one semantics (:mod:`mpx.accumulation`) on every Keras backend:

- the scale is constant inside a window (the scaler moves at its last micro-batch);
- the earlier micro-batches go to the inner optimizer, which adds their unscaled
  gradients to its accumulators (Keras's own accumulation, untouched);
- at the last micro-batch the window's finiteness is tested once, on the
  accumulated gradients plus the last micro-batch's (:meth:`Window.finite`);
- a non-finite window is skipped whole (:meth:`Window.skip`): accumulators back
  to zero, the inner ``_iterations`` back to the window's start, so the model's
  and the inner optimizer's variables end bit-identical to before the window;
- the scaler makes one transition per window.

The same methods run eagerly (torch, custom loops), inside ``tf.function`` and
inside the jax trainer's pure ``stateless_apply`` (a ``keras.StatelessScope``:
reads and assigns go to the scope).  Keras's optimizer has no public hook for the
accumulators, so they are reached through :mod:`mpx_keras._compat` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

import mpx
from mpx.errors import MPXError
from mpx_keras import _compat
from mpx_keras._compat import optimizer_member as _member

__all__ = ["Window"]

ops = keras.ops

#: The inner optimizer's private methods the window calls (checked when it is made).
METHODS = ("_get_variable_index", "_overwrite_variable_with_gradient")


class Window:
    """The accumulation window of an inner optimizer with ``gradient_accumulation_steps=k`` (k >= 2).

    Raises:
        MPXError: for an inner ``use_ema`` (the window cannot honour it).
        FrameworkVersionError: when this Keras lacks an optimizer internal the window uses.
    """

    def __init__(
        self, inner: keras.optimizers.Optimizer, owner: str = "mpx_keras.LossScaleOptimizer"
    ) -> None:
        _compat.check_optimizer(inner, METHODS)
        self.inner = inner
        self.steps = mpx.check_accumulation_steps(
            inner.gradient_accumulation_steps, "gradient_accumulation_steps"
        )
        if inner.use_ema:  # (Keras's LossScaleOptimizer sets the inner loss_scale_factor to None)
            raise MPXError(
                f"use_ema: {owner}'s accumulation window does not support `use_ema` on an inner "
                "optimizer with gradient_accumulation_steps; leave `use_ema` at False."
            )

    def iterations(self) -> Any:
        """The inner optimizer's micro-batch counter (a variable)."""
        return _member(self.inner, "_iterations")

    def is_last(self) -> Any:
        """A bool tensor: the coming micro-batch ends the window (read from the inner ``_iterations``)."""
        return ops.equal(ops.mod(self.iterations().value + 1, self.steps), 0)

    def accumulator(self, variable: Any) -> Any:
        """The inner optimizer's accumulator of ``variable``'s gradients."""
        index = _member(self.inner, "_get_variable_index")(variable)
        return _member(self.inner, "_accumulated_gradients")[index]

    def finite(self, grads: Sequence[Any], trainable_variables: Sequence[Any]) -> Any:
        """A bool tensor: the window's accumulated gradients plus ``grads`` all finite.

        An overwrite-with-gradient variable (FP8 scales) accumulates a maximum, not a sum:
        its accumulator and gradient are tested each.
        """
        overwritten = _member(self.inner, "_overwrite_variable_with_gradient")
        flags = []
        for g, v in zip(grads, trainable_variables, strict=True):
            if g is None:
                continue
            acc = self.accumulator(v).value
            if overwritten(v):
                flags += [ops.all(ops.isfinite(acc)), ops.all(ops.isfinite(g))]
            else:
                flags.append(ops.all(ops.isfinite(ops.add(ops.cast(g, acc.dtype), acc))))
        return ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)

    def skip(self) -> None:
        """Discard the window: accumulators to zero, the inner ``_iterations`` back to the window's start.

        The window's earlier micro-batches advanced ``_iterations`` by k - 1 and changed
        nothing else, so afterwards every inner variable is bit-identical to before the
        window, and ``iterations`` (``_iterations // k``) counts applied optimizer steps.
        """
        self.reset()
        counter = self.iterations()
        counter.assign(counter.value - (self.steps - 1))

    def reset(self) -> None:
        """Every accumulator to zero."""
        for acc in _member(self.inner, "_accumulated_gradients"):
            if acc is not None:
                acc.assign(ops.zeros(acc.shape, acc.dtype))
