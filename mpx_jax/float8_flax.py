"""FP8 in Flax NNX: :class:`Float8Linear` and the step that commits its FP8 state with the optimizer's.

:class:`Float8Linear` is ``nnx.Linear``'s ``x @ kernel + bias`` with the GEMM in FP8
(:func:`mpx_jax.float8.fp8_linear`, the core's recipe bit for bit).  Its FP8 state
is three NNX variables, none of them a ``Param``:

* ``fp8_scale`` (:class:`Float8Scale`, float32 ``(3,)``: the scales of input,
  weight and gradient, in :data:`mpx.float8.ROLES` order);
* ``fp8_history`` (:class:`Float8Scale`, float32 ``(3, amax_history_len)``, most
  recent first; ``(3, 0)`` under current scaling);
* ``fp8_pending`` (:class:`Float8Scale`, float32 ``(3,)``: the MAX of the amaxes
  seen in an open accumulation window, ``-inf`` when none);

and the sink ``fp8_amax`` (:class:`Float8Amax`, zeros ``(3,)``): differentiate the
loss with respect to ``nnx.Any(nnx.Param, Float8Amax)`` and the sink's gradient is
the step's amaxes.  :func:`float8_step` runs ``optimizer.update`` on the parameter
gradients and then commits the FP8 state exactly when the optimizer state moved:

* a step the loss scaler skips (non-finite gradients) commits no amax and no
  scale: parameters, optimizer state and FP8 state stay bit-identical;
* with ``with_loss_scaling(tx, accumulate=k)``, a window's micro-steps take the
  MAX of their amaxes (``fp8_pending``) and the window's boundary commits it
  (or drops it, when the window is skipped); the scales stay fixed inside a
  window, as the parameters do;
* under ``pmap``/``shard_map`` pass ``axis_name=`` and the amaxes are reduced with
  MAX over the replicas first (:func:`mpx_jax.float8.reduce_amaxes`).

The update is the core's :func:`mpx.kernels.float8.update_tensor` and the window's
MAX :func:`mpx.kernels.float8.window_max`, with JAX's table (selects only): one
compiled step serves applied, skipped and accumulating steps.

>>> import jax.numpy as jnp, optax, mpx, mpx_jax
>>> from flax import nnx
>>> model = Float8Linear(4, 2, recipe=mpx.Float8Recipe(amax_history_len=8), rngs=nnx.Rngs(0))
>>> opt = nnx.Optimizer(model, mpx_jax.with_loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
>>> def loss_fn(model, x):
...     return mpx_jax.get_loss_scale(opt).scale(jnp.sum(model(x) ** 2))
>>> grads = nnx.grad(loss_fn, argnums=FLOAT8_GRADS)(model, jnp.ones((3, 4)))
>>> float8_step(opt, model, grads)
>>> model.fp8_history[...][0, :2].tolist()
[1.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mpx import float8 as core
from mpx.blocks import BlockRecipe
from mpx.errors import StateDictError, UnsupportedTypeError
from mpx.float8 import ROLES, Float8Error, Float8Recipe, check_model_state, one_recipe, tensor_key
from mpx.kernels import float8 as kf8
from mpx.policy import Policy
from mpx_jax import float8 as f8
from mpx_jax._array_ops import JAX_OPS
from mpx_jax._dense_params import BIAS_INIT, KERNEL_INIT, nnx_params
from mpx_jax.blocks_flax import block_layers
from mpx_jax.opt_state import get_loss_scale

__all__ = [
    "FLOAT8_GRADS",
    "Float8Amax",
    "Float8Linear",
    "Float8Scale",
    "commit_float8",
    "float8_layers",
    "float8_state_dict",
    "float8_step",
    "load_float8_state_dict",
]


class Float8Scale(nnx.Variable):
    """FP8 scaling state of a :class:`Float8Linear` (scales, amax history, an open window's amaxes).

    Not a ``Param``: the optimizer never sees it; :func:`commit_float8` moves it.
    """


class Float8Amax(nnx.Variable):
    """The amax sink of a :class:`Float8Linear`: zeros whose gradient is the step's amaxes (input, weight, grad)."""


#: What to differentiate with ``nnx.grad(..., argnums=FLOAT8_GRADS)``: the parameters and the amax sinks.
FLOAT8_GRADS = nnx.DiffState(0, nnx.Any(nnx.Param, Float8Amax))


def refuse_block(recipe: Any, where: str) -> None:
    """Raise :class:`Float8Error` for a block recipe given to a per-tensor FP8 layer (``where``)."""
    if isinstance(recipe, BlockRecipe):
        raise Float8Error(
            f"recipe: {where} runs per-tensor FP8 recipes, not the block-scaled "
            f"{recipe.name or 'custom block recipe'}; use mpx_jax.blocks_flax.BlockLinear (NNX) or "
            "BlockDense (linen) for block-scaled layers, or mpx_jax.autocast."
        )


def _recipe(recipe: Float8Recipe | Policy) -> Float8Recipe:
    refuse_block(recipe.fp8 if isinstance(recipe, Policy) else recipe, "Float8Linear")
    if isinstance(recipe, Policy):
        if recipe.fp8 is None:
            raise Float8Error(
                "recipe: this policy has no fp8 recipe; give it one (e.g. 'mixed_bfloat16,fp8=hybrid') "
                "or use nnx.Linear for a layer without FP8."
            )
        return recipe.fp8
    if not isinstance(recipe, Float8Recipe):
        raise Float8Error(
            f"recipe: expected an mpx.Float8Recipe or an mpx.Policy with fp8, got {type(recipe).__name__}."
        )
    return recipe


class Float8Linear(nnx.Module):
    """``x @ kernel + bias`` with the GEMM in FP8 (inputs and weights e4m3, gradients e5m2 under ``hybrid``).

    Args:
        in_features, out_features: the kernel is ``(in_features, out_features)``.
        recipe: an :class:`mpx.Float8Recipe`, or an :class:`mpx.Policy` whose ``fp8`` is one.
        use_bias: add a bias (default True).
        dtype: the output dtype (default None: the input's dtype; the GEMM's result is float32).
        param_dtype: the parameters' dtype (default float32).
        kernel_init, bias_init: as ``nnx.Linear`` (defaults: lecun normal, zeros).
        rngs: ``nnx.Rngs`` for the kernel.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: Float8Recipe | Policy,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = KERNEL_INIT,
        bias_init: Any = BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        self.recipe = _recipe(recipe)
        self.dtype = dtype
        self.kernel, self.bias = nnx_params(
            in_features, out_features, use_bias=use_bias, param_dtype=param_dtype,
            kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
        )  # fmt: skip
        length = self.recipe.amax_history_len if self.recipe.scaling == "delayed" else 0
        n = len(ROLES)
        self.fp8_scale = Float8Scale(jnp.ones((n,), jnp.float32))
        self.fp8_history = Float8Scale(jnp.zeros((n, length), jnp.float32))
        self.fp8_pending = Float8Scale(jnp.full((n,), -jnp.inf, jnp.float32))
        self.fp8_amax = Float8Amax(jnp.zeros((n,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        scale, sink = self.fp8_scale[...], self.fp8_amax[...]
        y = f8.fp8_linear(
            x,
            self.kernel[...],
            {role: scale[i] for i, role in enumerate(ROLES)},
            {role: sink[i] for i, role in enumerate(ROLES)},
            self.recipe,
        )
        dtype = self.dtype if self.dtype is not None else x.dtype
        y = y.astype(dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y


def _block_recipe_of(model: nnx.Module) -> BlockRecipe | None:
    """The one block recipe of ``model``'s BlockLinear layers (None without any)."""
    recipes = [m.recipe for _, m in block_layers(model)]
    return one_recipe(recipes, "BlockLinear layers") if recipes else None  # type: ignore[return-value]


def float8_layers(model: nnx.Module) -> Iterator[tuple[str, Float8Linear]]:
    """Every :class:`Float8Linear` in ``model`` with its dotted path (``"<path>"``, as state dicts name it)."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Float8Linear):
            yield ".".join(str(p) for p in path), module


def _module_amaxes(grads: Any, path: tuple[Any, ...]) -> jax.Array:
    node = grads
    for key in path:
        node = node[key]
    return jnp.asarray(node["fp8_amax"][...], jnp.float32)


def commit_float8(
    model: nnx.Module,
    amax_grads: Any,
    *,
    boundary: Any = True,
    applied: Any = True,
    axis_name: Any = None,
) -> None:
    """Record one micro-step's amaxes in every :class:`Float8Linear` of ``model`` (in place, selects only).

    Args:
        model: the model (its ``Float8Scale`` variables are set).
        amax_grads: the ``nnx.State`` of the sinks' gradients (or the whole gradient state).
        boundary: this micro-step ends an optimizer step (True without accumulation).
        applied: the optimizer step was applied (False: the loss scaler skipped it, nothing commits).
        axis_name: a mapped axis to MAX the amaxes over first (replicas), or None.
    """
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Float8Linear):
            continue
        amaxes = _module_amaxes(amax_grads, path)
        if axis_name is not None:
            amaxes = f8.reduce_amaxes(amaxes, axis_name)
        window = f8.window_max(module.fp8_pending[...], amaxes)
        scale, hist = module.fp8_scale[...], module.fp8_history[...]
        new_scale, new_hist = [], []
        skipped = jnp.logical_not(jnp.logical_and(boundary, applied))
        for i, role in enumerate(ROLES):
            s, h = kf8.update_tensor(JAX_OPS, module.recipe, role, scale[i], hist[i], window[i], skipped)
            new_scale.append(s)
            new_hist.append(h)
        module.fp8_scale[...] = jnp.stack(new_scale)
        module.fp8_history[...] = jnp.stack(new_hist).reshape(hist.shape)
        module.fp8_pending[...] = jnp.where(boundary, jnp.float32(-jnp.inf), window)


def float8_step(optimizer: nnx.Optimizer, model: nnx.Module, grads: Any, /, **kwargs: Any) -> None:
    """``optimizer.update(model, param_grads)``, then :func:`commit_float8` with the step's outcome.

    ``grads``: ``nnx.grad(loss_fn, argnums=FLOAT8_GRADS)(model, ...)`` of the *scaled* loss (parameters
    and amax sinks).  The optimizer is built over ``mpx_jax.with_loss_scaling(tx)`` with
    ``wrt=nnx.Param``; the FP8 state commits only when that update was applied (at a window's boundary
    with ``accumulate=k``).  ``kwargs`` go to ``optimizer.update`` (``value=``, ``loss=``...), except
    ``axis_name`` (replicas' MAX of the amaxes, :func:`commit_float8`).
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise UnsupportedTypeError(
            f"optimizer: float8_step(optimizer, model, grads) takes an nnx.Optimizer first, got "
            f"{type(optimizer).__name__}."
        )
    if not isinstance(model, nnx.Module):
        raise UnsupportedTypeError(f"model: expected an nnx.Module, got {type(model).__name__}.")
    axis_name = kwargs.pop("axis_name", None)
    param_grads, amax_grads = nnx.split_state(grads, nnx.Param, Float8Amax)
    before = get_loss_scale(optimizer)
    optimizer.update(model, param_grads, **kwargs)
    after = get_loss_scale(optimizer)
    boundary = after.steps != before.steps
    applied = jnp.logical_and(boundary, after.skipped_steps == before.skipped_steps)
    commit_float8(model, amax_grads, boundary=boundary, applied=applied, axis_name=axis_name)


def float8_state_dict(model: nnx.Module) -> dict[str, Any]:
    """The model's FP8 state as one ``mpx.float8/1`` dict: tensors ``"<path>.input"``, ``.weight``, ``.grad``.

    Every :class:`Float8Linear` must share one recipe (the dict has one).  A model whose layers are
    block-scaled (:class:`mpx_jax.blocks_flax.BlockLinear`, one recipe) gets the stateless dict of its
    block recipe (no tensors), the dict ``mpx_torch`` and ``mpx_keras`` write for theirs.
    """
    layers = list(float8_layers(model))
    block = _block_recipe_of(model)
    if block is not None and not layers:
        return core.state_dict(block, core.Float8State({}))
    if not layers:
        raise Float8Error("model: it has no mpx_jax.float8_flax.Float8Linear, so it has no FP8 state.")
    recipe = one_recipe((m.recipe for _, m in layers), "Float8Linear layers")
    tensors = {}
    for path, m in layers:
        scale, hist = m.fp8_scale[...], m.fp8_history[...]
        for i, role in enumerate(ROLES):
            tensors[tensor_key(path, role)] = core.TensorScale(role, scale[i], hist[i])
    return core.state_dict(recipe, core.Float8State(tensors))


def load_float8_state_dict(model: nnx.Module, state_dict: Any) -> None:
    """Load an ``mpx.float8/1`` dict (from any backend) into ``model``'s FP8 state, all or nothing.

    The dict must name exactly the model's tensors with their roles and carry the model's recipe.

    Raises:
        mpx.StateDictError: naming the field that does not fit.
    """
    recipe, state = core.load_state_dict(state_dict)
    layers = list(float8_layers(model))
    block = _block_recipe_of(model)
    if isinstance(recipe, BlockRecipe) or (block is not None and not layers):
        if recipe != block:
            raise StateDictError(
                f"recipe: the state dict's recipe ({getattr(recipe, 'name', None) or recipe}) differs from "
                f"the model's block recipe ({block.name if block is not None else 'none'})."
            )
        return
    own = one_recipe((m.recipe for _, m in layers), "Float8Linear layers") if layers else None
    check_model_state(recipe, state, own, [path for path, _ in layers])
    for path, m in layers:
        m.fp8_scale[...] = jnp.asarray([state.tensors[tensor_key(path, r)].scale for r in ROLES], jnp.float32)
        hist = [state.tensors[tensor_key(path, r)].amax_history for r in ROLES]
        m.fp8_history[...] = jnp.asarray(hist, jnp.float32).reshape(m.fp8_history[...].shape)
        m.fp8_pending[...] = jnp.full((len(ROLES),), -jnp.inf, jnp.float32)
