"""Every Keras internal mpx_keras uses, in one place, behind one version check.

mpx_keras reaches past Keras's public API in a few places: private optimizer
methods (the skip leaves overwrite-with-gradient variables alone, the
variables of a built optimizer), ``keras.src`` modules (the layer name-scope
stack, the dtype-policy name parser, the registry of Keras's public names,
masks, the functional model class).  Each is looked up here and nowhere else;
:mod:`mpx_tf._compat` adds TensorFlow's own on top of this module.

At import this module checks the installed Keras against the version mpx is
tested with (:func:`mpx.versions.require_version`).  A private name that is
missing raises :class:`mpx.FrameworkVersionError` from
:func:`mpx.versions.missing_internal`: the name, what mpx uses it for, and the
versions mpx supports.  Nothing falls back silently.  What a Keras *backend*
cannot do is not a version problem: that raises :func:`unsupported_on_backend`'s
:class:`mpx.MPXError`, naming the backend.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from mpx.errors import FrameworkVersionError, MPXError
from mpx.versions import missing_internal, require_version

__all__ = [
    "OPTIMIZER_METHODS",
    "OPTIMIZER_STATE",
    "ParsingDTypePolicy",
    "REGISTERED_CLASS_NAMES",
    "REGISTERED_NAMES_TO_OBJS",
    "AutocastScope",
    "StatelessScope",
    "backend",
    "check_optimizer",
    "at_trace_time",
    "child_layers",
    "compiling",
    "dtype_policy_parse_name",
    "get_keras_mask",
    "in_xla_context",
    "is_functional",
    "keras_history_operation",
    "missing",
    "name_scope_stack",
    "optimizer_member",
    "set_dtype_policy_parse_name",
    "set_keras_mask",
    "traced_files",
    "unlocked",
    "unsupported_on_backend",
    "untrack_variable",
]

require_version("keras", keras.__version__)


def backend() -> str:
    """The Keras backend this process runs: ``"tensorflow"``, ``"jax"`` or ``"torch"``."""
    return keras.config.backend()


def unsupported_on_backend(what: str, why: str) -> MPXError:
    """The error for something Keras's current backend cannot do (never a Keras-version error)."""
    return MPXError(f"{what} is not supported on Keras's {backend()!r} backend: {why}.")


def missing(framework: str, name: str, used_for: str) -> FrameworkVersionError:
    """The error for an internal ``name`` of ``framework`` (``"keras"`` here) this version lacks."""
    if framework == "torch":  # dynamo, on Keras's torch backend
        import torch

        return missing_internal(framework, torch.__version__, name, used_for)
    if framework != "keras":
        import tensorflow as tf  # only mpx_tf asks for TensorFlow's internals

        return missing_internal(framework, tf.__version__, name, used_for)
    return missing_internal(framework, keras.__version__, name, used_for)


def _module_attribute(framework: str, module: str, name: str, used_for: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(framework, f"{module}.{name}", used_for) from None


def _qualified_name(owner: Any) -> str:
    """``tensorflow`` for a module, ``keras.src...DTypePolicy`` for a class or an instance of it."""
    if inspect.ismodule(owner):
        return owner.__name__
    cls = owner if isinstance(owner, type) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}"


def _attribute(framework: str, owner: Any, path: str, used_for: str) -> Any:
    """``owner.<path>`` (a dotted path of attributes); :func:`missing` names ``owner`` and ``path``."""
    obj = owner
    for part in path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise missing(framework, f"{_qualified_name(owner)}.{path}", used_for) from None
    return obj


