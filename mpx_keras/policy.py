"""mpx policies as Keras 3 dtype policies: the global policy, scopes, per-layer overrides.

Keras gives every layer one ``DTypePolicy`` (a compute dtype and a variable
dtype) and one global default.  An mpx policy says more: its overrides keep
normalization and softmax layers in float32 and its outputs come out in
``output_dtype``.  :func:`set_global_policy` and :func:`policy_scope` set the
Keras default from an mpx policy (so new layers take the compute and param
dtypes); :func:`apply_policy` walks a model and gives each layer the policy
that :meth:`mpx.Policy.for_module` picks for it, as an ``mpx:`` name
(:class:`mpx_keras.layer_policy.LayerPolicy`), and wraps each such layer's
``call`` on the instance (:func:`mpx_keras.layer_policy.bind`).  Nothing here
changes a Keras class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras

import mpx
from mpx.errors import MPXError, PolicyError, UnsupportedTypeError
from mpx_keras import _compat, _user_code
from mpx_keras._layer_kinds import CATEGORY_LAYERS, NORMALIZATION_LAYERS, category_of, op_of, walk
from mpx_keras._rule import GLOBAL, Rule, active_global_policy, active_global_rule, check_op_table
from mpx_keras.autocast import LAYER_TABLE, hold, nested_rule
from mpx_keras.blocks import convert as block_convert
from mpx_keras.dtype_policy import NAME_PREFIX, keep_in_config, mpx_name
from mpx_keras.float8 import convert as float8_convert
from mpx_keras.layer_policy import LayerPolicy, bind, clear_output

__all__ = [
    "CATEGORY_LAYERS",
    "LAYER_TABLE",
    "NORMALIZATION_LAYERS",
    "NAME_PREFIX",
    "Rule",
    "active_global_policy",
    "active_global_rule",
    "apply_policy",
    "category_of",
    "check_op_table",
    "get_global_policy",
    "keras_dtype_policy",
    "op_of",
    "policy_scope",
    "set_global_policy",
]


def keras_dtype_policy(policy: mpx.PolicySpec) -> keras.DTypePolicy:
    """The Keras ``DTypePolicy`` with the policy's compute dtype and param (variable) dtype.

    Keras's own names where it has one (``float32``, ``mixed_bfloat16``...),
    else ``"mpx:params=P,compute=C"``.

    >>> keras_dtype_policy("mixed_float16").name
    'mixed_float16'
    >>> keras_dtype_policy("bf16-true").name
    'bfloat16'
    >>> p = keras_dtype_policy("params=float16,compute=float32")
    >>> p.variable_dtype, p.compute_dtype
    ('float16', 'float32')
    """
    p = mpx.get_policy(policy)
    params, compute = p.param_dtype, p.compute_dtype
    if params == compute:
        return keras.DTypePolicy(params)
    if params == "float32" and compute in ("float16", "bfloat16"):
        return keras.DTypePolicy(f"mixed_{compute}")
    return keras.DTypePolicy(f"{NAME_PREFIX}params={params},compute={compute}")


#: Keras backend -> the backend name of mpx's slow-policy table (:func:`mpx.warn_if_slow`).
_ADVICE_BACKEND = {"tensorflow": "tf", "jax": "jax", "torch": "torch"}


def _device() -> str:
    """Where Keras computes: ``"gpu"`` when its backend sees a GPU, else ``"cpu"``."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    if backend == "jax":
        import jax

        return "gpu" if jax.default_backend() == "gpu" else "cpu"
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _warn_if_slow(policy: mpx.Policy, stacklevel: int) -> None:
    backend = _ADVICE_BACKEND.get(keras.config.backend())
    if backend is not None:
        mpx.warn_if_slow(backend, policy, _device(), stacklevel=stacklevel + 1)


# -- the global policy ------------------------------------------------------------
def set_global_policy(policy: mpx.PolicySpec, *, op_table: mpx.OpTable | None = None) -> mpx.Policy:
    """Make ``policy`` Keras's global dtype policy; returns the mpx policy.

    Layers created afterwards compute in the policy's compute dtype and keep
    their variables in its param dtype.  Per-layer overrides (norms and
    softmax in float32) and the output dtype need :func:`apply_policy` on
    the built model: Keras has no global hook for them.  User code's
    ``keras.ops``/``tf`` calls follow ``op_table`` (keyword only; default None:
    :data:`mpx.OP_TABLE`) under it, as in :func:`mpx_keras.autocast`.

    Raises:
        PolicyError: for a spec :func:`mpx.get_policy` cannot read.
        MPXError: for an ``op_table`` that is not an :class:`mpx.OpTable`.
    """
    p = mpx.get_policy(policy)
    table = check_op_table(op_table)
    _set_global(Rule(p, table), stacklevel=4)
    return p


