"""The mpx op table for functional Keras code on every Keras backend: ``keras.ops``, ``keras.losses``.

Keras chooses dtypes per layer, not per op: a custom layer that calls
``keras.ops.softmax`` on float16 inputs gets a float16 softmax whatever the
policy says.  :func:`autocast` is a scope in which the public ``keras.ops.*``
and ``keras.losses.*`` functions follow :data:`mpx.OP_TABLE`, on Keras's
TensorFlow, JAX and PyTorch backends alike:

- LOWER ops (matmul, einsum, conv, attention) compute in the compute dtype;
- FLOAT32 ops (softmax, norms, losses, exp/log/pow, reductions, cumsum,
  logsumexp) cast half-precision inputs to float32 and return float32;
- PROMOTE ops (add, multiply, concatenate, stack, where) return the widest
  floating input; PASSTHROUGH ops are not touched.

(:mod:`mpx_tf.autocast` adds the matching ``tf.*``, ``tf.math.*``, ``tf.nn.*``
and ``tf.linalg.*`` functions on TensorFlow, through :func:`register_targets`.)

The mechanism is Python-level dispatch, installed only while a policy needs
it: importing mpx_keras replaces nothing.  While at least one *hold* is taken
(an :func:`autocast` or :func:`mpx_keras.policy_scope` scope of a policy that
lowers precision or forces float32, :func:`mpx_keras.set_global_policy` of such
a policy in some thread, or the ``call`` of a layer
:func:`mpx_keras.apply_policy` gave a lowering policy), those public functions
are replaced in their namespaces by thin wrappers; when the last hold is given
back (on scope exit, errors too; reference-counted under a lock, so threads
share one install) every original is put back and each of them is again
identical (``is``) to Keras's own.  Wrappers only run in Python: inside a
traced step (``tf.function``, ``jax.jit``, and so ``model.fit`` on TensorFlow
and JAX) they run once, at trace time, and the traced program holds nothing
but the casts.  On torch, ``fit`` runs the step eagerly, and each call goes
through the wrapper; under ``torch.compile`` (``jit_compile=True``) dynamo
traces the wrappers as jax.jit does, the choices made at trace time (no graph
break of mpx's: which code calls an op is read from the frames dynamo traces,
the hold is taken outside the trace, under the lock).  Compiled code guards on
the wrappers, so a hold taken by a trace outside every scope stays (one per
process) until :func:`release_compiled`.  Call a model once eagerly before
compiling it: a layer mpx binds at its first call cannot be bound in a trace.
A function reference taken before the scope (``from keras.ops import
softmax`` at import) is Keras's own and never follows the table: call
``keras.ops.softmax`` (looked up at the call), or decorate your own function
with :func:`autocast_op`.

Which calls follow the table: **user code only**
(:func:`mpx_keras._user_code.from_user_code`).  A call is user code when the
first frame above the op (looking through at most
:data:`MAX_TRACING_FRAMES` frames of AutoGraph, ``tf.function`` or dynamo) is
from a file that belongs to no installed library: not a module of
:data:`LIBRARY_PACKAGES` (Keras, TensorFlow, JAX, torch, keras-hub...), not
under a ``site-packages``/``dist-packages`` directory or the standard library,
and not mpx's own packages.  Code typed in (``<stdin>``, doctests, notebooks)
is user code.  So a library layer's explicit dtype choices survive the op
table: keras-hub's attention matmuls compute in the layer's compute dtype as
natively, and Llama's float32 rotary embedding stays float32, even inside a
layer given an mpx policy.

Which policy applies, innermost first:

1. the innermost Keras layer being called, if :func:`mpx_keras.apply_policy`
   gave it its mpx policy (so any layer's ``call`` follows the table, even
   after ``keras.models.load_model``);
2. the innermost :func:`autocast` scope;
3. the policy set by :func:`mpx_keras.set_global_policy` (while Keras's global
   policy is still the one it set), except inside a layer whose compute
   dtype differs from it (a layer created with ``dtype="float32"``).

Each of them comes with its op table (``op_table=`` of :func:`autocast`,
:func:`mpx_keras.policy_scope`, :func:`mpx_keras.set_global_policy`,
:func:`mpx_keras.apply_policy`; default :data:`mpx.OP_TABLE`).

A policy whose compute dtype is not half precision changes nothing, except
in a float32 scope nested in a mixed one (an :func:`autocast` or
:func:`mpx_keras.policy_scope` of such a policy entered where a lowering
policy is in force): there it forces float32, as a float32 region in every
mpx backend: LOWER and FLOAT32 ops compute half inputs in float32 (PROMOTE
ops still take the widest input).  The choice is made at trace time: a step
traced under one policy keeps its casts when later called under another
(trace it again to change them).

>>> import keras
>>> x = keras.ops.ones((2, 3), dtype="float16")
>>> dtype = keras.backend.standardize_dtype
>>> with autocast("mixed_float16"):
...     dtype(keras.ops.softmax(x).dtype), dtype(keras.ops.matmul(x, keras.ops.ones((3, 2))).dtype)
('float32', 'float16')
>>> dtype(keras.ops.softmax(x).dtype)
'float16'
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import keras

import mpx
from mpx.errors import MPXError
from mpx.ops import OpClass, OpTable
from mpx_keras import _compat
from mpx_keras._holds import acquire, hold_for_compiled_code, holds, release, release_compiled, set_install
from mpx_keras._holds import lock as _lock
from mpx_keras._rule import Rule, active_global_rule, check_op_table
from mpx_keras._user_code import LIBRARY_PACKAGES, MAX_TRACING_FRAMES, file_is_user_code, from_user_code
from mpx_keras.dtype_policy import LayerChoices, choices_of

__all__ = [
    "KERAS_OPS",
    "LAYER_TABLE",
    "LIBRARY_PACKAGES",
    "LOSS_FUNCTIONS",
    "MAX_TRACING_FRAMES",
    "Rule",
    "Target",
    "acquire",
    "active_rule",
    "autocast",
    "autocast_op",
    "check_op_table",
    "from_user_code",
    "hold",
    "holding",
    "holds",
    "layer_hold",
    "nested_rule",
    "register_targets",
    "release",
    "release_compiled",
    "wrapped_functions",
]

F = TypeVar("F", bound=Callable[..., Any])


_LOWER_KERAS = {
    "matmul": "matmul", "dot": "matmul", "tensordot": "matmul", "einsum": "einsum",
    "conv": "conv", "depthwise_conv": "conv", "separable_conv": "conv",
    "conv_transpose": "conv_transpose", "dot_product_attention": "attention",
}  # fmt: skip
_FLOAT32_KERAS = {
    "softmax": "softmax", "log_softmax": "log_softmax",
    "layer_normalization": "layer_norm", "rms_normalization": "rms_norm",
    "batch_normalization": "batch_norm", "moments": "mean",
    "exp": "exp", "expm1": "exp", "log": "log", "log1p": "log", "log2": "log", "log10": "log",
    "power": "pow", "sum": "sum", "mean": "mean", "var": "mean", "std": "mean",
    "cumsum": "cumsum", "prod": "prod", "cumprod": "prod", "logsumexp": "logsumexp", "norm": "vector_norm",
    "categorical_crossentropy": "cross_entropy", "sparse_categorical_crossentropy": "cross_entropy",
    "binary_crossentropy": "bce_with_logits",
}  # fmt: skip
_PROMOTE_KERAS = {"add": "add", "multiply": "mul", "concatenate": "cat", "stack": "stack", "where": "where"}

#: ``keras.ops`` function name -> canonical op (the same names in ``keras.ops.nn/numpy/linalg``).
KERAS_OPS: dict[str, str] = {**_LOWER_KERAS, **_FLOAT32_KERAS, **_PROMOTE_KERAS}

#: ``keras.losses`` function name -> canonical op (every loss is in the ``loss`` category).
LOSS_FUNCTIONS: dict[str, str] = {
    "categorical_crossentropy": "cross_entropy",
    "sparse_categorical_crossentropy": "cross_entropy",
    "categorical_focal_crossentropy": "cross_entropy",
    "binary_crossentropy": "bce_with_logits",
    "binary_focal_crossentropy": "bce_with_logits",
    **{
        name: "mse_loss"
        for name in (
            "mean_squared_error", "mean_absolute_error", "mean_absolute_percentage_error",
            "mean_squared_logarithmic_error", "huber", "log_cosh", "kl_divergence", "poisson",
            "hinge", "squared_hinge", "categorical_hinge", "cosine_similarity",
        )
    },
}  # fmt: skip

_HALF = frozenset({"float16", "bfloat16"})

_local = threading.local()


# -- installing the dispatch while a policy needs it ---------------------------------------------
#: (module, name, original, wrapper) of the functions replaced now; empty while no policy needs them.
_INSTALLED: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = []


def _needs_table(rule: Rule | None) -> bool:
    return rule is not None and (rule.policy.lowers_precision or rule.forced)


def hold(rule: Rule | None) -> Callable[[], None]:
    """Install the dispatch while ``rule`` needs it (a lowering or forcing rule); returns its release.

    The release is idempotent.  The policies (``policy_scope``, ``set_global_policy``) and the
    ``call`` of layers with an mpx policy (:mod:`mpx_keras.layer_policy`) call this.
    """
    if not _needs_table(rule):
        return _no_release
    if _compat.compiling():
        hold_for_compiled_code()
        return _no_release
    acquire()
    done = False

    def give_back() -> None:
        nonlocal done
        if not done:
            done = True
            release()

    return give_back


def _no_release() -> None:
    return None


@_compat.at_trace_time
def _traced_from_user_code() -> bool:
    """:func:`from_user_code` while dynamo traces: the file of the frame it traces above the op's wrapper."""
    files = _compat.traced_files()
    return len(files) >= 2 and file_is_user_code(files[-2])


