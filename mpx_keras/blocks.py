"""Block-scaled GEMMs for Keras 3 on any backend: a :class:`mpx.blocks.BlockRecipe` on Dense and EinsumDense.

Under a policy whose ``fp8`` is a block recipe (``mixed_bfloat16,fp8=mxfp8``, ``fp4=nvfp4``,
``fp8=fp8_blockwise``...; ``@head={fp8=none}`` keeps a layer out) :func:`mpx_keras.apply_policy` calls
:func:`convert`, which turns each ``keras.layers.Dense`` and ``keras.layers.EinsumDense`` into a
:class:`BlockDense` / :class:`BlockEinsumDense` in place (the same object and variables: its class
changes).  Block recipes are stateless, so the layer gains no variable: it saves, loads and steps as the
plain layer does, and a step the mpx :class:`mpx_keras.LossScaleOptimizer` skips writes nothing.

Its matmul is the one of ``mpx_torch.blocks.BlockLinear`` and ``mpx_jax.blocks.block_matmul``: the input
and kernel are seen as ``x`` (M, K) and ``kernel`` (K, N) (an EinsumDense's indices grouped so: those of
the input and output, the contracted ones, those of the kernel and output), and each GEMM quantizes its
two operands with the core's kernel (:func:`mpx.kernels.blocks.quantize`, run with
:data:`mpx_keras._array_ops.KERAS_ARRAY_OPS`: the numpy reference's bytes and scales) along its
reduction dimension, forward along K, input gradient along N, kernel gradient along M, each copy from
the high-precision value; the dequantized operands are multiplied in float32 (emulated), the bias is
added in float32 and the result cast to the compute dtype.  A GEMM with a non-finite operand returns NaN
everywhere, so the loss scaler sees the overflow.

>>> import keras, mpx_keras
>>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(4, name="fc")])
>>> model = mpx_keras.apply_policy(model, "mixed_bfloat16,fp8=mxfp8")
>>> type(model.layers[0]).__name__, model.layers[0].block_recipe.name
('BlockDense', 'mxfp8')
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import keras

import mpx
from mpx.blocks import BlockRecipe, refuse_randomized_recipe
from mpx.errors import Float8Error, MPXError, UnsupportedTypeError
from mpx.kernels import blocks as kernel
from mpx.ops import OpTable, as_op_table
from mpx_keras import _compat
from mpx_keras._array_ops import KERAS_ARRAY_OPS
from mpx_keras._float8_ops import contraction
from mpx_keras._layer_kinds import category_of, walk

__all__ = ["BlockDense", "BlockEinsumDense", "block_layers", "block_matmul", "convert", "quantize"]

ops = keras.ops
_O = KERAS_ARRAY_OPS


def quantize(x: Any, recipe: BlockRecipe, role: str, axis: int = 1) -> kernel.BlockQuantized:
    """A 2-D tensor quantized by the core's kernel with the ``keras.ops`` table (int32 codes, scales).

    Raises:
        mpx.Float8Error: for a recipe with stochastic rounding or the Hadamard transform (torch only, for now).
    """
    refuse_randomized_recipe(recipe, "mpx_keras")
    return kernel.quantize(_O, ops.convert_to_tensor(x), recipe, role, axis)


def _qdq(x: Any, recipe: BlockRecipe, role: str, axis: int) -> Any:
    return kernel.dequantize(_O, quantize(ops.stop_gradient(x), recipe, role, axis), recipe, role, axis)


def _poison(y: Any, a: Any, b: Any) -> Any:
    finite = ops.logical_and(ops.all(ops.isfinite(a)), ops.all(ops.isfinite(b)))
    return ops.where(finite, y, math.nan)


def block_matmul(x: Any, kernel_: Any, recipe: BlockRecipe) -> Any:
    """``x @ kernel`` (``(M, K) @ (K, N)``, a float32 result) with each GEMM's operands block-quantized
    (module docs), differentiable (``keras.ops.custom_gradient``; the gradients in the operands' dtypes)."""
    x_dtype = keras.backend.standardize_dtype(x.dtype)
    k_dtype = keras.backend.standardize_dtype(kernel_.dtype)

    @ops.custom_gradient
    def gemm(xv: Any, kv: Any) -> Any:
        y = _poison(ops.matmul(_qdq(xv, recipe, "input", 1), _qdq(kv, recipe, "weight", 0)), xv, kv)

        def grad(*args: Any, upstream: Any = None, variables: Any = None) -> Any:
            if upstream is None:
                (upstream,) = args
            dy = ops.cast(upstream, "float32")
            wq = ops.transpose(_qdq(kv, recipe, "weight", 1))
            dx = _poison(ops.matmul(_qdq(dy, recipe, "grad", 1), wq), dy, kv)
            xq = ops.transpose(_qdq(xv, recipe, "input", 0))
            dk = _poison(ops.matmul(xq, _qdq(dy, recipe, "grad", 0)), dy, xv)
            return ops.cast(dx, x_dtype), ops.cast(dk, k_dtype)

        return y, grad

    return gemm(x, kernel_)


def _layout(equation: str | None, x_ndim: int) -> tuple[str, str, str, str, str, str]:
    """``(x, w, out, m, k, n)`` index strings of a Dense (None) or EinsumDense equation.

    Raises:
        mpx.Float8Error: for an equation that is not a plain ``(M, K) @ (K, N)`` (an index of all three
            operands, or one summed within a single operand).
    """
    forward = contraction(equation, x_ndim)[0]
    (x, w), out = forward.split("->")[0].split(","), forward.split("->")[1]
    m = "".join(c for c in x if c in out and c not in w)
    k = "".join(c for c in x if c in w and c not in out)
    n = "".join(c for c in w if c in out and c not in x)
    if len(m) + len(k) != len(x) or len(k) + len(n) != len(w) or len(m) + len(n) != len(out):
        raise Float8Error(
            f"equation: {equation!r}: a block-scaled EinsumDense needs the input's indices to be its output "
            "indices and the contracted ones, and the kernel's the contracted ones and its output indices "
            "(an index of all three operands is a batched GEMM, which block recipes do not run)"
        )
    return x, w, out, m, k, n


def _contract(equation: str | None, x: Any, w: Any, recipe: BlockRecipe) -> Any:
    """``einsum(equation, x, w)`` (Dense: ``x @ w``) as a float32 :func:`block_matmul`."""
    xs, ws, out, m, k, n = _layout(equation, len(x.shape))
    size = {c: d for c, d in zip(xs + ws, tuple(x.shape) + tuple(w.shape), strict=True)}
    k_size = math.prod(size[c] for c in k)
    x2 = ops.reshape(ops.transpose(x, [xs.index(c) for c in m + k]), (-1, k_size))
    w2 = ops.reshape(ops.transpose(w, [ws.index(c) for c in k + n]), (k_size, -1))
    y = ops.reshape(block_matmul(x2, w2, recipe), [-1 if c == m[:1] else size[c] for c in m + n])
    return ops.transpose(y, [(m + n).index(c) for c in out])


class _BlockLayer:
    """What :class:`BlockDense` and :class:`BlockEinsumDense` share (never used alone)."""

    @property
    def block_recipe(self) -> BlockRecipe:
        """The :class:`mpx.blocks.BlockRecipe` this layer quantizes with."""
        return self.__dict__["_mpx_block_recipe"]

    def _block_equation(self) -> str | None:
        return None

    def call(self, inputs: Any, training: Any = None) -> Any:
        if getattr(self, "lora_enabled", False) or getattr(self, "quantization_mode", None):
            raise MPXError(
                f"layer {self.name!r}: a block-scaled layer cannot also use LoRA or Keras quantization."
            )
        x = ops.convert_to_tensor(inputs)
        with _compat.AutocastScope(None):  # the float32 master weights, not a compute-dtype copy
            w = self.kernel.value
            bias = None if self.bias is None else ops.cast(self.bias.value, "float32")
        y = _contract(self._block_equation(), x, w, self.block_recipe)
        if bias is not None:
            y = ops.add(y, bias)
        y = ops.cast(y, self.compute_dtype)
        return y if self.activation is None else self.activation(y)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "block_recipe": self.block_recipe.to_dict()}  # type: ignore[misc]


