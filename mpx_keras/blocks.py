"""Block-scaled GEMMs for Keras 3 on any backend: a :class:`mpx.blocks.BlockRecipe` on Dense and EinsumDense.

Under a policy whose ``fp8`` is a block recipe (``mixed_bfloat16,fp8=mxfp8``, ``fp4=nvfp4``,
``fp8=fp8_blockwise``...; ``@head={fp8=none}`` keeps a layer out) :func:`mpx_keras.apply_policy` calls
:func:`convert`, which turns each ``keras.layers.Dense`` and ``keras.layers.EinsumDense`` into a
:class:`BlockDense` / :class:`BlockEinsumDense` in place (the same object and variables: its class
changes).  Block recipes are stateless: the layer's one new variable is ``block_step``, a
non-trainable int32 counter of its training calls (the step of the random bits of stochastic
rounding and the Hadamard signs, as ``mpx_torch.blocks.BlockLinear.block_step``); it advances on a
step the mpx :class:`mpx_keras.LossScaleOptimizer` skips too, and a skipped step writes nothing else.

Its matmul is the one of ``mpx_torch.blocks.BlockLinear`` and ``mpx_jax.blocks.block_matmul``: the input
and kernel are seen as ``x`` (M, K) and ``kernel`` (K, N) (an EinsumDense's indices grouped so: those of
the input and output, the contracted ones, those of the kernel and output), and each GEMM quantizes its
two operands with the core's kernel (:func:`mpx.kernels.blocks.quantize`, run with
:data:`mpx_keras._array_ops.KERAS_ARRAY_OPS`: the numpy reference's bytes and scales) along its
reduction dimension, forward along K, input gradient along N, kernel gradient along M, each copy from
the high-precision value; the dequantized operands are multiplied in float32 (emulated), the bias is
added in float32 and the result cast to the compute dtype.  A GEMM with a non-finite operand returns NaN
everywhere, so the loss scaler sees the overflow.  A recipe with stochastic rounding or the Hadamard
transform (``nvfp4_te``) keys its random bits by ``(block_seed, block_step, index)`` exactly as torch:
the gradient's two copies use the keys ``2 * block_index`` (input gradient) and ``2 * block_index + 1``
(kernel gradient).

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
from mpx.blocks import BlockRecipe
from mpx.errors import Float8Error, MPXError, StateDictError, UnsupportedTypeError
from mpx.kernels import blocks as kernel
from mpx.ops import OpTable, as_op_table
from mpx_keras import _compat
from mpx_keras._array_ops import KERAS_ARRAY_OPS
from mpx_keras._float8_ops import contraction
from mpx_keras._layer_kinds import category_of, walk

__all__ = ["BlockDense", "BlockEinsumDense", "block_layers", "block_matmul", "convert", "quantize"]

ops = keras.ops
_O = KERAS_ARRAY_OPS


def quantize(
    x: Any,
    recipe: BlockRecipe,
    role: str,
    axis: int = 1,
    *,
    seed: int | None = None,
    step: Any = 0,
    index: int = 0,
) -> kernel.BlockQuantized:
    """A 2-D tensor quantized by the core's kernel with the ``keras.ops`` table (int32 codes, scales);
    ``seed``, ``step`` (a Python int or an int32 scalar tensor), ``index``:
    :func:`mpx.kernels.blocks.quantize`'s (stochastic rounding, the Hadamard transform).

    Raises:
        mpx.Float8Error: for a recipe that rounds stochastically or transforms this operand without an
            int ``seed``, or a bad ``axis`` or ``index``.
    """
    return kernel.quantize(
        _O, ops.convert_to_tensor(x), recipe, role, axis, seed=seed, step=step, index=index
    )


def _qdq(x: Any, recipe: BlockRecipe, role: str, axis: int, **rng: Any) -> Any:
    """``x`` quantized and dequantized (for the weight-gradient operands of a Hadamard recipe: the
    transformed operand, M padded to a multiple of 16)."""
    q = quantize(ops.stop_gradient(x), recipe, role, axis, **rng)
    return kernel.dequantize(_O, q, recipe, role, axis)


def _poison(y: Any, a: Any, b: Any) -> Any:
    finite = ops.logical_and(ops.all(ops.isfinite(a)), ops.all(ops.isfinite(b)))
    return ops.where(finite, y, math.nan)


def block_matmul(
    x: Any, kernel_: Any, recipe: BlockRecipe, *, seed: int | None = None, step: Any = 0, index: int = 0
) -> Any:
    """``x @ kernel`` (``(M, K) @ (K, N)``, a float32 result) with each GEMM's operands block-quantized
    (module docs), differentiable (``keras.ops.custom_gradient``; the gradients in the operands' dtypes).

    ``seed`` (a Python int; needed by a recipe with stochastic rounding or the Hadamard transform),
    ``step`` (default 0; an int or int32 scalar tensor) and ``index`` (the layer's index, default 0)
    key the gradients' random bits as ``mpx_torch.blocks.BlockLinear`` does: keys ``2 * index`` and
    ``2 * index + 1`` for the gradient's copies of the input and kernel gradients.
    """
    rng = {"seed": seed, "step": step}
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
            dx = _poison(ops.matmul(_qdq(dy, recipe, "grad", 1, index=2 * index, **rng), wq), dy, kv)
            xq = ops.transpose(_qdq(xv, recipe, "input", 0, **rng))  # M padded to 16 under the RHT
            dk = _poison(ops.matmul(xq, _qdq(dy, recipe, "grad", 0, index=2 * index + 1, **rng)), dy, xv)
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


def _contract(equation: str | None, x: Any, w: Any, recipe: BlockRecipe, **rng: Any) -> Any:
    """``einsum(equation, x, w)`` (Dense: ``x @ w``) as a float32 :func:`block_matmul`."""
    xs, ws, out, m, k, n = _layout(equation, len(x.shape))
    size = {c: d for c, d in zip(xs + ws, tuple(x.shape) + tuple(w.shape), strict=True)}
    k_size = math.prod(size[c] for c in k)
    x2 = ops.reshape(ops.transpose(x, [xs.index(c) for c in m + k]), (-1, k_size))
    w2 = ops.reshape(ops.transpose(w, [ws.index(c) for c in k + n]), (k_size, -1))
    y = ops.reshape(block_matmul(x2, w2, recipe, **rng), [-1 if c == m[:1] else size[c] for c in m + n])
    return ops.transpose(y, [(m + n).index(c) for c in out])


class _BlockLayer:
    """What :class:`BlockDense` and :class:`BlockEinsumDense` share (never used alone).

    Attributes:
        block_recipe: the :class:`mpx.blocks.BlockRecipe`.
        block_seed: the seed of stochastic rounding and the Hadamard signs (``apply_policy``'s ``seed``).
        block_index: this layer's index among the model's block layers (model order).
        block_step: a non-trainable int32 ``keras.Variable``, the count of training calls (the random
            bits' step; saved with the layer's variables; it advances on a skipped step too).
    """

    @property
    def block_recipe(self) -> BlockRecipe:
        """The :class:`mpx.blocks.BlockRecipe` this layer quantizes with."""
        return self.__dict__["_mpx_block_recipe"]

    @property
    def block_seed(self) -> int:
        """The seed of the random bits (default 0)."""
        return self.__dict__.get("_mpx_block_seed", 0)

    @property
    def block_index(self) -> int:
        """This layer's index among the model's block layers (default 0)."""
        return self.__dict__.get("_mpx_block_index", 0)

    def _block_equation(self) -> str | None:
        return None

    def _block_build_state(self) -> None:
        if "block_step" not in self.__dict__:
            self.__dict__["block_step"] = self.add_weight(  # type: ignore[attr-defined]
                name="block_step",
                shape=(),
                dtype="int32",
                initializer="zeros",
                trainable=False,
                autocast=False,
            )

    def build(self, *args: Any, **kwargs: Any) -> None:
        super().build(*args, **kwargs)  # type: ignore[misc]
        with _compat.unlocked(self):
            self._block_build_state()

    def call(self, inputs: Any, training: Any = None) -> Any:
        if getattr(self, "lora_enabled", False) or getattr(self, "quantization_mode", None):
            raise MPXError(
                f"layer {self.name!r}: a block-scaled layer cannot also use LoRA or Keras quantization."
            )
        x = ops.convert_to_tensor(inputs)
        if any(d is None for d in x.shape):
            raise MPXError(
                f"layer {self.name!r}: a block-scaled layer needs static input shapes, got {tuple(x.shape)} (the "
                "blocks and their padding are laid out when traced); under fit on TensorFlow a partial last "
                "batch retraces with batch None: use a batch size that divides the data, or drop_remainder."
            )
        with _compat.AutocastScope(None):  # the float32 master weights, not a compute-dtype copy
            w = self.kernel.value
            bias = None if self.bias is None else ops.cast(self.bias.value, "float32")
        counter = self.__dict__["block_step"]
        step = ops.copy(counter.value)  # a copy: torch's variable is assigned in place
        if training:
            counter.assign_add(ops.ones((), "int32"))
        rng = {"seed": self.block_seed, "step": step, "index": self.block_index}
        y = _contract(self._block_equation(), x, w, self.block_recipe, **rng)
        if bias is not None:
            y = ops.add(y, bias)
        y = ops.cast(y, self.compute_dtype)
        return y if self.activation is None else self.activation(y)

    def _saved_variables(self) -> list[keras.Variable]:
        own = [self.kernel] + ([] if self.bias is None else [self.bias])  # type: ignore[attr-defined]
        return [*own, self.__dict__["block_step"]]

    def save_own_variables(self, store: Any) -> None:
        if not self.built:  # type: ignore[attr-defined]
            return
        for i, var in enumerate(self._saved_variables()):
            store[str(i)] = var

    def load_own_variables(self, store: Any) -> None:
        """The kernel, bias and ``block_step`` (a file saved before the layer had ``block_step``: 0)."""
        own = self._saved_variables()
        if len(store.keys()) not in (len(own), len(own) - 1):
            raise StateDictError(
                f"layer {self.name!r}: the saved file has {len(store.keys())} variables for it, the block-scaled "  # type: ignore[attr-defined]
                f"layer has {len(own)} (kernel, bias, then block_step): was it saved with the same policy?"
            )
        for i, var in enumerate(own[: len(store.keys())]):
            var.assign(store[str(i)])

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()  # type: ignore[misc]
        return {**config, "block_recipe": self.block_recipe.to_dict(), "block_seed": self.block_seed,
                "block_index": self.block_index}  # fmt: skip


def _as_recipe(recipe: BlockRecipe | Mapping[str, Any]) -> BlockRecipe:
    return recipe if isinstance(recipe, BlockRecipe) else BlockRecipe.from_dict(recipe)


def _check_seed(seed: Any, field: str = "seed") -> int:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise MPXError(f"{field}: {seed!r} is not allowed; allowed: a Python int")
    return seed


def _check_index(index: Any) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= 2 * index + 1 < 0xFFFF:
        raise MPXError(f"block_index: {index!r} is not allowed; allowed: an int in 0..32766")
    return index


@keras.saving.register_keras_serializable(package="mpx_keras")
class BlockDense(_BlockLayer, keras.layers.Dense):
    """A ``keras.layers.Dense`` whose GEMMs run block-scaled (made by :func:`convert`, or loaded).

    Args:
        block_recipe: the :class:`mpx.blocks.BlockRecipe` or its dict.
        block_seed: the seed of the random bits (default 0); block_index: the layer's key (default 0,
            0..32766); the rest are Dense's.
    """

    def __init__(
        self, *args: Any, block_recipe: BlockRecipe | Mapping[str, Any], block_seed: int = 0, block_index: int = 0,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_block_recipe"] = _as_recipe(block_recipe)
        self.__dict__["_mpx_block_seed"] = _check_seed(block_seed, "block_seed")
        self.__dict__["_mpx_block_index"] = _check_index(block_index)


@keras.saving.register_keras_serializable(package="mpx_keras")
class BlockEinsumDense(_BlockLayer, keras.layers.EinsumDense):
    """A ``keras.layers.EinsumDense`` whose GEMMs run block-scaled (made by :func:`convert`, or loaded).

    Args:
        block_recipe: the :class:`mpx.blocks.BlockRecipe` or its dict.
        block_seed, block_index: as :class:`BlockDense`'s; the rest are EinsumDense's.
    """

    def __init__(
        self, *args: Any, block_recipe: BlockRecipe | Mapping[str, Any], block_seed: int = 0, block_index: int = 0,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_block_recipe"] = _as_recipe(block_recipe)
        self.__dict__["_mpx_block_seed"] = _check_seed(block_seed, "block_seed")
        self.__dict__["_mpx_block_index"] = _check_index(block_index)
        _layout(self.equation, len(self.equation.split(",")[0].replace("...", "")) + 1)

    def _block_equation(self) -> str | None:
        return self.equation


_CONVERTIBLE: tuple[tuple[type, type, str], ...] = (
    (keras.layers.Dense, BlockDense, "linear"),
    (keras.layers.EinsumDense, BlockEinsumDense, "einsum"),
)


def convert(
    model: keras.layers.Layer, policy: mpx.PolicySpec, *, op_table: OpTable | None = None, seed: int = 0
) -> keras.layers.Layer:
    """Run the Dense and EinsumDense layers of ``model`` whose policy names a block recipe as block layers,
    in place (only layers whose class is exactly ``Dense``/``EinsumDense``, or a block layer already); a
    block layer whose policy no longer names one becomes the plain layer again (its ``block_step``
    variable dropped).  ``seed`` (default 0): the layers' ``block_seed``; the layers are indexed in model
    order (``block_index``), as ``mpx_torch.blocks.convert`` does.  All checks come first: on an error
    nothing changes.

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a Keras layer.
        mpx.MPXError: for a ``seed`` that is not an int, a layer with LoRA or Keras quantization, and
            (:class:`mpx.Float8Error`) an EinsumDense equation a block-scaled GEMM cannot run.
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    _check_seed(seed)
    root = mpx.get_policy(policy)
    table = as_op_table(op_table)
    plan = []
    index = 0
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
        plan.append((layer, plain, block_class, recipe, index))
        index += recipe is not None
    _check_index(max(index - 1, 0))
    for layer, plain, block_class, recipe, i in plan:  # every check passed: nothing below raises
        if recipe is None:
            if type(layer) is block_class:
                layer.__dict__.pop("_mpx_block_recipe", None)
                step = layer.__dict__.pop("block_step", None)
                if step is not None:
                    _compat.untrack_variable(layer, step)
                layer.__class__ = plain
            continue
        layer.__class__ = block_class
        layer.__dict__.update(_mpx_block_recipe=recipe, _mpx_block_seed=seed, _mpx_block_index=i)
        if layer.built:
            with _compat.unlocked(layer):
                layer._block_build_state()
        else:
            _build_state_after_build(layer)
    return model


def _build_state_after_build(layer: _BlockLayer) -> None:
    """Give an unbuilt converted layer its ``block_step`` when it builds (Keras binds a layer's ``build``
    at construction, so the class swap alone leaves Dense's: wrap that instance ``build``)."""
    keras_build = layer.build

    def build(*args: Any, **kwargs: Any) -> None:
        keras_build(*args, **kwargs)
        if isinstance(layer, _BlockLayer):
            with _compat.unlocked(layer):
                layer._block_build_state()

    build.__wrapped__ = keras_build  # type: ignore[attr-defined]
    layer.__dict__["build"] = build


def block_layers(model: keras.layers.Layer) -> Iterator[tuple[str, _BlockLayer]]:
    """``(path, layer)`` for every block-scaled layer under ``model`` (the model itself included)."""
    for path, layer in walk(model):
        if isinstance(layer, _BlockLayer):
            yield path, layer