# -- modules: looked up at import ----------------------------------------------------------------
_global_state = _module_attribute(
    "keras", "keras.src.backend.common", "global_state", "the layer name-scope stack (which layer is calling)"
)
#: Keras's registry of its public names (``"keras.optimizers.LossScaleOptimizer"`` -> class).
REGISTERED_NAMES_TO_OBJS: dict[str, Any] = _module_attribute(
    "keras", "keras.src.api_export", "REGISTERED_NAMES_TO_OBJS", "load_model's LossScaleOptimizer swap"
)
#: Keras's registry of the names its serialization saves for registered classes (class -> ``"package>Name"``),
#: beside ``keras.saving.get_custom_objects()``: mpx_keras.uninstall() takes mpx's entries out of both.
REGISTERED_CLASS_NAMES: dict[Any, str] = _module_attribute(
    "keras", "keras.src.saving.object_registration", "GLOBAL_CUSTOM_NAMES", "mpx_keras.uninstall()"
)
_Functional = _module_attribute(
    "keras", "keras.src.models.functional", "Functional", "finding a functional model's output layers"
)
get_keras_mask: Callable[[Any], Any] = _module_attribute(
    "keras", "keras.src.backend", "get_keras_mask", "keeping a Keras mask on a cast output"
)
set_keras_mask: Callable[[Any, Any], None] = _module_attribute(
    "keras", "keras.src.backend", "set_keras_mask", "keeping a Keras mask on a cast output"
)
#: Keras's autocast scope: ``AutocastScope(None)`` reads variables in their own dtype inside a layer call.
AutocastScope: Any = _module_attribute(
    "keras", "keras.src.backend", "AutocastScope", "FP8 layers quantizing float32 master weights (mpx_keras.float8)"
)
#: Keras's scope mapping variables to values (the jax trainer's pure optimizer step).
StatelessScope: Any = _attribute(
    "keras", keras, "StatelessScope", "LossScaleOptimizer.stateless_apply (the jax trainer's pure step)"
)


def dtype_policy_parse_name() -> Callable[[Any, Any], tuple[str, str]]:
    """``keras.DTypePolicy._parse_name``: Keras's parser of dtype-policy names (mpx extends it)."""
    return _attribute("keras", keras.DTypePolicy, "_parse_name", "reading mpx: dtype-policy names")


def set_dtype_policy_parse_name(parse: Callable[[Any, Any], tuple[str, str]]) -> None:
    """Install ``parse`` as ``keras.DTypePolicy._parse_name`` (after :func:`dtype_policy_parse_name`)."""
    dtype_policy_parse_name()
    keras.DTypePolicy._parse_name = parse  # type: ignore[method-assign]


class ParsingDTypePolicy(keras.DTypePolicy):
    """A ``keras.DTypePolicy`` that reads names Keras does not: ``keras.DTypePolicy.__init__`` computes the
    dtypes with its private name parser, which this class hands to :meth:`parse` first (Keras's parser
    reads every name ``parse`` returns None for)."""

    def parse(self, name: Any) -> tuple[str, str] | None:
        """``(compute dtype, variable dtype)`` of a name this class reads, else None."""
        return None

    def _parse_name(self, name: Any) -> tuple[str, str]:
        found = self.parse(name)
        return found if found is not None else super()._parse_name(name)


dtype_policy_parse_name()  # checked at import: ParsingDTypePolicy and mpx_keras.install() need it


def name_scope_stack() -> list[Any]:
    """Keras's stack of active name scopes (each layer call pushes one whose ``caller`` is the layer)."""
    return _global_state.get_global_attribute("name_scope_stack") or []


def in_xla_context() -> bool:
    """Whether the code now being traced compiles with XLA on TensorFlow (``jit_compile=True``), where a
    step cannot call the host (TensorFlow's private ``control_flow_util.GraphOrParentsInXlaContext``)."""
    if backend() != "tensorflow":
        return False
    import tensorflow as tf

    in_xla = _module_attribute(
        "tensorflow",
        "tensorflow.python.ops.control_flow_util",
        "GraphOrParentsInXlaContext",
        "the stuck check of a jit_compile step (XLA cannot call the host)",
    )
    return bool(in_xla(tf.compat.v1.get_default_graph()))


def is_functional(model: Any) -> bool:
    """Whether ``model`` is a Keras functional model (its outputs come from layers of its graph)."""
    return isinstance(model, _Functional)


