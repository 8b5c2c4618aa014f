"""FP8 GEMMs for Keras 3 on any backend: the core's recipe (:mod:`mpx.float8`) on Dense and EinsumDense.

Under a policy with an ``fp8`` recipe (``mixed_bfloat16,fp8=hybrid``, ``mixed_bfloat16_fp8``;
``@head={fp8=none}`` keeps a layer out) :func:`mpx_keras.apply_policy` calls :func:`convert`, which
turns each ``keras.layers.Dense`` (op ``linear``) and ``keras.layers.EinsumDense`` (op ``einsum``)
whose own policy has FP8 into a :class:`Float8Dense` / :class:`Float8EinsumDense`, in place (the
same object and variables: its class changes, as ``mpx_torch.float8.convert`` does).

Its matmul quantizes the input and the float32 kernel to e4m3 with their scales (multiply; the GEMM
uses the inverses), contracts the FP8 values in float32 (exact products, float32 sums) and returns
the compute dtype; its backward quantizes the output gradient (e5m2 under ``hybrid``) and computes
dgrad and wgrad from the quantized operands.  The bias is added in float32.

The FP8 state is six float32 variables per layer (``fp8_input_scale``, ``fp8_input_amax_history``,
``fp8_weight_...``, ``fp8_grad_...``; no histories under current scaling), saved with the model.
They are Keras ``overwrite_with_gradient`` variables (hence trainable, as in Keras's own float8
Dense): their "gradient" is their value after the step, which the optimizer writes.  Under delayed
scaling a ``*_scale`` variable holds the scale the last step quantized with, and each step computes
its own from it and the history (the value :func:`mpx.float8.float8_update` gives; read the state
with :func:`float8_state_dict`), so an accumulation window commits one update with the MAX of its
micro-batches' amaxes.  Step t quantizes with the scales computed from the amaxes of steps <= t-1
(Transformer Engine's lag; Keras's ``quantize("float8")`` lags one step more), and a step the mpx
:class:`mpx_keras.LossScaleOptimizer` skips writes no variable: no amax and no scale are committed.

>>> import keras, mpx_keras
>>> with mpx_keras.policy_scope("mixed_bfloat16"):
...     model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, name="fc")])
>>> model = mpx_keras.apply_policy(model, "mixed_bfloat16,fp8=hybrid,fp8_history=4")
>>> type(model.layers[0]).__name__
'Float8Dense'
>>> float8_state_dict(model)["tensors"]["fc.input"]
{'role': 'input', 'scale': 1.0, 'amax_history': [0.0, 0.0, 0.0, 0.0]}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np

import mpx
from mpx.blocks import BlockRecipe
from mpx.errors import MPXError, StateDictError, UnsupportedTypeError
from mpx.float8 import (
    ROLES,
    Float8Recipe,
    Float8State,
    TensorScale,
    check_model_state,
    one_recipe,
    tensor_key,
)
from mpx.float8 import load_state_dict as _core_load
from mpx.float8 import state_dict as _core_state_dict
from mpx.kernels import NUMPY_OPS
from mpx.kernels import float8 as kernel
from mpx.ops import OpTable, as_op_table
from mpx_keras import _compat
from mpx_keras._float8_ops import contraction, fp8_contract
from mpx_keras._float8_ops import quantize as quantize
from mpx_keras._layer_kinds import category_of, walk
from mpx_keras.blocks import block_layers

__all__ = [
    "Float8Dense",
    "Float8EinsumDense",
    "convert",
    "float8_layers",
    "float8_state_dict",
    "load_float8_state_dict",
    "quantize",
]

ops = keras.ops


class _Float8Layer:
    """What :class:`Float8Dense` and :class:`Float8EinsumDense` share (never used alone)."""

    _mpx_fp8_recipe: Float8Recipe
    _fp8_op: str = "linear"

    @property
    def fp8_recipe(self) -> Float8Recipe:
        """The :class:`mpx.Float8Recipe` this layer quantizes with."""
        return self.__dict__["_mpx_fp8_recipe"]

    def fp8_variables(self) -> list[tuple[str, str, keras.Variable]]:
        """``(role, kind, variable)`` per state variable, kind ``"scale"`` or ``"amax_history"``."""
        out = []
        for role in ROLES:
            out.append((role, "scale", getattr(self, f"fp8_{role}_scale")))
            if self.fp8_recipe.scaling == "delayed":
                out.append((role, "amax_history", getattr(self, f"fp8_{role}_amax_history")))
        return out

    def _fp8_build_state(self) -> None:
        recipe = self.fp8_recipe
        common = {"dtype": "float32", "trainable": True, "autocast": False, "overwrite_with_gradient": True}
        for role in ROLES:
            var = self.add_weight(name=f"fp8_{role}_scale", shape=(), initializer="ones", **common)
            self.__dict__[f"fp8_{role}_scale"] = var
            if recipe.scaling == "delayed":
                var = self.add_weight(
                    name=f"fp8_{role}_amax_history",
                    shape=(recipe.amax_history_len,),
                    initializer="zeros",
                    **common,
                )
                self.__dict__[f"fp8_{role}_amax_history"] = var

    def build(self, *args: Any, **kwargs: Any) -> None:
        super().build(*args, **kwargs)  # type: ignore[misc]
        with _compat.unlocked(self):
            self._fp8_build_state()

    def _fp8_equation(self) -> str | None:
        return None

    def _fp8_matmul(self, inputs: Any, training: Any) -> Any:
        """The FP8 GEMM plus the float32 bias, in the layer's compute dtype."""
        x = ops.convert_to_tensor(inputs)
        # the float32 master weights, not the compute-dtype copy: `.value` read with autocast off (on
        # TensorFlow ops.convert_to_tensor returns the variable itself, read later under autocast)
        with _compat.AutocastScope(None):
            kernel = self.kernel.value
            bias = None if self.bias is None else ops.cast(self.bias.value, "float32")
            state = []
            for role in ROLES:
                state.append(getattr(self, f"fp8_{role}_scale").value)
                hist = self.__dict__.get(f"fp8_{role}_amax_history")
                state.append(None if self.fp8_recipe.scaling == "current" else hist.value)
        equations = contraction(self._fp8_equation(), len(x.shape))
        y = fp8_contract(self.fp8_recipe, equations, x, kernel, state, bool(training))
        if bias is not None:
            y = ops.add(y, bias)
        return ops.cast(y, self.compute_dtype)

    def call(self, inputs: Any, training: Any = None) -> Any:
        if getattr(self, "lora_enabled", False) or getattr(self, "quantization_mode", None):
            raise MPXError(
                f"layer {self.name!r}: an FP8 layer cannot also use LoRA or Keras quantization "
                f"({self.quantization_mode or 'lora'})."
            )
        x = self._fp8_matmul(inputs, training)
        if self.activation is not None:
            x = self.activation(x)
        return x

    def save_own_variables(self, store: Any) -> None:
        if not self.built:
            return
        for i, var in enumerate(self._saved_variables()):
            store[str(i)] = var

    def load_own_variables(self, store: Any) -> None:
        own = self._saved_variables()
        if len(store.keys()) != len(own):
            raise StateDictError(
                f"layer {self.name!r}: the saved file has {len(store.keys())} variables for it, the FP8 layer "
                f"has {len(own)} (kernel, bias, then its FP8 state): was it saved with the same policy?"
            )
        for i, var in enumerate(own):
            var.assign(store[str(i)])

    def _saved_variables(self) -> list[keras.Variable]:
        own = [self.kernel] + ([] if self.bias is None else [self.bias])
        return own + [var for _, _, var in self.fp8_variables()]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fp8_recipe": self.fp8_recipe.to_dict()}  # type: ignore[misc]


