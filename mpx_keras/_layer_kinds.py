"""What mpx reads of a Keras layer: its category, the one op it computes, the walk of a model's layers.

A leaf module: :mod:`mpx_keras.policy` (``apply_policy``), :mod:`mpx_keras.float8` (``convert``) and
:mod:`mpx_keras.monitor` read layers through it, and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras

import mpx
from mpx_keras import _compat

__all__ = ["CATEGORY_LAYERS", "NORMALIZATION_LAYERS", "category_of", "op_of", "walk"]


def _classes(*names: str) -> tuple[type, ...]:
    return tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n))


#: Per category, the Keras layer classes in it: the core's one table (:data:`mpx.CATEGORY_CLASSES`,
#: ``"keras"``, below ``keras.layers``), resolved against this Keras.
CATEGORY_LAYERS: dict[str, tuple[type, ...]] = mpx.resolve_categories("keras", keras.layers)
#: Layer classes of the ``normalization`` category (those this Keras has).
NORMALIZATION_LAYERS: tuple[type, ...] = CATEGORY_LAYERS["normalization"]
_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


def _activation_name(fn: Any) -> str | None:
    if isinstance(fn, str):
        return fn
    try:
        name = keras.activations.serialize(fn)
    except Exception:
        return getattr(fn, "__name__", None)
    return name if isinstance(name, str) else getattr(fn, "__name__", None)


def category_of(layer: keras.layers.Layer) -> str | None:
    """The mpx category of a Keras layer: ``normalization``, ``softmax``, ``loss`` or None.

    The core's two rules (:func:`mpx.category_of`): a layer (class or instance)
    with an ``mpx_category`` attribute names its own category, for example a
    custom layer that computes a loss; otherwise the core's class table
    (:data:`CATEGORY_LAYERS`: the normalization layers, ``Softmax``).  One rule is
    Keras's own, as it depends on the instance: ``Activation("softmax" |
    "log_softmax")`` is ``softmax``.  A ``Dense(..., activation="softmax")`` is a
    Dense layer: its softmax runs in the compute dtype; use a separate
    ``Activation("softmax")`` layer to have mpx keep it in float32.

    Raises:
        PolicyError: for an ``mpx_category`` that is not a category.
    """
    category = mpx.category_of(layer, CATEGORY_LAYERS)
    if category is None and isinstance(layer, keras.layers.Activation):
        if _activation_name(layer.activation) in _SOFTMAX_ACTIVATIONS:
            return "softmax"
    return category


#: Keras layers that compute one canonical op of the mpx op table.
_LAYER_OPS: tuple[tuple[tuple[type, ...], str], ...] = (
    (_classes("ReLU"), "relu"),
    (_classes("MaxPooling1D", "MaxPooling2D", "MaxPooling3D"), "max_pool"),
    (_classes("Reshape", "Flatten"), "reshape"),
    (_classes("Permute"), "transpose"),
    (_classes("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D"), "dropout"),
    (_classes("Add"), "add"),
    (_classes("Multiply"), "mul"),
    (_classes("Concatenate"), "cat"),
)
_ACTIVATION_OPS = {"relu": "relu", "gelu": "gelu"}


def op_of(layer: keras.layers.Layer) -> str | None:
    """The canonical op (``mpx.OP_TABLE`` name) a layer computes, where it computes just one."""
    for classes, op in _LAYER_OPS:
        if classes and isinstance(layer, classes):
            return op
    if isinstance(layer, keras.layers.Activation):
        return _ACTIVATION_OPS.get(_activation_name(layer.activation) or "")
    return None


def walk(root: keras.layers.Layer) -> Iterator[tuple[str, keras.layers.Layer]]:
    """(dotted path, layer) for every layer under ``root``, each once, parents first."""
    seen: set[int] = set()
    stack: list[tuple[str, keras.layers.Layer]] = [("", root)]
    while stack:
        path, layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield path, layer
        kids = _compat.child_layers(layer)
        for child in reversed(kids):
            stack.append((f"{path}.{child.name}" if path else child.name, child))