# -- layers ----------------------------------------------------------------------------------------
def child_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers directly under ``layer`` (Keras's private ``_flatten_layers``)."""
    flatten = _attribute("keras", layer, "_flatten_layers", "walking a model's layers (apply_policy, watch)")
    return list(flatten(include_self=False, recursive=False))


@contextlib.contextmanager
def unlocked(layer: keras.layers.Layer) -> Iterator[None]:
    """Let a built ``layer`` take new variables (Keras locks a layer's tracker after ``build``), then lock it again."""
    tracker = _attribute("keras", layer, "_tracker", "adding FP8 state to a built layer (mpx_keras.float8)")
    was_locked = tracker.locked
    tracker.unlock()
    try:
        yield
    finally:
        if was_locked:
            tracker.lock()


def untrack_variable(layer: keras.layers.Layer, variable: Any) -> None:
    """Take ``variable`` out of ``layer``'s variables (a block layer turned back into the plain layer)."""
    untrack = _attribute("keras", layer, "_untrack_variable", "turning a block-scaled layer back (mpx_keras.blocks)")
    untrack(variable)


def keras_history_operation(tensor: Any) -> Any:
    """The operation (layer) that produced a symbolic ``KerasTensor`` of a model's graph."""
    history = _attribute("keras", tensor, "_keras_history", "finding a functional model's output layers")
    return _attribute("keras", history, "operation", "finding a functional model's output layers")


# -- optimizers ------------------------------------------------------------------------------------
#: Private Keras optimizer methods mpx calls, and what for.  :func:`check_optimizer` checks them
#: all when a LossScaleOptimizer is built, so a Keras that changed one fails there.
OPTIMIZER_METHODS: dict[str, str] = {
    "_overwrite_variable_with_gradient": "LossScaleOptimizer leaving overwrite-with-gradient variables unscaled",
    "_get_variable_index": "the accumulation window's per-variable accumulators",
    "_clip_gradients": "the accumulation window's update (the inner optimizer's clipping)",
    "_apply_weight_decay": "the accumulation window's update (the inner optimizer's weight decay)",
    "_backend_update_step": "the accumulation window's update (the cross-replica sum and update_step)",
    "_all_reduce_sum_gradients": "reduce_dtype (the dtype of the cross-replica gradient sum)",
}
#: Private Keras optimizer state mpx reads, and what for (present once the optimizer is built).
OPTIMIZER_STATE: dict[str, str] = {
    "_iterations": "the accumulation window (micro-batch count, rewound on a skipped window)",
    "_accumulated_gradients": "the accumulation window (the gradients accumulated so far)",
    "_trainable_variables": "LossScaleOptimizer.apply without variables (the built optimizer's variables)",
}


def check_optimizer(optimizer: keras.optimizers.Optimizer, names: Sequence[str] | None = None) -> None:
    """Raise :class:`mpx.FrameworkVersionError` for the first of ``names`` (default every method) it lacks."""
    for name in OPTIMIZER_METHODS if names is None else names:
        if not hasattr(optimizer, name):
            raise missing("keras", f"keras.optimizers.Optimizer.{name}", _used_for(name))


def _used_for(name: str) -> str:
    return OPTIMIZER_METHODS.get(name) or OPTIMIZER_STATE[name]


def optimizer_member(optimizer: keras.optimizers.Optimizer, name: str) -> Any:
    """``optimizer.<name>`` for one of :data:`OPTIMIZER_METHODS` / :data:`OPTIMIZER_STATE`."""
    try:
        return getattr(optimizer, name)
    except AttributeError:
        raise missing("keras", f"keras.optimizers.Optimizer.{name}", _used_for(name)) from None


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The model variables a built Keras optimizer updates (Keras's private ``_trainable_variables``)."""
    return list(_attribute("keras", optimizer, "_trainable_variables", "reading an optimizer's variables (PolicyOptimizer)"))


def optimizer_variable_index(optimizer: Any, variable: Any) -> int:
    """The index of ``variable`` in a built Keras optimizer's slots (Keras's private ``_get_variable_index``)."""
    index = _attribute("keras", optimizer, "_get_variable_index", "finding an optimizer's slot (PolicyOptimizer)")
    return int(index(variable))


# -- torch.compile (dynamo) on Keras's torch backend ------------------------------------------------
def compiling() -> bool:
    """Whether dynamo is tracing this call now (``torch.compile``, ``jit_compile=True`` on Keras's torch backend);
    False on the other backends.  Dynamo reads it as the constant True while it traces."""
    if backend() != "torch":
        return False
    import torch

    return bool(torch.compiler.is_compiling())


def at_trace_time(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` to run for real (not traced) while dynamo traces, its result a constant of the graph
    (``torch.compiler.assume_constant_result``): for what dynamo cannot trace (a lock, Python's frames).
    ``fn`` must return a constant (a bool) and depend on nothing a guard would have to check."""
    if backend() != "torch":
        return fn
    import torch

    return _attribute("torch", torch, "compiler.assume_constant_result", "mpx_keras's trace-time bookkeeping")(fn)


def traced_files() -> list[str]:
    """The source files of the frames dynamo is tracing now, outermost first (the frames of the code it
    traces are not Python's frames: ``sys._getframe`` cannot see them); [] when it traces nothing.
    Call it from a function marked :func:`at_trace_time`."""
    guards = _module_attribute("torch", "torch._guards", "TracingContext", "which code calls an op under dynamo")
    return [frame.filename for frame in guards.extract_stack()]