@keras.saving.register_keras_serializable(package="mpx_keras")
class Float8Dense(_Float8Layer, keras.layers.Dense):
    """A ``keras.layers.Dense`` whose GEMMs run in FP8 (made by :func:`convert`, or loaded from a file).

    Args:
        fp8_recipe: the :class:`mpx.Float8Recipe` or its dict (``get_config``'s); the rest are Dense's.
    """

    def __init__(self, *args: Any, fp8_recipe: Float8Recipe | Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_fp8_recipe"] = _as_recipe(fp8_recipe)


@keras.saving.register_keras_serializable(package="mpx_keras")
class Float8EinsumDense(_Float8Layer, keras.layers.EinsumDense):
    """A ``keras.layers.EinsumDense`` whose GEMMs run in FP8 (made by :func:`convert`, or loaded).

    Args:
        fp8_recipe: the :class:`mpx.Float8Recipe` or its dict; the rest are EinsumDense's.
    """

    _fp8_op = "einsum"

    def __init__(self, *args: Any, fp8_recipe: Float8Recipe | Mapping[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["_mpx_fp8_recipe"] = _as_recipe(fp8_recipe)
        contraction(self.equation, len(self.equation.split(",")[0].replace("...", "")) + 1)

    def _fp8_equation(self) -> str | None:
        return self.equation


def _as_recipe(recipe: Float8Recipe | Mapping[str, Any]) -> Float8Recipe:
    return recipe if isinstance(recipe, Float8Recipe) else Float8Recipe.from_dict(recipe)


#: The Keras classes :func:`convert` turns into FP8 layers (exactly these classes: a subclass may compute
#: differently), with the op of the policy's op table each one is.
_CONVERTIBLE: tuple[tuple[type, type, str], ...] = (
    (keras.layers.Dense, Float8Dense, "linear"),
    (keras.layers.EinsumDense, Float8EinsumDense, "einsum"),
)


def _target(layer: keras.layers.Layer) -> tuple[type, type, str] | None:
    for plain, fp8, op in _CONVERTIBLE:
        if type(layer) is plain or type(layer) is fp8:
            return plain, fp8, op
    return None


def convert(
    model: keras.layers.Layer, policy: mpx.PolicySpec, *, op_table: OpTable | None = None
) -> keras.layers.Layer:
    """Run the Dense and EinsumDense layers of ``model`` whose policy has FP8 as FP8 layers, in place.

    A layer at ``path`` (layer names from the model down, as :func:`mpx_keras.apply_policy` names it)
    gets FP8 when ``policy.for_module(path, category)`` has an ``fp8`` recipe and ``op_table`` (default
    :data:`mpx.OP_TABLE`) classifies its op (``linear`` for Dense, ``einsum`` for EinsumDense) LOWER.
    Only layers whose class is exactly ``Dense`` or ``EinsumDense`` are converted.  The layer keeps its
    object, variables and config; it gains the FP8 state (scale 1.0, a zero history) now if built, else
    when it builds.  Converting again keeps the state of layers whose recipe is unchanged.
    :func:`mpx_keras.apply_policy` calls it; call it yourself only with the same policy.  Convert
    before ``compile`` (the optimizer must see the FP8 variables when it builds).

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a Keras layer.
        mpx.MPXError: for a built FP8 layer whose recipe would change or whose policy loses FP8 (its
            variables cannot be removed: create the model again), for a layer with LoRA or Keras
            quantization, and for an EinsumDense equation FP8 cannot run (:class:`mpx.Float8Error`).
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    root = mpx.get_policy(policy)
    table = as_op_table(op_table)
    plan = []
    for path, layer in walk(model):
        target = _target(layer)
        if target is None:
            continue
        plain, fp8_class, op = target
        own = root.for_module(path, category_of(layer))
        recipe = own.fp8 if mpx.ops.as_op_table(table).fp8_applies(op, own) else None
        recipe = recipe if isinstance(recipe, Float8Recipe) else None  # block recipes: mpx_keras.blocks
        where = path or layer.name
        if recipe is not None and (getattr(layer, "lora_enabled", False) or layer.quantization_mode):
            raise MPXError(f"layer {where!r}: FP8 cannot run on a layer with LoRA or Keras quantization.")
        if recipe is not None and op == "einsum":
            contraction(layer.equation, len(layer.equation.split(",")[0].replace("...", "")) + 1)
        if isinstance(layer, _Float8Layer) and layer.built and recipe != layer.fp8_recipe:
            change = "loses FP8" if recipe is None else f"changes its FP8 recipe to {recipe}"
            raise MPXError(
                f"layer {where!r}: its policy {change}, but it is a built FP8 layer whose state variables "
                "cannot be removed; create the model again and apply the new policy before building it."
            )
        plan.append((layer, plain, fp8_class, recipe))
    for layer, plain, fp8_class, recipe in plan:  # every check passed: nothing below raises
        if recipe is None:
            if type(layer) is fp8_class:
                layer.__dict__.pop("_mpx_fp8_recipe", None)
                layer.__class__ = plain
            continue
        if type(layer) is fp8_class and layer.fp8_recipe == recipe:
            continue
        layer.__class__ = fp8_class
        layer.__dict__["_mpx_fp8_recipe"] = recipe
        if layer.built:
            with _compat.unlocked(layer):
                layer._fp8_build_state()
        else:
            _build_state_after_build(layer)
    return model


def _build_state_after_build(layer: _Float8Layer) -> None:
    """Give an unbuilt converted layer its FP8 state when it builds.

    Keras binds a layer's ``build`` at construction (an instance attribute wrapping the class's
    method), so the class swap alone would leave Dense's ``build`` in place: wrap that instance ``build``.
    """
    keras_build = layer.build

    def build(*args: Any, **kwargs: Any) -> None:
        keras_build(*args, **kwargs)
        if isinstance(layer, _Float8Layer) and "fp8_input_scale" not in layer.__dict__:
            with _compat.unlocked(layer):
                layer._fp8_build_state()

    build.__wrapped__ = keras_build  # type: ignore[attr-defined]
    layer.__dict__["build"] = build


def float8_layers(model: keras.layers.Layer) -> Iterator[tuple[str, _Float8Layer]]:
    """``(path, layer)`` for every FP8 layer under ``model`` (the model itself included), each once.

    Raises:
        mpx.UnsupportedTypeError: for a ``model`` that is not a Keras layer.
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")

    for path, layer in walk(model):
        if isinstance(layer, _Float8Layer):
            yield path, layer


def _block_recipe(model: keras.layers.Layer) -> BlockRecipe | None:
    """The one block recipe of ``model``'s block-scaled layers (None without any)."""
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    recipes = [layer.block_recipe for _, layer in block_layers(model)]
    return one_recipe(recipes, "block-scaled layers") if recipes else None  # type: ignore[return-value]


def _recipe_of(model: keras.layers.Layer) -> tuple[Float8Recipe, list[tuple[str, _Float8Layer]]]:
    layers = [(path, layer) for path, layer in float8_layers(model)]
    unbuilt = [path or layer.name for path, layer in layers if not layer.built]
    if unbuilt:
        raise StateDictError(
            f"layer {unbuilt[0]!r}: not built yet, so it has no FP8 state; build the model first"
        )
    return one_recipe((layer.fp8_recipe for _, layer in layers), "FP8 layers"), layers


def float8_state_dict(model: keras.layers.Layer) -> dict[str, Any]:
    """``model``'s FP8 state as the neutral JSON-safe ``mpx.float8/1`` dict (a host read).

    Tensor names are ``"<layer path>.input"``, ``".weight"`` and ``".grad"``, the names
    ``mpx_torch.float8`` and ``mpx_jax.float8_flax`` use for modules at the same paths.

    A model whose layers are block-scaled (:mod:`mpx_keras.blocks`, one recipe) gets the stateless dict
    of its block recipe (no tensors), the dict ``mpx_torch`` and ``mpx_jax`` write for theirs.

    Raises:
        mpx.StateDictError: when the FP8 layers use different recipes or one is not built.
    """
    block = _block_recipe(model)
    if block is not None and not any(True for _ in float8_layers(model)):
        return _core_state_dict(block, Float8State({}))
    recipe, layers = _recipe_of(model)
    tensors = {}
    for path, layer in layers:
        values: dict[str, dict[str, Any]] = {role: {} for role in ROLES}
        for role, kind, var in layer.fp8_variables():
            values[role][kind] = np.asarray(ops.convert_to_numpy(var.value), np.float32)
        for role in ROLES:
            hist = values[role].get("amax_history", np.zeros((0,), np.float32))
            scale = float(values[role]["scale"])
            if recipe.scaling == "delayed":  # the variable holds the last step's scale: the next one is
                window = kernel.window(NUMPY_OPS, recipe, hist)
                scale = float(kernel.compute_scale(NUMPY_OPS, recipe, window, recipe.format_of(role), scale))
            tensors[tensor_key(path, role)] = TensorScale(role, scale, tuple(float(v) for v in hist))
    return _core_state_dict(recipe, Float8State(tensors))


def load_float8_state_dict(model: keras.layers.Layer, state_dict: Mapping[str, Any]) -> None:
    """Load an ``mpx.float8/1`` dict (from any backend) into ``model``'s FP8 layers, in place.

    Every field is validated (:func:`mpx.float8.load_state_dict`); the recipe must equal the layers'
    and the tensor names must be exactly theirs.  All or nothing.  Under delayed scaling the next step
    quantizes with the scale its history gives (the dict's, for any dict :func:`mpx.float8.float8_update`
    wrote; an all-zero history keeps the dict's scale).

    Raises:
        mpx.StateDictError: naming the bad field; nothing changes.
    """
    recipe, state = _core_load(state_dict)
    block = _block_recipe(model)
    if isinstance(recipe, BlockRecipe) or (block is not None and not any(True for _ in float8_layers(model))):
        if recipe != block:
            raise StateDictError(
                f"recipe: the state dict's recipe ({getattr(recipe, 'name', None) or recipe}) differs from "
                f"the model's block recipe ({block.name if block is not None else 'none'})."
            )
        return
    own, layers = _recipe_of(model)
    check_model_state(recipe, state, own if layers else None, [path for path, _ in layers])
    for path, layer in layers:
        for role, kind, var in layer.fp8_variables():
            ts = state.tensors[tensor_key(path, role)]
            value = ts.scale if kind == "scale" else ts.amax_history
            var.assign(np.asarray(value, np.float32))