def _as_recipe(recipe: BlockRecipe | Mapping[str, Any]) -> BlockRecipe:
    return recipe if isinstance(recipe, BlockRecipe) else BlockRecipe.from_dict(recipe)


@keras.saving.register_keras_serializable(package="mpx_keras")
class BlockDense(_BlockLayer, keras.layers.Dense):
    """A ``keras.layers.Dense`` whose GEMMs run block-scaled (made by :func:`convert`, or loaded).

    Args:
        block_recipe: the :class:`mpx.blocks.BlockRecipe` or its dict; the rest are Dense's.
    """

    def __init__(self, *args: Any, block_recipe: BlockRecipe | Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_block_recipe"] = _as_recipe(block_recipe)


@keras.saving.register_keras_serializable(package="mpx_keras")
class BlockEinsumDense(_BlockLayer, keras.layers.EinsumDense):
    """A ``keras.layers.EinsumDense`` whose GEMMs run block-scaled (made by :func:`convert`, or loaded).

    Args:
        block_recipe: the :class:`mpx.blocks.BlockRecipe` or its dict; the rest are EinsumDense's.
    """

    def __init__(self, *args: Any, block_recipe: BlockRecipe | Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_block_recipe"] = _as_recipe(block_recipe)
        _layout(self.equation, len(self.equation.split(",")[0].replace("...", "")) + 1)

    def _block_equation(self) -> str | None:
        return self.equation


_CONVERTIBLE: tuple[tuple[type, type, str], ...] = (
    (keras.layers.Dense, BlockDense, "linear"),
    (keras.layers.EinsumDense, BlockEinsumDense, "einsum"),
)


def convert(
    model: keras.layers.Layer, policy: mpx.PolicySpec, *, op_table: OpTable | None = None
) -> keras.layers.Layer:
    """Run the Dense and EinsumDense layers of ``model`` whose policy names a block recipe as block layers,
    in place (only layers whose class is exactly ``Dense``/``EinsumDense``, or a block layer already); a
    block layer whose policy no longer names one becomes the plain layer again.  All checks come first:
    on an error nothing changes.

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a Keras layer.
        mpx.MPXError: for a layer with LoRA or Keras quantization, and (:class:`mpx.Float8Error`) an
            EinsumDense equation a block-scaled GEMM cannot run.
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    root = mpx.get_policy(policy)
    table = as_op_table(op_table)
    plan = []
    for path, layer in walk(model):
        target = next(((p, b, op) for p, b, op in _CONVERTIBLE if type(layer) in (p, b)), None)
        if target is None:
            continue
        plain, block_class, op = target
        own = root.for_module(path, category_of(layer))
        recipe = own.fp8 if table.fp8_applies(op, own) else None
        recipe = recipe if isinstance(recipe, BlockRecipe) else None
        if recipe is not None and (getattr(layer, "lora_enabled", False) or layer.quantization_mode):
            raise MPXError(
                f"layer {path or layer.name!r}: a block-scaled layer cannot also use LoRA or Keras quantization."
            )
        if recipe is not None and op == "einsum":
            _layout(layer.equation, len(layer.equation.split(",")[0].replace("...", "")) + 1)
        plan.append((layer, plain, block_class, recipe))
    for layer, plain, block_class, recipe in plan:
        if recipe is None:
            if type(layer) is block_class:
                layer.__dict__.pop("_mpx_block_recipe", None)
                layer.__class__ = plain
            continue
        layer.__class__ = block_class
        layer.__dict__["_mpx_block_recipe"] = recipe
    return model


def block_layers(model: keras.layers.Layer) -> Iterator[tuple[str, _BlockLayer]]:
    """``(path, layer)`` for every block-scaled layer under ``model`` (the model itself included)."""
    for path, layer in walk(model):
        if isinstance(layer, _BlockLayer):
            yield path, layer
