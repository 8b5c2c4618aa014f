"""Keras dtype-policy names that carry a layer's mpx choices, so ``keras.models.load_model`` restores them.

Keras 3 saves a layer's dtype policy by name only (``Operation.from_config``
turns a saved ``DTypePolicy`` back into its name), does not save the layer's
``autocast`` flag, and a functional model's config has no dtype at all.  A
model given its policies by :func:`mpx_keras.apply_policy` would load computing
differently: a LayerNormalization rounding through float16 again, a GELU
computing in float16.

So :func:`mpx_keras.apply_policy` gives each layer a dtype policy whose name
says everything::

    mpx:params=float32,compute=float16,output=float32;autocast=off;model_output=float32

the layer's mpx policy (the op table in its ``call`` follows it), then
optionally its autocast choice (``on``: Keras casts floating inputs to the
compute dtype; ``off``: they keep theirs) and the dtype its outputs are cast
to (``output``, on the model) or cast to when they run inside another layer
(``model_output``, on the layers producing a Sequential or functional
model's outputs: Keras reloads those models without their own dtype).

This module reads and writes the names (:func:`mpx_name`, :func:`parse_name`,
:func:`choices_of`) and keeps a keras-hub Backbone's per-layer names in its
saved ``DTypePolicyMap`` (:func:`keep_in_config`).  What a layer with such a
name does when it is called, and the one thing mpx_keras installs in Keras
(the parser that builds a :class:`~mpx_keras.layer_policy.LayerPolicy` for an
``mpx:`` name), are :mod:`mpx_keras.layer_policy`'s.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any, NamedTuple

import keras

import mpx
from mpx.errors import PolicyError
from mpx_keras import _compat

__all__ = [
    "LayerChoices",
    "NAME_PREFIX",
    "cast_output",
    "choices_of",
    "is_backbone",
    "keep_in_config",
    "mpx_name",
    "parse_name",
    "pathless_key",
    "policy_of",
]

#: The prefix of the Keras dtype-policy names mpx adds.
NAME_PREFIX = "mpx:"
_AUTOCAST = {"on": True, "off": False}


class LayerChoices(NamedTuple):
    """What an mpx dtype-policy name says about a layer."""

    #: the layer's mpx policy
    policy: mpx.Policy
    #: its autocast flag, or None (the layer keeps its own)
    autocast: bool | None
    #: the dtype its outputs are cast to, or None
    output: str | None
    #: the dtype its outputs are cast to when it runs inside another layer (it produces a model's outputs)
    model_output: str | None = None


def mpx_name(
    policy: mpx.PolicySpec,
    autocast: bool | None = None,
    output: str | None = None,
    model_output: str | None = None,
) -> str:
    """The Keras dtype-policy name of a layer's mpx policy and choices (see :class:`LayerChoices`).

    >>> mpx_name("mixed_float16", autocast=False)
    'mpx:params=float32,compute=float16,output=float32;autocast=off'
    """
    name = NAME_PREFIX + str(mpx.get_policy(policy))
    if autocast is not None:
        name += ";autocast=" + ("on" if autocast else "off")
    if output is not None:
        name += ";output=" + mpx.canonical_dtype(output, field="output")
    if model_output is not None:
        name += ";model_output=" + mpx.canonical_dtype(model_output, field="model_output")
    return name


@functools.lru_cache(maxsize=1024)
def parse_name(name: str) -> LayerChoices:
    """The choices an ``"mpx:..."`` name holds.

    Raises:
        PolicyError: naming the part that is not a policy spec, ``autocast=on|off`` or ``output=DTYPE``.
    """
    if not name.startswith(NAME_PREFIX):
        raise PolicyError(f"dtype policy name {name!r}: expected it to start with {NAME_PREFIX!r}")
    spec, *extras = name[len(NAME_PREFIX) :].split(";")
    try:
        policy = mpx.get_policy(spec)
    except PolicyError as err:
        raise PolicyError(f"dtype policy name {name!r}: {err}") from None
    autocast = None
    outputs: dict[str, str] = {}
    for extra in extras:
        key, _, value = extra.partition("=")
        if key == "autocast" and value in _AUTOCAST:
            autocast = _AUTOCAST[value]
        elif key in ("output", "model_output"):
            try:
                outputs[key] = mpx.canonical_dtype(value, field=key)
            except mpx.MPXError as err:
                raise PolicyError(f"dtype policy name {name!r}: {err}") from None
        else:
            raise PolicyError(
                f"dtype policy name {name!r}: {extra!r} is not understood; "
                "allowed: autocast=on|off, output=DTYPE, model_output=DTYPE"
            )
    return LayerChoices(policy, autocast, outputs.get("output"), outputs.get("model_output"))


def choices_of(dtype_policy: Any, path: str | None = None) -> LayerChoices | None:
    """The mpx choices of a Keras dtype policy, or None for a policy without an mpx name.

    A ``DTypePolicyMap`` (what a layer rebuilt by a keras-hub Backbone holds) is read as Keras reads it:
    its entry for ``path`` (the layer's ``path``), else its default policy.
    """
    if isinstance(dtype_policy, keras.dtype_policies.DTypePolicyMap):
        dtype_policy = dtype_policy[path] if path else dtype_policy.default_policy
    name = getattr(dtype_policy, "name", None)  # None: a layer without a dtype policy
    if isinstance(name, str) and name.startswith(NAME_PREFIX):
        return parse_name(name)
    return None


def policy_of(layer: keras.layers.Layer) -> keras.DTypePolicy:
    """The dtype policy ``layer`` computes with: its own, or its entry in the ``DTypePolicyMap`` it holds
    (by ``layer.path``, else the map's default policy), as Keras resolves ``compute_dtype``."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


# -- keras-hub backbones: the per-layer policies saved as the backbone's DTypePolicyMap -----------------
# A keras-hub Backbone saves its constructor arguments and ONE dtype, and on load rebuilds every layer
# inside, passing that dtype to each; Keras resolves a layer holding a DTypePolicyMap by ``map[layer.path]``.
# So apply_policy gives the backbone a map of its layers' mpx policies.  Layers that are never built (no
# weights: Dropout, Softmax) have no path: their key is their caller's path and their name without Keras's
# numbering (``transformer_layer_0/self_attention/softmax``), resolved when their caller's `call` binds them
# (mpx_keras.layer_policy).
_NUMBERING = re.compile(r"_[0-9]+$")


def pathless_key(parent_path: str | None, layer: keras.layers.Layer) -> str | None:
    """The map key of a layer Keras never gives a path: its caller's path (``parent_path``; None: unknown,
    no key) and its name without Keras's numbering."""
    if parent_path is None:
        return None
    name = _NUMBERING.sub("", layer.name)
    return f"{parent_path}/{name}" if parent_path else name


def is_backbone(layer: keras.layers.Layer) -> bool:
    """Whether ``layer`` is a keras-hub Backbone (checked only when keras_hub is imported)."""
    keras_hub = sys.modules.get("keras_hub")
    backbone = getattr(getattr(keras_hub, "models", None), "Backbone", None)
    return isinstance(backbone, type) and isinstance(layer, backbone)


def keep_in_config(root: keras.layers.Layer) -> None:
    """Give every keras-hub Backbone under ``root`` (``root`` too) a ``DTypePolicyMap`` of its layers'
    mpx and quantized policies, so that its saved config, and the layers ``load_model`` rebuilds from it,
    keep them.  Nothing computes differently: the backbone's own policy is the map's default, each layer
    keeps the policy it holds (a layer already holding the map has its entry there).  A map the backbone
    already holds (quantized layers, a loaded backbone) gets entries added, none removed."""
    backbones, seen, todo = [], set(), [root]
    while todo:
        layer = todo.pop()
        if id(layer) not in seen:
            seen.add(id(layer))
            backbones += [layer] if is_backbone(layer) else []
            todo.extend(_compat.child_layers(layer))
    for backbone in backbones:
        entries: dict[str, keras.DTypePolicy] = {}
        clashes: set[str] = set()
        # its own layers are called (and built) when it is constructed: at the top, outside any scope
        stack = [("", child) for child in _compat.child_layers(backbone)]
        while stack:
            parent_path, layer = stack.pop()
            stack.extend((layer.path or parent_path, child) for child in _compat.child_layers(layer))
            key = layer.path or pathless_key(parent_path, layer)
            policy = policy_of(layer)
            if key is None or (choices_of(policy) is None and policy.quantization_mode is None):
                continue
            if key in entries and entries[key].name != policy.name:
                clashes.add(key)  # two unbuilt siblings with one key: both left to the default
            entries[key] = policy
        current = backbone.dtype_policy
        if isinstance(current, keras.dtype_policies.DTypePolicyMap):
            policy_map = current
        else:
            policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=current)
        for key, policy in entries.items():
            if key in clashes:
                continue
            if key in policy_map:
                del policy_map[key]
            policy_map[key] = policy
        if policy_map is not current:
            backbone.dtype_policy = policy_map


def cast_output(x: Any, dtype: str) -> Any:
    """``x`` cast to ``dtype`` when it is a floating tensor (its Keras mask kept)."""
    if isinstance(x, keras.KerasTensor):
        if keras.backend.is_float_dtype(x.dtype) and x.dtype != dtype:
            return keras.ops.cast(x, dtype)
        return x
    if isinstance(x, keras.Variable):
        x = x.value
    if not keras.ops.is_tensor(x):
        return x
    current = keras.backend.standardize_dtype(x.dtype)
    if keras.backend.is_float_dtype(current) and current != dtype:
        mask = _compat.get_keras_mask(x)
        y = keras.ops.cast(x, dtype)
        if mask is not None:
            _compat.set_keras_mask(y, mask)
        return y
    return x
