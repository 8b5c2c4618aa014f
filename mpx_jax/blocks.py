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

**Seeded recipes** (``nvfp4_te``, any ``rounding="stochastic"`` or ``hadamard=True`` recipe) take
``seed`` (a Python int), ``step`` (an int32 scalar, traced: pass a ``jax.Array`` so one compile serves
every step) and ``index`` (the GEMM's tensor index, a Python int): the backward pass rounds the input
gradient's copy of ``dy`` with the key ``2 * index``, the kernel gradient's with ``2 * index + 1``, and
transforms the kernel gradient's operands with the signs of ``(seed, step)``: the keys and bits of
``mpx_torch.blocks.BlockLinear`` with ``block_seed``, ``block_step`` and ``block_index``.  The forward
GEMM rounds to nearest, so only the gradients depend on the three.  :class:`BlockRng` is the spec
:func:`mpx_jax.autocast` takes (``rng=``), numbering its block dots from ``index`` in trace order.

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mpx.blocks import BlockRecipe
from mpx.errors import Float8Error
from mpx.kernels import blocks as kernel
from mpx.kernels.hadamard import SIGN_PARAM
from mpx_jax._array_ops import JAX_OPS

__all__ = ["BlockRng", "block_dot_general", "block_matmul", "dequantize", "is_seeded", "quantize"]

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


class BlockRng(NamedTuple):
    """The random keys of a seeded block recipe (:func:`mpx_jax.autocast`'s ``rng=``; module docs).

    Attributes:
        seed: the run's seed (a Python int).
        step: the step counter (an int32 scalar ``jax.Array``, or a Python int >= 0; default 0).
        index: the tensor index of the first block dot (a Python int; default 0); autocast numbers its
            block dots ``index``, ``index + 1``... in the order it traces them.
    """

    seed: int
    step: Any = 0
    index: int = 0


def is_seeded(recipe: Any) -> bool:
    """Whether ``recipe`` is a :class:`mpx.blocks.BlockRecipe` that rounds gradients stochastically or
    applies the Hadamard transform (it then needs a seed and a step)."""
    return isinstance(recipe, BlockRecipe) and (recipe.rounding != "nearest" or recipe.hadamard)


def _check_rng(recipe: BlockRecipe, seed: Any, step: Any, index: Any) -> jax.Array:
    """``step`` as an int32 scalar array, after checking the three keys (Float8Error naming the field)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise Float8Error(
            f"seed: {seed!r} is not allowed; allowed: a Python int (or None for a nearest recipe)"
        )
    if seed is None and is_seeded(recipe):
        raise Float8Error(
            f"seed: the recipe {recipe.name or 'a custom block recipe'} rounds gradients stochastically or "
            "applies the Hadamard transform, so it needs seed= (a Python int) and step= (an int32 scalar); "
            "got seed=None."
        )
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= 2 * index + 1 < SIGN_PARAM:
        raise Float8Error(
            f"index: {index!r} is not allowed; allowed: an int in 0..{(SIGN_PARAM - 2) // 2} (the gradients' "
            "keys are 2 * index and 2 * index + 1)"
        )
    step_arr = jnp.asarray(step)
    if step_arr.ndim != 0 or not jnp.issubdtype(step_arr.dtype, jnp.integer):
        raise Float8Error(
            f"step: expected an integer scalar (a Python int or an int32 jax.Array), got "
            f"{step_arr.dtype} of shape {step_arr.shape}"
        )
    return step_arr.astype(jnp.int32)


def quantize(
    x: Any, recipe: BlockRecipe, role: str, axis: int = 1, *, seed: int | None = None, step: Any = 0,
    index: int = 0,
) -> kernel.BlockQuantized:  # fmt: skip
    """A 2-D array quantized by the core's kernel with JAX's table (int32 codes, per-block scales).

    Args:
        x: a 2-D float array (upcast to float32).
        recipe: the :class:`mpx.blocks.BlockRecipe`.
        role: ``"input"``, ``"weight"`` or ``"grad"``.
        axis: the GEMM's reduction axis of ``x`` (0 or 1; default 1).
        seed, step, index: :func:`mpx.kernels.blocks.quantize`'s keys of stochastic rounding (the
            ``grad`` role) and the Hadamard signs (``input``/``grad`` along axis 0); ``seed`` is needed
            only there (default None), ``step`` may be traced (default 0), ``index`` is this tensor's key
            (0..65534; default 0).

    Raises:
        mpx.Float8Error: a seeded operand without a seed (a Python int), or a bad ``index``.
    """
    return kernel.quantize(JAX_OPS, jnp.asarray(x), recipe, role, axis, seed=seed, step=step, index=index)


def dequantize(q: kernel.BlockQuantized, recipe: BlockRecipe, role: str, axis: int = 1) -> jax.Array:
    """The float32 array a :func:`quantize` result stands for (:func:`mpx.kernels.blocks.dequantize`)."""
    return kernel.dequantize(JAX_OPS, q, recipe, role, axis)


def _qdq(x: Any, recipe: BlockRecipe, role: str, axis: int, **rng: Any) -> jax.Array:
    """``x`` quantized and dequantized (the weight-gradient operands of a Hadamard recipe: transformed,
    the reduction dimension padded to 16)."""
    q = kernel.quantize(JAX_OPS, lax.stop_gradient(x), recipe, role, axis, **rng)
    return dequantize(q, recipe, role, axis)


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


def block_matmul(
    x: Any, kernel_: Any, recipe: BlockRecipe, out_dtype: Any = None, *, seed: int | None = None,
    step: Any = 0, index: int = 0,
) -> jax.Array:  # fmt: skip
    """``x @ kernel`` (2-D, ``(M, K) @ (K, N)``) with every GEMM's operands block-quantized (module docs).

    Args:
        x: the input, shape (M, K), any float dtype.
        kernel_: the kernel, shape (K, N) (``w.T`` for torch's weight ``w``).
        recipe: the :class:`mpx.blocks.BlockRecipe`.
        out_dtype: the result's dtype (default None: ``x``'s); the GEMM itself is float32.
        seed: the seed of a seeded recipe (a Python int; default None, required there).
        step: the step counter (an int32 scalar, traced or not; default 0).
        index: this GEMM's tensor index (default 0): its gradients' keys are ``2 * index`` and
            ``2 * index + 1``, as torch's ``BlockLinear.block_index``.

    Raises:
        mpx.Float8Error: for a recipe that is not a block recipe, operands that are not 2-D, a seeded
            recipe without ``seed``, or a bad ``step``/``index``.
    """
    _check(recipe)
    step = _check_rng(recipe, seed, step, index)
    x, kernel_ = jnp.asarray(x), jnp.asarray(kernel_)
    if x.ndim != 2 or kernel_.ndim != 2 or x.shape[1] != kernel_.shape[0]:
        raise Float8Error(
            f"operands: block_matmul multiplies (M, K) by (K, N); got shapes {x.shape} and {kernel_.shape}."
        )
    dtype = jnp.dtype(out_dtype) if out_dtype is not None else x.dtype
    return _block_mm(recipe, dtype, seed, index, x, kernel_, step)


def _forward(recipe: BlockRecipe, dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    y = _dot(_qdq(x, recipe, "input", 1), _qdq(w, recipe, "weight", 0), (1, 0))
    return _poison(y, x, w).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _block_mm(
    recipe: BlockRecipe, dtype: Any, seed: int | None, index: int, x: jax.Array, w: jax.Array, step: jax.Array
) -> jax.Array:
    return _forward(recipe, dtype, x, w)


def _fwd(
    recipe: BlockRecipe, dtype: Any, seed: int | None, index: int, x: jax.Array, w: jax.Array, step: jax.Array
) -> tuple[jax.Array, Any]:
    return _forward(recipe, dtype, x, w), (x, w, step)


def _bwd(
    recipe: BlockRecipe, dtype: Any, seed: int | None, index: int, res: Any, dy: jax.Array
) -> tuple[Any, ...]:
    x, w, step = res
    dy = dy.astype(jnp.float32)
    rng = {"seed": seed, "step": step}
    # input gradient dy (M, N) @ w.T: dy and the kernel blocked along N
    dyq = _qdq(dy, recipe, "grad", 1, index=2 * index, **rng)
    dx = _poison(_dot(dyq, _qdq(w, recipe, "weight", 1), (1, 1)), dy, w)
    # kernel gradient x.T @ dy: both blocked along M (M padded to 16 under the Hadamard transform)
    dyq = _qdq(dy, recipe, "grad", 0, index=2 * index + 1, **rng)
    dw = _poison(_dot(_qdq(x, recipe, "input", 0, **rng), dyq, (0, 0)), dy, x)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_block_mm.defvjp(_fwd, _bwd)


def block_dot_general(
    lhs: Any, rhs: Any, dimension_numbers: Any, recipe: BlockRecipe, *, out_dtype: Any = None,
    seed: int | None = None, step: Any = 0, index: int = 0,
) -> jax.Array:  # fmt: skip
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` as a block-scaled GEMM (:func:`block_matmul`).

    The operands are flattened to ``(M, K)`` and ``(K, N)`` (free dimensions in order, the contracting
    ones in ``lhs``'s order), multiplied and the result reshaped to ``dot_general``'s layout.
    ``out_dtype``: the result's dtype (default: ``lhs``'s); ``seed``, ``step``, ``index``: a seeded
    recipe's keys (:func:`block_matmul`).

    Raises:
        mpx.Float8Error: for dimension numbers with batch dimensions (a ``bmm``, which block recipes,
            like FP8, leave to the compute dtype).
    """
    _check(recipe)
    _check_rng(recipe, seed, step, index)
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
    dtype = out_dtype if out_dtype is not None else lhs.dtype
    y = block_matmul(x, w, recipe, dtype, seed=seed, step=step, index=index)
    return y.reshape(tuple(lhs.shape[d] for d in lf) + tuple(rhs.shape[d] for d in rf))