def _set_global(rule: Rule, stacklevel: int) -> None:
    kp = keras_dtype_policy(rule.policy)
    _warn_if_slow(rule.policy, stacklevel)
    keras.config.set_dtype_policy(kp)
    GLOBAL.current = (rule, keras.config.dtype_policy())
    # this thread's global policy holds the op table's dispatch while it needs it (mpx_keras.autocast.hold)
    previous_release = getattr(GLOBAL, "release", None)
    GLOBAL.release = hold(rule)
    if previous_release is not None:
        previous_release()


def get_global_policy() -> mpx.Policy:
    """The mpx policy last set by :func:`set_global_policy`, or one read from Keras's global policy."""
    rule = active_global_rule()
    return _from_keras(keras.config.dtype_policy()) if rule is None else rule.policy


def _from_keras(kp: keras.DTypePolicy) -> mpx.Policy:
    if kp.name in mpx.PRESETS:
        return mpx.PRESETS[kp.name]
    try:
        return mpx.Policy(kp.variable_dtype, kp.compute_dtype, kp.variable_dtype)
    except MPXError as err:
        raise PolicyError(f"Keras's global dtype policy {kp.name!r} has no mpx equivalent: {err}") from None


@contextlib.contextmanager
def policy_scope(policy: mpx.PolicySpec, *, op_table: mpx.OpTable | None = None) -> Iterator[mpx.Policy]:
    """Set the global policy inside a ``with`` block, restoring the previous one on exit (errors too).

    ``op_table`` (keyword only; default None: :data:`mpx.OP_TABLE`) is the op
    table user code follows inside, as :func:`set_global_policy`'s.  A float32
    scope (a policy that does not lower precision) nested in a mixed one forces
    float32: new layers compute in float32, and LOWER and FLOAT32 ops of user
    code compute half inputs in float32, as in :func:`mpx_keras.autocast`.

    >>> with policy_scope("mixed_bfloat16") as p:
    ...     keras.layers.Dense(2).compute_dtype
    'bfloat16'
    >>> keras.config.dtype_policy().name
    'float32'
    """
    p = mpx.get_policy(policy)  # a bad spec or table raises before anything changes
    table = check_op_table(op_table)
    previous_keras = keras.config.dtype_policy()
    previous = getattr(GLOBAL, "current", None)
    previous_release, GLOBAL.release = getattr(GLOBAL, "release", None), None
    try:
        _set_global(nested_rule(p, table), stacklevel=5)
        yield p
    finally:
        keras.config.set_dtype_policy(previous_keras)
        GLOBAL.current = previous
        release, GLOBAL.release = getattr(GLOBAL, "release", None), previous_release
        if release is not None:
            release()


# -- per-layer policies -------------------------------------------------------------
def _own_float_variables(layer: keras.layers.Layer) -> list[Any]:
    below = {id(v) for child in _compat.child_layers(layer) for v in child.weights}
    return [
        v
        for v in layer.weights
        if id(v) not in below
        and keras.backend.is_float_dtype(keras.backend.standardize_dtype(v.dtype))
        and not getattr(v, "overwrite_with_gradient", False)  # FP8 state: float32 whatever the policy
    ]


