"""Block-scaled Flax layers: :class:`BlockLinear` (NNX) and :class:`BlockDense` (linen).

Each is ``x @ kernel + bias`` whose GEMMs run :func:`mpx_jax.blocks.block_matmul` under a
:class:`mpx.blocks.BlockRecipe` (``mxfp8``, ``mxfp4``, ``nvfp4``, ``fp8_blockwise``, ``fp8_rowwise`` or a
custom one): the input flattened to ``(M, K)``, the bias added in float32, the result cast to ``dtype``
(the input's by default), the numbers of ``mpx_torch.blocks.BlockLinear`` (the kernel is torch's weight
transposed).  Block recipes are stateless: the layers hold only their parameters, a plain optimizer step
(``nnx.Optimizer(model, mpx_jax.with_loss_scaling(tx), wrt=nnx.Param)``) is the whole step, and a step the
loss scaler skips leaves every parameter bit-identical.  Their ``mpx.float8/1`` dict
(:func:`mpx_jax.float8_flax.float8_state_dict`) holds the recipe and no tensors.

**Seeded recipes** (``fp4=nvfp4_te``, any ``rounding="stochastic"`` or ``hadamard=True`` recipe) key their
gradients' random bits by ``(seed, step, index)`` as ``mpx_torch.blocks.BlockLinear`` does (its
``block_seed``, ``block_step``, ``block_index``; :mod:`mpx_jax.blocks`), the step a traced counter:

* NNX :class:`BlockLinear` holds ``block_step``, a :class:`BlockStep` variable (an int32 scalar, not an
  ``nnx.Param``: ``nnx.Optimizer(..., wrt=nnx.Param)`` leaves it alone), read by each call and advanced by
  one in training mode; ``model.eval()`` (``deterministic=True``) stops it, ``model.train()`` resumes.  It
  advances on a step the loss scaler skips too, as torch's does: it is a counter, not training state.
  ``block_seed`` and ``block_index`` are the ``seed`` and ``index`` arguments (static);
  :func:`number_block_layers` numbers a model's layers in path order, as torch's ``convert`` does.  Layers
  made under ``nnx.vmap`` (a stack scanned over) share one index.
* linen :class:`BlockDense` keeps the step in the ``"mpx_blocks"`` collection (``block_step``), made by
  ``init`` at 0 and advanced by each ``apply(..., mutable=["mpx_blocks"])`` (the pattern of
  ``batch_stats``); an ``apply`` that does not make it mutable (evaluation) reads it unchanged.

Round-to-nearest recipes hold no step (``block_step`` is None; no ``"mpx_blocks"`` collection).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> layer = BlockLinear(32, 4, recipe="mixed_bfloat16,fp8=mxfp8", rngs=nnx.Rngs(0))
>>> layer(jnp.ones((2, 32))).shape, layer.recipe.name
((2, 4), 'mxfp8')
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import mpx
from mpx.blocks import BlockRecipe
from mpx.errors import Float8Error
from mpx.policy import Policy
from mpx_jax._dense_params import BIAS_INIT, KERNEL_INIT, linen_params, nnx_params
from mpx_jax.blocks import block_matmul, is_seeded

__all__ = ["STEP_COLLECTION", "BlockDense", "BlockLinear", "BlockStep", "block_layers", "block_recipe",
           "number_block_layers"]  # fmt: skip

#: the linen collection of :class:`BlockDense`'s step counter
STEP_COLLECTION = "mpx_blocks"


def block_recipe(recipe: BlockRecipe | Policy | str) -> BlockRecipe:
    """The :class:`mpx.blocks.BlockRecipe` a layer runs: the recipe itself, or a policy's (or spec's) ``fp8``.

    Raises:
        mpx.Float8Error: when it names no block recipe (none, or a per-tensor FP8 recipe).
    """
    value = mpx.get_policy(recipe).fp8 if isinstance(recipe, (Policy, str)) else recipe
    if not isinstance(value, BlockRecipe):
        raise Float8Error(
            f"recipe: expected an mpx.blocks.BlockRecipe or a policy with one (e.g. "
            f"'mixed_bfloat16,fp8=mxfp8' or 'mixed_bfloat16,fp4=nvfp4'), got {type(value).__name__}; "
            "per-tensor FP8 recipes run in mpx_jax.float8_flax.Float8Linear / float8_linen.Float8Dense."
        )
    return value


def _apply(x: Any, kernel: Any, bias: Any, recipe: BlockRecipe, dtype: Any, **rng: Any) -> jax.Array:
    x = jnp.asarray(x)
    out = jnp.dtype(dtype) if dtype is not None else x.dtype
    y = block_matmul(x.reshape(-1, x.shape[-1]), kernel, recipe, jnp.float32, **rng)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out).reshape(*x.shape[:-1], kernel.shape[-1])


def _keys(seed: Any, index: Any) -> None:
    for name, value in (("seed", seed), ("index", index)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise Float8Error(f"{name}: {value!r} is not allowed; allowed: a Python int >= 0")


class BlockStep(nnx.Variable):
    """The step counter of a seeded :class:`BlockLinear` (an int32 scalar; not a parameter)."""


class BlockLinear(nnx.Module):
    """``x @ kernel + bias`` with block-scaled GEMMs (emulated; see the module docs).

    Args:
        in_features, out_features: the kernel is ``(in_features, out_features)``.
        recipe: an :class:`mpx.blocks.BlockRecipe`, or a policy (object or spec) whose ``fp8`` is one.
        use_bias: add a bias (default True).
        dtype: the output dtype (default None: the input's).
        param_dtype: the parameters' dtype (default float32).
        kernel_init, bias_init: as ``nnx.Linear`` (defaults: lecun normal, zeros).
        rngs: ``nnx.Rngs`` for the kernel.
        seed: a seeded recipe's seed (``block_seed``; default 0).
        index: the layer's tensor index (``block_index``; default 0): its gradients' keys are
            ``2 * index`` and ``2 * index + 1``.
        deterministic: True stops ``block_step`` (evaluation; default False: each call advances it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: BlockRecipe | Policy | str,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = KERNEL_INIT,
        bias_init: Any = BIAS_INIT,
        rngs: nnx.Rngs,
        seed: int = 0,
        index: int = 0,
        deterministic: bool = False,
    ) -> None:
        self.recipe = block_recipe(recipe)
        _keys(seed, index)
        self.dtype = dtype
        self.block_seed, self.block_index, self.deterministic = seed, index, deterministic
        self.block_step = BlockStep(jnp.zeros((), jnp.int32)) if is_seeded(self.recipe) else None
        self.kernel, self.bias = nnx_params(
            in_features, out_features, use_bias=use_bias, param_dtype=param_dtype,
            kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
        )  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        rng: dict[str, Any] = {}
        if self.block_step is not None:
            step = self.block_step[...]
            rng = {"seed": self.block_seed, "step": step, "index": self.block_index}
            if not self.deterministic:
                self.block_step[...] = step + 1
        return _apply(x, self.kernel[...], bias, self.recipe, self.dtype, **rng)


class BlockDense(nn.Module):
    """linen's ``x @ kernel + bias`` with block-scaled GEMMs (parameters ``kernel`` and ``bias``, no state).

    Attributes:
        features: output features.
        recipe: the :class:`mpx.blocks.BlockRecipe` (or a policy, or a spec, whose ``fp8`` is one).
        use_bias: add a bias (default True).
        dtype: the output dtype (default None: the input's).
        param_dtype: the parameters' dtype (default float32).
        seed: a seeded recipe's seed (default 0).
        index: the layer's tensor index (default 0; its gradients' keys ``2 * index``, ``2 * index + 1``).
    """

    features: int
    recipe: Any
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    seed: int = 0
    index: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        recipe = block_recipe(self.recipe)
        x = jnp.asarray(x)
        kernel, bias = linen_params(
            self, x.shape[-1], self.features, use_bias=self.use_bias, param_dtype=self.param_dtype
        )
        rng: dict[str, Any] = {}
        if is_seeded(recipe):
            _keys(self.seed, self.index)
            counter = self.variable(STEP_COLLECTION, "block_step", lambda: jnp.zeros((), jnp.int32))
            rng = {"seed": self.seed, "step": counter.value, "index": self.index}
            if self.is_mutable_collection(STEP_COLLECTION) and not self.is_initializing():
                counter.value = counter.value + 1
        return _apply(x, kernel, bias, recipe, self.dtype, **rng)


def block_layers(model: nnx.Module) -> Iterator[tuple[str, BlockLinear]]:
    """Every :class:`BlockLinear` in ``model`` with its dotted path."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, BlockLinear):
            yield ".".join(str(p) for p in path), module


def number_block_layers(model: nnx.Module, *, seed: int = 0) -> nnx.Module:
    """Give ``model``'s :class:`BlockLinear` layers ``block_seed = seed`` and ``block_index`` 0, 1... in
    :func:`block_layers` order (what ``mpx_torch.blocks.convert`` does for torch's); ``model``, in place."""
    _keys(seed, 0)
    for index, (_, layer) in enumerate(block_layers(model)):
        layer.block_seed, layer.block_index = seed, index
    return model
