"""Block-scaled GEMMs in JAX: a :class:`mpx.blocks.BlockRecipe` (``fp8=mxfp8``, ``fp4=nvfp4``...) on dots.

The numbers are the core's kernel (:func:`mpx.kernels.blocks.quantize` and ``dequantize`` run with
JAX's table, :data:`mpx_jax._array_ops.JAX_OPS`): the element codes and scales are the numpy
reference's bit for bit, and the same as ``mpx_torch.blocks.BlockLinear``'s on the same inputs.

:func:`block_matmul` is ``x @ kernel`` (``x`` of shape (M, K), ``kernel`` of (K, N), Flax's layout)
with a ``jax.custom_vjp`` that gives each of the three GEMMs its operands' roles and blocks, as
:data:`mpx.kernels.blocks.GEMM_OPERANDS` lists them for torch's weight ``w = kernel.T`` of (N, K):

* forward ``x @ kernel``: ``x`` (role ``input``) and the kernel (``weight``) blocked along K;
* input gradient ``dy @ kernel.T``: ``dy`` (``grad``) and the kernel blocked along N;
* kernel gradient ``x.T @ dy``: ``x`` and ``dy`` blocked along M;

each copy quantized from the high-precision tensor (the residuals are ``x`` and the kernel, not their
quantized forward copies).  The GEMM is emulated: both operands are quantized, dequantized to float32
and multiplied in float32 (``precision=HIGHEST``, float32 accumulation), so only the sums' order can
differ from torch's emulation.  A GEMM with a non-finite operand returns NaN everywhere (quantization
saturates an inf, which would hide an overflow from the loss scaler), as torch's does.  Block recipes
are stateless: nothing is committed after a step, so a step the loss scaler skips changes nothing.

:func:`block_dot_general` runs any ``lax.dot_general`` without batch dimensions (a linear layer, an
einsum such as ``"btd,df->btf"``) as a :func:`block_matmul` on the operands flattened to 2-D (the free
dimensions in order, the contracting dimensions in the left operand's order); :func:`mpx_jax.autocast`
uses it under a policy with a block recipe.

>>> import jax.numpy as jnp
>>> from mpx.blocks import PRESETS
>>> q = quantize(jnp.arange(40.0).reshape(1, 40), PRESETS["mxfp8"], "input")
>>> q.codes.shape, q.scales.tolist()
((1, 40), [[123, 124]])
>>> block_matmul(jnp.ones((2, 32)), jnp.ones((32, 3)), PRESETS["mxfp8"]).tolist()[0]
[32.0, 32.0, 32.0]
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mpx.blocks import BlockRecipe, refuse_randomized_recipe
from mpx.errors import Float8Error
from mpx.kernels import blocks as kernel
from mpx_jax._array_ops import JAX_OPS

__all__ = ["block_dot_general", "block_matmul", "dequantize", "quantize"]

_HIGHEST = lax.Precision.HIGHEST


def _register_pytree() -> None:
    """:class:`mpx.kernels.blocks.BlockQuantized` as a pytree, so ``jax.jit`` can return one (once)."""
    try:
        jax.tree_util.register_dataclass(
            kernel.BlockQuantized, data_fields=["codes", "scales", "tensor_scale"], meta_fields=[]
        )
    except ValueError as exc:  # registered already (a reloaded module)
        if "Duplicate" not in str(exc):
            raise


_register_pytree()


def quantize(x: Any, recipe: BlockRecipe, role: str, axis: int = 1) -> kernel.BlockQuantized:
    """A 2-D array quantized by the core's kernel with JAX's table (int32 codes, per-block scales).

    Args:
        x: a 2-D float array (upcast to float32).
        recipe: the :class:`mpx.blocks.BlockRecipe`.
        role: ``"input"``, ``"weight"`` or ``"grad"``.
        axis: the GEMM's reduction axis of ``x`` (0 or 1; default 1).

    Raises:
        mpx.Float8Error: for a recipe with stochastic rounding or the Hadamard transform (torch only, for now).
    """
    refuse_randomized_recipe(recipe, "mpx_jax")
    return kernel.quantize(JAX_OPS, jnp.asarray(x), recipe, role, axis)


def dequantize(q: kernel.BlockQuantized, recipe: BlockRecipe, role: str, axis: int = 1) -> jax.Array:
    """The float32 array a :func:`quantize` result stands for (:func:`mpx.kernels.blocks.dequantize`)."""
    return kernel.dequantize(JAX_OPS, q, recipe, role, axis)


def _qdq(x: Any, recipe: BlockRecipe, role: str, axis: int) -> jax.Array:
    return dequantize(quantize(lax.stop_gradient(x), recipe, role, axis), recipe, role, axis)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _poison(y: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``y``, or NaN everywhere when ``a`` or ``b`` holds inf or NaN (no host sync)."""
    finite = jnp.logical_and(jnp.isfinite(a).all(), jnp.isfinite(b).all())
    return jnp.where(finite, y, jnp.float32(math.nan))