def apply_policy(
    model: keras.layers.Layer,
    policy: mpx.PolicySpec | None = None,
    *,
    op_table: mpx.OpTable | None = None,
    seed: int = 0,
) -> keras.layers.Layer:
    """Give every layer of ``model`` its mpx policy; the model's outputs come out in ``output_dtype``.

    Each layer gets the Keras dtype policy of ``policy.for_module(path,
    category)``, where ``path`` joins the layer names from the model down
    (``"encoder.layer_norm"``) and ``category`` is :func:`category_of`.  So
    under ``mixed_float16`` a ``LayerNormalization`` computes in float32 (its
    float16 inputs cast up by Keras) while ``Dense`` computes in float16.
    Sequential, functional and subclassed models work, nested models too;
    the model is changed in place and returned.  Variables are never
    converted: a layer already built with variables of another dtype than
    the param dtype raises (create the model under :func:`policy_scope`).
    A keras-hub ``Backbone`` (saved as its constructor arguments and one
    dtype) gets a ``DTypePolicyMap`` of its layers' policies as that dtype, so
    ``keras.models.load_model`` restores them too
    (:func:`mpx_keras.dtype_policy.keep_in_config`).

    Args:
        model: a Keras model or layer (built or not).
        policy: a policy or spec; None uses :func:`get_global_policy`.
        op_table: keyword only; the op classes the layers follow (default None:
            :data:`mpx.OP_TABLE`): the autocast flag of layers that compute one op
            (``ReLU``, ``Add``...) and the op table of ``keras.ops``/``tf`` calls in
            every layer's ``call``.  It is kept on the layers, not saved: a model
            loaded with ``keras.models.load_model`` follows :data:`mpx.OP_TABLE`
            (call ``apply_policy`` again with the table).
        seed: keyword only (default 0): the seed of a block recipe's random bits (stochastic rounding
            and the Hadamard signs, ``nvfp4_te``), as ``mpx_torch.blocks.convert``'s; the block layers
            are indexed in model order (:mod:`mpx_keras.blocks`).

    Raises:
        PolicyError: for a bad spec, or a built layer whose variables are not
            in the param dtype the policy assigns it.
        UnsupportedTypeError: when ``model`` is not a Keras layer or model.
        MPXError: for an ``op_table`` that is not an :class:`mpx.OpTable`, or a ``seed`` that is not an int.
    """
    if not isinstance(model, keras.layers.Layer):
        raise UnsupportedTypeError(f"model: expected a Keras model or layer, got {type(model).__name__}.")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise mpx.MPXError(f"seed: {seed!r} is not allowed; allowed: a Python int")
    p = get_global_policy() if policy is None else mpx.get_policy(policy)
    table = check_op_table(op_table)
    _warn_if_slow(p, 3)
    outputs = {id(layer) for layer in _output_layers(model)}
    # The sublayers a library layer's own call consumes (the softmax and dropout of Keras's
    # MultiHeadAttention, the norms inside keras-hub's layers), each -> that library layer.  The library's
    # code around them expects their outputs in its compute dtype, as natively: the op table (the user's
    # code's) leaves their autocast to Keras, and a float32 category (norm, softmax) computes in float32
    # and hands its output back in the library layer's compute dtype (#24).
    internal: dict[int, keras.layers.Layer] = {}
    for path, layer in walk(model):
        graph = isinstance(layer, keras.Sequential) or _compat.is_functional(layer)
        library = type(layer).__module__.partition(".")[0] in _user_code.LIBRARY_PACKAGES
        if id(layer) in internal or (library and not graph):
            internal.update((id(child), layer) for child in _compat.child_layers(layer))
        if layer is not model:
            clear_output(layer)  # an earlier apply_policy's model, now inside this one
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if not keras.backend.is_float_dtype(layer.compute_dtype):
            continue  # integer / string preprocessing layers keep their dtype
        if layer.quantization_mode is not None:
            continue  # Keras's quantized policy (int8, float8...) stays: it says how its kernel is stored
        category = category_of(layer)
        lp = p.for_module(path, category)
        for v in _own_float_variables(layer):
            if keras.backend.standardize_dtype(v.dtype) != lp.param_dtype:
                raise PolicyError(
                    f"layer {path or layer.name!r}: its variable {v.path!r} is {v.dtype} but the policy "
                    f"stores params in {lp.param_dtype}; mpx does not convert built variables: "
                    "create the model under mpx_keras.policy_scope(policy) (or set_global_policy) first"
                )
        autocast = None
        if category is not None:
            # Keras's LayerNormalization turns autocast off and rounds its output
            # through the input dtype; with it on, Keras casts the half inputs
            # up to the layer's compute dtype before call().
            autocast = True
        op = op_of(layer)
        if (
            op is not None
            and op in table
            and id(layer) not in internal
            and table.classify(op, lp) in (mpx.OpClass.PASSTHROUGH, mpx.OpClass.PROMOTE)
        ):
            # Keras casts every layer's floating inputs to its compute dtype; the op
            # table says these ops keep their input dtype (or promote mixed inputs).
            autocast = False
        if autocast is not None:
            layer.autocast = autocast
        # The policy's name carries what Keras does not save (the mpx policy, the
        # autocast flag, the output dtype), so load_model restores all of it.
        output = p.output_dtype if layer is model else None
        if output is None and category is not None and id(layer) in internal:
            output = internal[id(layer)].compute_dtype  # back in the library layer's compute dtype
            output = None if output == lp.compute_dtype else output
        model_output = p.output_dtype if id(layer) in outputs else None
        layer.dtype_policy = LayerPolicy(mpx_name(lp, autocast, output, model_output))
        if table is mpx.OP_TABLE:
            layer.__dict__.pop(LAYER_TABLE, None)
        else:  # untracked: Keras neither tracks nor saves it
            layer.__dict__[LAYER_TABLE] = table
    # FP8 Dense/EinsumDense where fp8= names a per-tensor recipe (#26), block-scaled ones where it names a
    # block recipe (#31); blocks before and after, so a layer can move between the two kinds either way
    block_convert(model, p, op_table=table, seed=seed)
    float8_convert(model, p, op_table=table)
    block_convert(model, p, op_table=table, seed=seed)
    keep_in_config(model)  # a keras-hub Backbone saves them as its DTypePolicyMap (#24)
    # Keras has no forward hooks: each named layer's `call` is wrapped on the instance (its class, config
    # and saved file are untouched), the model's casting its outputs to the output dtype.
    bind(model, output=p.output_dtype)
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:  # traced under the old dtypes
            setattr(model, name, None)
    return model


def _output_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers whose outputs are a Sequential or functional model's outputs (Keras does not reload their root's dtype)."""
    if isinstance(model, keras.Sequential):
        return model.layers[-1:]
    if not _compat.is_functional(model):
        return []
    found = []
    for tensor in keras.tree.flatten(model.outputs):
        operation = _compat.keras_history_operation(tensor)
        if isinstance(operation, keras.layers.Layer):
            found.append(operation)
    return found
