"""FP8 in Flax linen: :class:`Float8Dense` and the functional commit of its ``fp8`` collection.

:class:`Float8Dense` is ``nn.Dense`` with the GEMM in FP8
(:func:`mpx_jax.float8.fp8_linear`).  Its state lives in two collections besides
``params``:

* ``"fp8"``: per layer ``scale`` (float32 ``(3,)``: input, weight, gradient, in
  :data:`mpx.float8.ROLES` order), ``history`` (``(3, amax_history_len)``, most
  recent first) and ``pending`` (``(3,)``, an open accumulation window's MAX,
  ``-inf`` when none);
* ``"fp8_amax"``: per layer ``amax``, zeros whose gradient is the step's amaxes.

A train step differentiates with respect to ``{"params": ..., "fp8_amax": ...}``,
passes ``grads["params"]`` to the optimizer (``mpx_jax.with_loss_scaling(tx)``) and
then :func:`commit_float8` with :func:`step_outcome` of the optimizer states before
and after: the ``fp8`` collection moves exactly when the optimizer state does
(nothing on a skipped step; the window's MAX at an applied window's boundary).

>>> import jax, jax.numpy as jnp, optax, mpx, mpx_jax
>>> layer = Float8Dense(2, recipe=mpx.Float8Recipe(amax_history_len=4))
>>> v = layer.init(jax.random.key(0), jnp.ones((1, 3)))
>>> sorted(v), v["fp8"]["history"].shape
(['fp8', 'fp8_amax', 'params'], (3, 4))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mpx.float8 import ROLES, Float8Recipe
from mpx.kernels import float8 as kf8
from mpx_jax import float8 as f8
from mpx_jax._array_ops import JAX_OPS
from mpx_jax._dense_params import linen_params
from mpx_jax.float8_flax import refuse_block
from mpx_jax.opt_state import get_loss_scale

__all__ = ["Float8Dense", "commit_float8", "step_outcome"]


class Float8Dense(nn.Module):
    """``x @ kernel + bias`` with the GEMM in FP8 (state in the ``fp8`` and ``fp8_amax`` collections).

    Attributes:
        features: output features.
        recipe: the :class:`mpx.Float8Recipe`.
        use_bias: add a bias (default True).
        dtype: the output dtype (default None: the input's).
        param_dtype: the parameters' dtype (default float32).
    """

    features: int
    recipe: Float8Recipe
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        refuse_block(self.recipe, "Float8Dense")
        x = jnp.asarray(x)
        kernel, bias = linen_params(
            self, x.shape[-1], self.features, use_bias=self.use_bias, param_dtype=self.param_dtype
        )
        n = len(ROLES)
        length = self.recipe.amax_history_len if self.recipe.scaling == "delayed" else 0
        scale = self.variable("fp8", "scale", lambda: jnp.ones((n,), jnp.float32))
        self.variable("fp8", "history", lambda: jnp.zeros((n, length), jnp.float32))
        self.variable("fp8", "pending", lambda: jnp.full((n,), -jnp.inf, jnp.float32))
        sink = self.variable("fp8_amax", "amax", lambda: jnp.zeros((n,), jnp.float32))
        s, a = scale.value, sink.value
        y = f8.fp8_linear(
            x,
            kernel,
            {r: s[i] for i, r in enumerate(ROLES)},
            {r: a[i] for i, r in enumerate(ROLES)},
            self.recipe,
        )
        dtype = self.dtype if self.dtype is not None else x.dtype
        y = y.astype(dtype)
        if bias is not None:
            y = y + bias.astype(dtype)
        return y


def step_outcome(before: Any, after: Any) -> tuple[jax.Array, jax.Array]:
    """``(boundary, applied)`` of one ``with_loss_scaling`` update, from its optimizer states before and after.

    ``boundary``: the update ended an optimizer step (always, without accumulation); ``applied``: that
    step was applied (the loss scaler did not skip it).  Boolean scalars, jit-safe.
    """
    b, a = get_loss_scale(before), get_loss_scale(after)
    boundary = a.steps != b.steps
    return boundary, jnp.logical_and(boundary, a.skipped_steps == b.skipped_steps)


def _is_layer(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node) == {"scale", "history", "pending"}


def commit_float8(
    recipe: Float8Recipe,
    fp8: Any,
    amax_grads: Any,
    *,
    boundary: Any = True,
    applied: Any = True,
    axis_name: Any = None,
) -> Any:
    """The ``fp8`` collection after one micro-step (pure; selects only): the window's MAX
    (:func:`mpx.kernels.float8.window_max`) and each tensor's :func:`mpx.kernels.float8.update_tensor`.

    Args:
        recipe: the layers' :class:`mpx.Float8Recipe`.
        fp8: the ``fp8`` collection (nested dicts, one ``{scale, history, pending}`` per layer).
        amax_grads: the gradient of the ``fp8_amax`` collection (same nesting, ``{"amax": (3,)}``).
        boundary, applied: :func:`step_outcome` (defaults: an applied step without accumulation).
        axis_name: a mapped axis to MAX the amaxes over first (replicas), or None.
    """

    def one(layer: Mapping[str, Any], grads: Mapping[str, Any]) -> dict[str, Any]:
        amaxes = jnp.asarray(grads["amax"], jnp.float32)
        if axis_name is not None:
            amaxes = f8.reduce_amaxes(amaxes, axis_name)
        window = f8.window_max(layer["pending"], amaxes)
        skipped = jnp.logical_not(jnp.logical_and(boundary, applied))
        scales, hists = [], []
        for i, role in enumerate(ROLES):
            s, h = kf8.update_tensor(
                JAX_OPS, recipe, role, layer["scale"][i], layer["history"][i], window[i], skipped
            )
            scales.append(s)
            hists.append(h)
        return {
            "scale": jnp.stack(scales),
            "history": jnp.stack(hists).reshape(layer["history"].shape),
            "pending": jnp.where(boundary, jnp.float32(-jnp.inf), window),
        }

    def walk(node: Any, grads: Any) -> Any:
        if _is_layer(node):
            return one(node, grads)
        return {k: walk(v, grads[k]) for k, v in node.items()}

    return walk(fp8, amax_grads)
