"""Block-scaled Flax layers: :class:`BlockLinear` (NNX) and :class:`BlockDense` (linen).

Each is ``x @ kernel + bias`` whose GEMMs run :func:`mpx_jax.blocks.block_matmul` under a
:class:`mpx.blocks.BlockRecipe` (``mxfp8``, ``mxfp4``, ``nvfp4``, ``fp8_blockwise``, ``fp8_rowwise`` or a
custom one): the input flattened to ``(M, K)``, the bias added in float32, the result cast to ``dtype``
(the input's by default), the numbers of ``mpx_torch.blocks.BlockLinear`` (the kernel is torch's weight
transposed).  Block recipes are stateless: the layers hold only their parameters, a plain optimizer step
(``nnx.Optimizer(model, mpx_jax.with_loss_scaling(tx), wrt=nnx.Param)``) is the whole step, and a step the
loss scaler skips leaves every parameter bit-identical.  Their ``mpx.float8/1`` dict
(:func:`mpx_jax.float8_flax.float8_state_dict`) holds the recipe and no tensors.

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
from mpx_jax.blocks import block_matmul

__all__ = ["BlockDense", "BlockLinear", "block_layers", "block_recipe"]


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


def _apply(x: Any, kernel: Any, bias: Any, recipe: BlockRecipe, dtype: Any) -> jax.Array:
    x = jnp.asarray(x)
    out = jnp.dtype(dtype) if dtype is not None else x.dtype
    y = block_matmul(x.reshape(-1, x.shape[-1]), kernel, recipe, jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out).reshape(*x.shape[:-1], kernel.shape[-1])


_KERNEL_INIT = nnx.initializers.lecun_normal()
_BIAS_INIT = nnx.initializers.zeros_init()


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
        kernel_init: Any = _KERNEL_INIT,
        bias_init: Any = _BIAS_INIT,
        rngs: nnx.Rngs,
    ) -> None:
        self.recipe = block_recipe(recipe)
        self.dtype = dtype
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        return _apply(x, self.kernel[...], bias, self.recipe, self.dtype)


class BlockDense(nn.Module):
    """linen's ``x @ kernel + bias`` with block-scaled GEMMs (parameters ``kernel`` and ``bias``, no state).

    Attributes:
        features: output features.
        recipe: the :class:`mpx.blocks.BlockRecipe` (or a policy, or a spec, whose ``fp8`` is one).
        use_bias: add a bias (default True).
        dtype: the output dtype (default None: the input's).
        param_dtype: the parameters' dtype (default float32).
    """

    features: int
    recipe: Any
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        recipe = block_recipe(self.recipe)
        x = jnp.asarray(x)
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        return _apply(x, kernel, bias, recipe, self.dtype)


def block_layers(model: nnx.Module) -> Iterator[tuple[str, BlockLinear]]:
    """Every :class:`BlockLinear` in ``model`` with its dotted path."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, BlockLinear):
            yield ".".join(str(p) for p in path), module