def _check(recipe: Any) -> None:
    if not isinstance(recipe, BlockRecipe):
        raise Float8Error(
            f"recipe: expected an mpx.blocks.BlockRecipe (e.g. mpx.blocks.PRESETS['mxfp8']), got "
            f"{type(recipe).__name__}."
        )
    refuse_randomized_recipe(recipe, "mpx_jax")


def block_matmul(x: Any, kernel_: Any, recipe: BlockRecipe, out_dtype: Any = None) -> jax.Array:
    """``x @ kernel`` (2-D, ``(M, K) @ (K, N)``) with every GEMM's operands block-quantized (module docs).

    Args:
        x: the input, shape (M, K), any float dtype.
        kernel_: the kernel, shape (K, N) (``w.T`` for torch's weight ``w``).
        recipe: the :class:`mpx.blocks.BlockRecipe`.
        out_dtype: the result's dtype (default None: ``x``'s); the GEMM itself is float32.

    Raises:
        mpx.Float8Error: for a recipe that is not a block recipe or operands that are not 2-D.
    """
    _check(recipe)
    x, kernel_ = jnp.asarray(x), jnp.asarray(kernel_)
    if x.ndim != 2 or kernel_.ndim != 2 or x.shape[1] != kernel_.shape[0]:
        raise Float8Error(
            f"operands: block_matmul multiplies (M, K) by (K, N); got shapes {x.shape} and {kernel_.shape}."
        )
    dtype = jnp.dtype(out_dtype) if out_dtype is not None else x.dtype
    return _block_mm(recipe, dtype, x, kernel_)


def _forward(recipe: BlockRecipe, dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    y = _dot(_qdq(x, recipe, "input", 1), _qdq(w, recipe, "weight", 0), (1, 0))
    return _poison(y, x, w).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _block_mm(recipe: BlockRecipe, dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    return _forward(recipe, dtype, x, w)


def _fwd(recipe: BlockRecipe, dtype: Any, x: jax.Array, w: jax.Array) -> tuple[jax.Array, Any]:
    return _forward(recipe, dtype, x, w), (x, w)


def _bwd(recipe: BlockRecipe, dtype: Any, res: Any, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    dy = dy.astype(jnp.float32)
    # input gradient dy (M, N) @ w.T: dy and the kernel blocked along N
    dx = _poison(_dot(_qdq(dy, recipe, "grad", 1), _qdq(w, recipe, "weight", 1), (1, 1)), dy, w)
    # kernel gradient x.T @ dy: both blocked along M
    dw = _poison(_dot(_qdq(x, recipe, "input", 0), _qdq(dy, recipe, "grad", 0), (0, 0)), dy, x)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_block_mm.defvjp(_fwd, _bwd)


def block_dot_general(
    lhs: Any, rhs: Any, dimension_numbers: Any, recipe: BlockRecipe, *, out_dtype: Any = None
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` as a block-scaled GEMM (:func:`block_matmul`).

    The operands are flattened to ``(M, K)`` and ``(K, N)`` (free dimensions in order, the contracting
    ones in ``lhs``'s order), multiplied and the result reshaped to ``dot_general``'s layout.
    ``out_dtype``: the result's dtype (default: ``lhs``'s).

    Raises:
        mpx.Float8Error: for dimension numbers with batch dimensions (a ``bmm``, which block recipes,
            like FP8, leave to the compute dtype).
    """
    _check(recipe)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    (lc, rc), (lb, rb) = jax.tree_util.tree_map(int, dimension_numbers)
    if tuple(lb) or tuple(rb):
        raise Float8Error(
            "dimension_numbers: a block-scaled GEMM has no batch dimensions (a bmm runs in the compute "
            f"dtype); got lhs batch {tuple(lb)} and rhs batch {tuple(rb)}."
        )
    lc, rc = tuple(lc), tuple(rc)
    lf = tuple(d for d in range(lhs.ndim) if d not in lc)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc)
    k = math.prod(lhs.shape[d] for d in lc)
    x = jnp.transpose(lhs, lf + lc).reshape(-1, k)
    w = jnp.transpose(rhs, rc + rf).reshape(k, -1)
    y = block_matmul(x, w, recipe, out_dtype if out_dtype is not None else lhs.dtype)
    return y.reshape(tuple(lhs.shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf))
