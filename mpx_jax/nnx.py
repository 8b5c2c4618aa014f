"""Flax NNX training with mpx loss scaling: an ``nnx.Optimizer`` whose ``step`` counts applied steps.

``nnx.Optimizer(model, mpx_jax.with_loss_scaling(tx), wrt=nnx.Param)`` works
as it is: on a skipped step (non-finite gradients) the parameters and the
inner optimizer state stay bit-identical, and an optax schedule inside ``tx``
(``optax.adamw(optax.cosine_decay_schedule(...))``) reads its own count, which
is inner state and so advances on applied steps only.  But ``nnx.Optimizer``
adds 1 to ``optimizer.step`` on every ``update``, skipped ones included, so
anything you drive from ``optimizer.step`` (a schedule you evaluate yourself,
logging, an ``optax.inject_hyperparams`` value, the step number of a
checkpoint) drifts from what was applied.

:class:`Optimizer` is ``nnx.Optimizer`` with one change: ``step`` counts
applied optimizer steps only (with ``accumulate=k``, one per applied window).
It also gives the loss scale to multiply the loss with, ``optimizer.loss_scale``.

>>> import jax.numpy as jnp, optax, mpx_jax
>>> from flax import nnx
>>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
>>> opt = Optimizer(model, mpx_jax.with_loss_scaling(optax.sgd(0.1), "mixed_float16"), wrt=nnx.Param)
>>> def step(model, opt, x):
...     loss_scale = opt.loss_scale
...     grads = nnx.grad(lambda m: loss_scale.scale(jnp.sum(m(x))))(model)
...     opt.update(model, grads)
>>> step(model, opt, jnp.ones((1, 2)))
>>> step(model, opt, jnp.full((1, 2), jnp.inf))  # overflows: skipped
>>> int(opt.step), opt.loss_scale.state.skipped_steps
(1, 1)
"""

from __future__ import annotations

from typing import Any

import optax
from flax import nnx

import mpx
from mpx_jax.flax import step_applied
from mpx_jax.loss_scale import LossScale
from mpx_jax.opt_state import get_loss_scale

__all__ = ["Optimizer"]


class Optimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` over ``mpx_jax.with_loss_scaling(tx)`` whose ``step`` counts applied steps only.

    Arguments and use are ``nnx.Optimizer``'s: ``Optimizer(model, tx, wrt=nnx.Param)``,
    then ``optimizer.update(model, grads)`` with the gradients of the *scaled*
    loss.  ``step`` (uint32, as NNX's) is incremented only when the update
    was applied (not skipped for non-finite gradients; with ``accumulate=k``,
    at the end of an applied window), so it equals the count an optax schedule
    inside ``tx`` sees.  Works eagerly and under ``nnx.jit`` (no host sync).

    Raises:
        mpx.UnsupportedTypeError: when ``tx``'s state holds no mpx loss scale
            (use ``nnx.Optimizer`` for a plain optax optimizer).
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, wrt: Any) -> None:
        super().__init__(model, tx, wrt=wrt)
        try:
            get_loss_scale(self)
        except mpx.UnsupportedTypeError:
            raise mpx.UnsupportedTypeError(
                "tx: mpx_jax.nnx.Optimizer counts the steps mpx's loss scaling applies, but this optimizer's "
                "state holds no loss scale; build it with mpx_jax.with_loss_scaling(tx), or use "
                "nnx.Optimizer for a plain optax optimizer."
            ) from None

    @property
    def loss_scale(self) -> LossScale:
        """The current :class:`mpx_jax.LossScale` (plain arrays): multiply the loss with ``.scale(loss)``."""
        return get_loss_scale(self)

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
        """``nnx.Optimizer.update`` (``grads``: gradients of the scaled loss); ``step`` moves only when the
        update was applied.  ``kwargs`` go to the transformation (``value=``, ``loss=``...).

        Returns the updates, as ``nnx.Optimizer.update`` does (``-0.0`` everywhere on a skipped step).
        """
        before = get_loss_scale(self)
        step = self.step[...]
        updates = super().update(model, grads, **kwargs)
        self.step[...] = step + step_applied(before, get_loss_scale(self)).astype(step.dtype)
        return updates
