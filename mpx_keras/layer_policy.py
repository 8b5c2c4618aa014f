"""What a Keras layer whose dtype policy has an ``mpx:`` name does when it is called, carried by the layer.

An ``mpx:`` name (:mod:`mpx_keras.dtype_policy`) says more than Keras's dtype
policies: the layer's autocast flag, the dtype its outputs are cast to, and
that its ``call`` runs under the mpx op table (the dispatch of
:mod:`mpx_keras.autocast` is held while a lowering layer's ``call`` runs).
Keras offers per-layer means for each, and mpx uses only those:

* :class:`LayerPolicy`, the ``keras.DTypePolicy`` of an ``mpx:`` name: its
  ``convert_input`` (Keras's per-policy input hook) applies the name's autocast
  flag to the layer's inputs;
* a per-instance wrapper of the layer's ``call`` and ``compute_output_spec``
  (:func:`bind`, as :func:`mpx_keras.apply_policy` wraps a model's ``call``):
  it holds the op table's dispatch while the ``call`` runs, casts the outputs,
  sets the layer's ``autocast`` attribute from the name, resolves the entries
  of a keras-hub Backbone's ``DTypePolicyMap`` for its layers that never get a
  path, and binds the layers under it before they are first called.

:func:`mpx_keras.apply_policy` binds the layers it names.  A layer Keras
rebuilds from an ``mpx:`` name (``keras.models.load_model``) is bound when Keras
first calls it: Keras reads its policy's ``quantization_mode`` just before it
looks up ``layer.call`` (``Operation.__call__``), inside the layer's name scope,
and :class:`LayerPolicy` binds the layer there (a layer holding a keras-hub
``DTypePolicyMap`` reads it from the map's entry or default, a ``LayerPolicy``
too).  ``keras.layers.Layer`` itself is never changed.

What mpx_keras installs in Keras, the one exception, is documented and undone by
:func:`uninstall`: at import (:func:`install`), Keras's dtype-policy name parser (the
private ``_parse_name`` of ``keras.DTypePolicy``, reached through :mod:`mpx_keras._compat`)
learns ``mpx:`` names and makes a ``DTypePolicy`` Keras builds from one a
:class:`LayerPolicy` (Keras 3.15's ``Operation.from_config``,
keras/src/ops/operation.py:349-354, turns every saved policy that is neither a
``DTypePolicyMap`` nor quantized back into its name, and the layer builds
``DTypePolicy(name)``); and mpx's classes are registered with Keras's
serialization (``keras.saving.register_keras_serializable``: the
LossScaleOptimizers, the FP8 layers, :class:`LayerPolicy`).  The op table's
dispatch is installed only while a policy holds it (:mod:`mpx_keras.autocast`).
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from mpx.errors import MPXError
from mpx_keras import _compat
from mpx_keras.autocast import holds, layer_hold
from mpx_keras.dtype_policy import (
    NAME_PREFIX,
    LayerChoices,
    cast_output,
    choices_of,
    is_backbone,
    parse_name,
    pathless_key,
)

__all__ = ["LayerPolicy", "bind", "clear_output", "install", "installed", "uninstall"]

_Map = keras.dtype_policies.DTypePolicyMap
#: The keys a bound layer holds in its ``__dict__`` (untracked, never saved).
_BOUND = "_mpx_bound"  # the instance ``call``/``compute_output_spec`` it had before, if any
_OUTPUT = "_mpx_output"  # apply_policy's output dtype for its model (also without an mpx name of its own)
#: The packages whose registered classes :func:`uninstall` takes back from Keras's serialization.
_PACKAGES = ("mpx_keras>", "mpx_tf>")


@keras.saving.register_keras_serializable(package="mpx_keras")
class LayerPolicy(_compat.ParsingDTypePolicy):
    """The Keras dtype policy of an ``mpx:`` name (:mod:`mpx_keras.dtype_policy`); ``LayerPolicy(name)``.

    Its compute and variable dtypes are the name's policy's; ``convert_input`` casts a layer's
    floating inputs to the compute dtype as the name's ``autocast`` says (as Keras does with the
    layer's own flag when the name has none).  Keras reads ``quantization_mode`` (always None) when
    it calls a layer: there the policy binds the layer (:func:`bind`) if it holds this policy.
    """

    def parse(self, name: Any) -> tuple[str, str] | None:
        """``(compute dtype, variable dtype)`` of an ``mpx:`` name; None for any other name (Keras's)."""
        if isinstance(name, str) and name.startswith(NAME_PREFIX):
            policy = parse_name(name).policy
            return policy.compute_dtype, policy.param_dtype
        return None

    @property
    def choices(self) -> LayerChoices | None:
        """The choices the name holds (None for a name without the ``mpx:`` prefix)."""
        return choices_of(self)

    def convert_input(self, x: Any, autocast: bool, dtype: Any) -> Any:
        choices = self.choices
        if choices is not None and choices.autocast is not None:
            autocast = choices.autocast
        return super().convert_input(x, autocast, dtype)

    @property
    def quantization_mode(self) -> None:
        entries = _compat.name_scope_stack()
        caller = getattr(entries[-1], "caller", None) if entries else None
        if isinstance(caller, keras.layers.Layer) and _BOUND not in caller.__dict__ and _holds(caller, self):
            if _compat.compiling():  # dynamo would trace the binding (new per-instance methods): refused
                raise MPXError(
                    f"layer {caller.path or caller.name!r} (mpx policy {self.name!r}) is called for the first "
                    "time under torch.compile: call the model once eagerly (or build it with Keras's fit, "
                    "evaluate or predict) before compiling it, so mpx binds its layers outside the trace."
                )
            bind(caller, here=_path_below(caller, entries))
        return None


def _holds(layer: keras.layers.Layer, policy: keras.DTypePolicy) -> bool:
    """Whether ``layer`` computes with ``policy``: holds it, or holds a map with it as an entry or default."""
    own = layer.__dict__.get("_dtype_policy")
    if own is policy:
        return True
    return isinstance(own, _Map) and (own.default_policy is policy or any(own[k] is policy for k in own))


def _path_below(layer: keras.layers.Layer, entries: list[Any]) -> str:
    """The name-scope path the layer is called under (its own scope, the top entry, left out)."""
    parts: list[str] = []
    for entry in entries[:-1] if entries and entries[-1].caller is layer else entries:
        if entry.override_parent is not None:
            parts = [p for p in entry.override_parent.split("/") if p]
        parts.append(entry.name)
    return "/".join(parts)


def _gets_no_path(layer: keras.layers.Layer) -> bool:
    """Whether Keras will never give ``layer`` a path (it has none, and is built or has no ``build``)."""
    return not layer.path and (layer.built or type(layer).build is keras.layers.Layer.build)


def _resolve(layer: keras.layers.Layer, parent_path: str | None) -> None:
    """A layer that holds a keras-hub Backbone's map and never gets a path (Keras resolves a map by path
    only): its entry at its caller's path (:func:`mpx_keras.dtype_policy.pathless_key`) becomes its own."""
    policy_map = layer.__dict__.get("_dtype_policy")
    if isinstance(policy_map, _Map) and _gets_no_path(layer):
        key = pathless_key(parent_path, layer)
        if key is not None and key in policy_map:
            layer.dtype_policy = policy_map[key]  # a layer without a path holds it as its own


def _choices(layer: keras.layers.Layer) -> LayerChoices | None:
    policy = layer.__dict__.get("_dtype_policy")
    if isinstance(policy, _Map):
        policy = policy[layer.path] if layer.path else policy.default_policy
    return choices_of(policy)


def bind(layer: keras.layers.Layer, *, here: str | None = None, output: str | None = None) -> None:
    """Give ``layer`` and every layer under it that has an ``mpx:`` name (its own or its map entry) the
    per-instance ``call`` and ``compute_output_spec`` wrappers (idempotent; the choices are read at each
    call, so a layer keeps following its current policy).

    Args:
        layer: a Keras layer.
        here: the path the layer is called under, for a layer without a path holding a map (default
            None: the map's default).
        output: keyword only; the dtype every floating output of ``layer`` is cast to, whatever its
            policy (:func:`mpx_keras.apply_policy`'s model output dtype); None: none.
    """
    if output is not None:
        layer.__dict__[_OUTPUT] = output
    stack = [(layer, here)]
    while stack:
        current, parent_path = stack.pop()
        _resolve(current, parent_path)
        if _choices(current) is not None or _OUTPUT in current.__dict__:
            _wrap(current)
        below = "" if is_backbone(current) else (current.path or parent_path)
        stack.extend((child, below) for child in _compat.child_layers(current))


def clear_output(layer: keras.layers.Layer) -> None:
    """Forget the output dtype :func:`bind` was given for ``layer`` (it is no longer a model's root)."""
    layer.__dict__.pop(_OUTPUT, None)


def _wrap(layer: keras.layers.Layer) -> None:
    if _BOUND in layer.__dict__:
        return
    choices = _choices(layer)
    if choices is not None and choices.autocast is not None and layer.autocast is not choices.autocast:
        layer.autocast = choices.autocast  # before its first call: Keras's autocast scope reads it too
    previous = (layer.__dict__.get("call"), layer.__dict__.get("compute_output_spec"))
    call = _wrapped(layer, "call", _cast_value)
    spec = _wrapped(layer, "compute_output_spec", _cast_spec)
    layer.__dict__["call"], layer.__dict__["compute_output_spec"] = call, spec
    layer.__dict__[_BOUND] = previous


def _wrapped(layer: keras.layers.Layer, name: str, cast: Any) -> Any:
    """The instance attribute ``name`` of ``layer``: :func:`_run` of the original, the method of the layer's
    class now (an FP8 conversion changes the class) or an earlier instance attribute."""
    earlier = layer.__dict__.get(name)
    original = earlier if earlier is not None else getattr(type(layer), name).__get__(layer)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # the class's function with the layer as a partial, not ``__get__``: dynamo binds that to the
        # instance attribute (this wrapper), and recursed
        fn = earlier if earlier is not None else functools.partial(getattr(type(layer), name), layer)
        return _run(layer, fn, args, kwargs, cast)

    return wrapper


def _output_dtype(layer: keras.layers.Layer, choices: LayerChoices | None) -> str | None:
    """The dtype ``layer``'s outputs are cast to in this call, or None."""
    explicit = layer.__dict__.get(_OUTPUT)
    if explicit is not None or choices is None:
        return explicit
    if choices.output is not None:
        return choices.output
    if choices.model_output is not None:  # only inside another layer (a loaded model saves no dtype)
        entries = _compat.name_scope_stack()
        own = [i for i, entry in enumerate(entries) if entry.caller is layer]
        if own and own[-1] > 0:
            return choices.model_output
    return None


def _cast_value(x: Any, dtype: str) -> Any:
    return x if isinstance(x, keras.KerasTensor) else cast_output(x, dtype)


def _cast_spec(x: Any, dtype: str) -> Any:
    if isinstance(x, keras.KerasTensor) and keras.backend.is_float_dtype(x.dtype) and x.dtype != dtype:
        return keras.KerasTensor(x.shape, dtype=dtype, sparse=x.sparse, ragged=x.ragged)
    return x


def _run(layer: keras.layers.Layer, fn: Any, args: tuple, kwargs: dict, cast: Any) -> Any:
    """``fn(*args, **kwargs)`` (the layer's ``call`` or ``compute_output_spec``) as the layer's name says:
    its autocast flag set, the op table's dispatch held, the outputs cast with ``cast(x, dtype)``."""
    choices = _choices(layer)
    if choices is not None and choices.autocast is not None and layer.autocast is not choices.autocast:
        layer.autocast = choices.autocast
    release = layer_hold(choices) if choices is not None else None
    try:
        outputs = fn(*args, **kwargs)
    finally:
        if release is not None:
            release()
    dtype = _output_dtype(layer, choices)
    return outputs if dtype is None else keras.tree.map_structure(lambda x: cast(x, dtype), outputs)


# -- the one install: Keras's parser of dtype-policy names -------------------------------------------
_KERAS_PARSE: Any = None
_REGISTERED: dict[str, Any] = {}


def _read_mpx_names(self: keras.DTypePolicy, name: Any) -> tuple[str, str]:
    """Keras's name parser, installed: ``mpx:`` names are mpx's, every other name Keras's."""
    found = LayerPolicy.parse(self, name)  # type: ignore[arg-type]
    if found is None:
        return _KERAS_PARSE(self, name)
    if type(self) in (keras.DTypePolicy, keras.dtype_policies.FloatDTypePolicy):
        self.__class__ = LayerPolicy  # the object Keras builds from a saved mpx: name
    return found


def installed() -> bool:
    """Whether Keras's dtype-policy parser reads ``mpx:`` names now (:func:`install`)."""
    return _compat.dtype_policy_parse_name() is _read_mpx_names


def install() -> None:
    """Teach Keras's dtype-policy name parser the ``mpx:`` names and register mpx's classes with Keras's
    serialization (done at import; again after :func:`uninstall`).  Idempotent."""
    global _KERAS_PARSE
    if not installed():
        _KERAS_PARSE = _compat.dtype_policy_parse_name()
        _compat.set_dtype_policy_parse_name(_read_mpx_names)
    objects = keras.saving.get_custom_objects()
    for name, cls in _REGISTERED.items():
        objects.setdefault(name, cls)
        _compat.REGISTERED_CLASS_NAMES.setdefault(cls, name)
    _REGISTERED.clear()


def uninstall() -> None:
    """Undo everything mpx_keras (and mpx_tf) installed in Keras: Keras's own dtype-policy name parser
    back, mpx's classes out of Keras's serialization registry.  Layers keep their policies and wrappers
    (per instance); Keras can no longer build a policy from an ``mpx:`` name, nor load a file naming
    mpx's classes, until :func:`install`.

    Raises:
        MPXError: while a policy holds the op table's dispatch (leave the scopes, or
            ``set_global_policy("float32")``, first).
    """
    if holds():
        raise MPXError(
            f"mpx_keras.uninstall(): {holds()} policy scope(s) hold the op table's dispatch; leave them "
            "(or set_global_policy('float32')) first"
        )
    if installed():
        _compat.set_dtype_policy_parse_name(_KERAS_PARSE)
    objects = keras.saving.get_custom_objects()
    for name in [n for n in objects if n.startswith(_PACKAGES)]:
        cls = objects.pop(name)
        _REGISTERED[name] = cls
        _compat.REGISTERED_CLASS_NAMES.pop(cls, None)