@contextlib.contextmanager
def holding(rule: Rule | None) -> Iterator[None]:
    """:func:`hold` for a ``with`` block (released on exit, errors too)."""
    give_back = hold(rule)
    try:
        yield
    finally:
        give_back()


def layer_hold(choices: LayerChoices) -> Callable[[], None]:
    """What a layer with an mpx policy holds while its ``call`` runs: the dispatch, when its policy lowers."""
    return hold(Rule(choices.policy, mpx.OP_TABLE))


def nested_rule(policy: mpx.Policy, table: OpTable) -> Rule:
    """The rule of a scope of ``policy`` entered here: it forces float32 when ``policy`` does not lower
    precision and the rule in force here (a layer's, a scope's or the global policy's) lowers or forces."""
    enclosing = active_rule()
    forced = (
        not policy.lowers_precision
        and enclosing is not None
        and (enclosing.policy.lowers_precision or enclosing.forced)
    )
    return Rule(policy, table, forced)


def _stack() -> list[tuple[Rule, int]]:
    """The autocast scopes of this thread: (rule, depth of Keras's name-scope stack at entry)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def autocast(policy: mpx.PolicySpec, *, op_table: OpTable | None = None) -> Iterator[mpx.Policy]:
    """A scope in which ``keras.ops`` and ``keras.losses`` functions of user code follow the op table.

    Works eagerly, around a traced step (``tf.function``, ``jax.jit``) and
    around ``model.fit`` (which traces, or on torch runs, its step inside the
    scope), on every Keras backend.  Nested scopes: the innermost wins; a
    float32 scope (a policy that does not lower precision) nested in a mixed
    one forces float32: LOWER and FLOAT32 ops compute half inputs in float32
    inside it, as a float32 region in every mpx backend.  Layers given an mpx
    policy by :func:`mpx_keras.apply_policy` use their own policy inside their
    ``call``.  Yields the mpx policy.

    Args:
        policy: the policy (or spec).
        op_table: keyword only; the op classes (default None: :data:`mpx.OP_TABLE`).
            Ops missing from it are left alone; ``OP_TABLE.replace(softmax="lower")``
            moves one op to another class.

    Raises:
        PolicyError: for a spec :func:`mpx.get_policy` cannot read.
        MPXError: for an ``op_table`` that is not an :class:`mpx.OpTable`.
    """
    p = mpx.get_policy(policy)
    table = check_op_table(op_table)
    rule = nested_rule(p, table)
    stack = _stack()
    give_back = hold(rule)
    stack.append((rule, len(_compat.name_scope_stack())))
    try:
        yield p
    finally:
        stack.pop()
        give_back()


def _innermost_layer() -> tuple[Any, int]:
    """The innermost Keras layer being called and its place in the name-scope stack; (None, -1) for none."""
    names = _compat.name_scope_stack()
    for index in range(len(names) - 1, -1, -1):
        caller = getattr(names[index], "caller", None)
        if isinstance(caller, keras.layers.Layer):
            return caller, index
    return None, -1


#: The attribute (in a layer's ``__dict__``, not tracked or saved) holding the op table
#: :func:`mpx_keras.apply_policy` was given, when it is not :data:`mpx.OP_TABLE`.
LAYER_TABLE = "_mpx_op_table"


def active_rule() -> Rule | None:
    """The rule in force at a call here: the innermost layer's mpx policy, else the innermost
    :func:`autocast` scope, else the global policy (see the module docs); None for none.

    An :func:`autocast` scope entered inside a layer's ``call`` is inner to that layer: it wins.
    """
    layer, index = _innermost_layer()
    stack = getattr(_local, "stack", None)
    if stack and stack[-1][1] > index:  # the scope was entered inside the layer's call
        return stack[-1][0]
    if layer is not None:
        own = choices_of(layer.dtype_policy, layer.path)
        if own is not None:
            return Rule(own.policy, layer.__dict__.get(LAYER_TABLE, mpx.OP_TABLE))
    if stack:
        return stack[-1][0]
    g = active_global_rule()
    if g is None or (layer is not None and layer.compute_dtype != g.policy.compute_dtype):
        return None
    return g


def _dtype_of(x: Any) -> str | None:
    """The floating dtype of a backend tensor, symbolic tensor or Keras variable; None for anything else."""
    if isinstance(x, (keras.KerasTensor, keras.Variable)) or keras.ops.is_tensor(x):
        dtype = keras.backend.standardize_dtype(x.dtype)
        return dtype if keras.backend.is_float_dtype(dtype) else None
    return None


def _cast(x: Any, dtype: str) -> Any:
    return keras.ops.cast(x, dtype)


def _map_tensors(fn: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def one(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(fn(v) for v in x)
        return fn(x)

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _retype(cls: OpClass, policy: mpx.Policy, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if cls is OpClass.PASSTHROUGH:
        return args, kwargs
    if cls is OpClass.LOWER:
        target = policy.compute_dtype

        def fn(x: Any) -> Any:
            d = _dtype_of(x)
            return _cast(x, target) if d in ("float32", *_HALF) and d != target else x

        return _map_tensors(fn, args, kwargs)
    if cls is OpClass.FLOAT32:
        return _map_tensors(lambda x: _cast(x, "float32") if _dtype_of(x) in _HALF else x, args, kwargs)
    dtypes: list[str] = []
    _map_tensors(lambda x: dtypes.append(d) if (d := _dtype_of(x)) else None, args, kwargs)
    if len(set(dtypes)) < 2:
        return args, kwargs
    widest = mpx.widest_dtype(dtypes)
    return _map_tensors(lambda x: _cast(x, widest) if _dtype_of(x) not in (None, widest) else x, args, kwargs)


@functools.lru_cache(maxsize=512)
def _op_class(op: str, rule: Rule) -> OpClass | None:
    """The class ``op`` follows under ``rule``; None: the call is left alone."""
    if op not in rule.table:
        return None
    if rule.forced:  # a float32 scope in a mixed one
        cls = rule.table[op]
        return OpClass.FLOAT32 if cls in (OpClass.LOWER, OpClass.FLOAT32) else cls
    if not rule.policy.lowers_precision:
        return None
    return rule.table.classify(op, rule.policy)


def _call(op: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    rule = active_rule()
    cls = None if rule is None else _op_class(op, rule)
    if cls is None or cls is OpClass.PASSTHROUGH:
        return original(*args, **kwargs)
    policy = rule.policy
    args, kwargs = _retype(cls, policy, args, kwargs)
    _local.depth = 1
    try:
        out = original(*args, **kwargs)
    finally:
        _local.depth = 0
    if cls is OpClass.LOWER:
        # Keras's matmul of float16 inputs computes and returns float32 on CPU (TF): round to the compute dtype
        target = policy.compute_dtype
        out = keras.tree.map_structure(lambda y: _cast(y, target) if _dtype_of(y) == "float32" else y, out)
    return out


# -- what is dispatched: Keras's functions, and what a backend package adds -----------------------
class Target(NamedTuple):
    """One public function the dispatch replaces while installed."""

    module: Any
    name: str
    #: the canonical op (an :data:`mpx.OP_TABLE` name)
    op: str
    #: its public dotted name, ``"keras.ops.softmax"``
    public: str


def _identity(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


#: Functions that list more targets (mpx_tf's ``tf.*``), and the decorator every wrapper gets.
_EXTRA_TARGETS: list[Callable[[], Iterable[Target]]] = []
_FINISH: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [_identity]


def register_targets(
    targets: Callable[[], Iterable[Target]],
    *,
    finish: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> None:
    """Add a backend's own functions to what the dispatch replaces (mpx_tf adds ``tf.*``, at its import).

    Args:
        targets: called once, at the next install: the :class:`Target` rows to add.
        finish: a decorator every wrapper gets from then on (mpx_tf: AutoGraph's ``do_not_convert``);
            default None: none.

    Raises:
        MPXError: while the dispatch is installed (register before any policy is in force).
    """
    with _lock:
        if holds():
            raise MPXError(
                "mpx_keras.autocast.register_targets() while the op table's dispatch is installed: "
                "register (import the backend package) before any mixed policy is in force."
            )
        if targets not in _EXTRA_TARGETS:
            _EXTRA_TARGETS.append(targets)
        if finish is not None:
            _FINISH[0] = finish
        _PLAN.clear()
        _targets.cache_clear()


def _wrap(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    mpx.OP_TABLE[op]  # an unknown op raises here

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "depth", 0):
            return original(*args, **kwargs)
        if not (_traced_from_user_code() if _compat.compiling() else from_user_code(1)):
            return original(*args, **kwargs)
        return _call(op, original, args, kwargs)

    wrapper._mpx_op = op  # type: ignore[attr-defined]
    wrapper._mpx_original = original  # type: ignore[attr-defined]
    return _FINISH[0](wrapper)


def autocast_op(op: str) -> Callable[[F], F]:
    """Make a function of yours follow the class of ``op`` in the op table (a decorator).

    For computations Keras has no function for (an NLL loss written by hand,
    say): under an active policy the function's floating tensor arguments are
    cast as ``op``'s class says, and mpx leaves the ``keras.ops`` calls inside
    it alone.

    >>> @autocast_op("nll_loss")
    ... def nll(log_probs, target):
    ...     picked = keras.ops.take_along_axis(log_probs, target[:, None], axis=-1)
    ...     return -keras.ops.mean(picked)

    Raises:
        MPXError: for an op the op table does not know.
    """
    if not isinstance(op, str) or op not in mpx.OP_TABLE:
        raise MPXError(f"op: {op!r} is not in the op table; known ops: {', '.join(sorted(mpx.OP_TABLE))}")

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(_local, "depth", 0):
                return fn(*args, **kwargs)
            return _call(op, fn, args, kwargs)

        wrapper._mpx_op = op  # type: ignore[attr-defined]
        return _FINISH[0](wrapper)  # type: ignore[return-value]

    return decorate


@functools.lru_cache(maxsize=1)
def _targets() -> tuple[Target, ...]:
    """Every function the dispatch replaces while installed: Keras's, then the registered ones."""
    found = []
    for path in ("ops", "ops.nn", "ops.numpy", "ops.linalg"):
        module = keras
        for part in path.split("."):
            module = getattr(module, part)
        found += [
            Target(module, n, op, f"keras.{path}.{n}") for n, op in KERAS_OPS.items() if hasattr(module, n)
        ]
    found += [
        Target(keras.losses, n, op, f"keras.losses.{n}")
        for n, op in LOSS_FUNCTIONS.items()
        if hasattr(keras.losses, n)
    ]
    for extra in _EXTRA_TARGETS:
        found += [Target(*t) for t in extra()]
    return tuple(found)


def _install_all() -> None:
    for entry in _plan():
        module, name, original, wrapper, op = entry
        current = getattr(module, name)
        if current is not original:  # replaced since the last install (by a user's monkeypatch): wrap theirs
            if getattr(current, "_mpx_op", None) is not None:
                continue
            original, wrapper = current, _wrap(current, op)
            entry[2:4] = original, wrapper
        setattr(module, name, wrapper)
        _INSTALLED.append((module, name, original, wrapper))


def _uninstall_all() -> None:
    for module, name, original, wrapper in _INSTALLED:
        if getattr(module, name, None) is wrapper:  # replaced by someone else meanwhile: theirs stays
            setattr(module, name, original)
    _INSTALLED.clear()


set_install(_install_all, _uninstall_all)


_PLAN: list[list[Any]] = []


def _plan() -> list[list[Any]]:
    """[module, name, original, wrapper, op] per dispatched function, the wrappers made once."""
    if not _PLAN:
        _PLAN.extend(
            [t.module, t.name, getattr(t.module, t.name), _wrap(getattr(t.module, t.name), t.op), t.op]
            for t in _targets()
        )
    return _PLAN


def wrapped_functions() -> list[str]:
    """The functions the dispatch replaces while a policy needs it, as ``"keras.ops.softmax"``."""
    return [t.public for t in _targets()]
