"""Diagnostics for JAX: the first equation that made a non-finite value, and gradient underflow statistics.

:func:`find_nonfinite` traces ``fn`` to a jaxpr and interprets it one
equation at a time on the given arguments, eagerly, checking every floating
output.  An equation whose floating inputs are all finite but whose output is
not is where non-finite values are *born*; the report names the first such
equation: its primitive, its source line, the name stack (a Flax module path
such as ``Model/boom``, or a ``jax.named_scope``), and whether it belongs to
the forward or the backward pass (a ``transpose`` in the name stack).  Call it
on a step the scaler skipped, with that step's arguments; it runs nothing
when unused and returns the report only: ``fn``'s own result is untouched.

>>> import jax.numpy as jnp
>>> report = find_nonfinite(lambda x: jnp.exp(x) * 2, jnp.array([1.0, 100.0]), log=False)
>>> report.first.detail
'exp, forward'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpx.diagnostics import (
    DiagnosticsError,
    NonfiniteReport,
    NonfiniteSite,
    UnderflowReport,
    build_underflow_report,
    check_scale,
    nonfinite_report,
)
from mpx.dtypes import canonical_dtype, dtype_info
from mpx_jax._compat import name_scopes, summarize_source
from mpx_jax._jaxpr import bind, eqn_context

__all__ = ["find_nonfinite", "underflow_stats"]

_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _where(eqn: Any) -> tuple[str, str | None, bool, str]:
    """(scope path, source line, backward?, raw name stack) of an equation."""
    info = eqn.source_info
    scopes, backward = [], False
    for kind, name in name_scopes(info):
        if kind == "Scope":
            scopes.append(name)
        elif kind == "Transform" and name == "transpose":
            backward = True
    source = summarize_source(info)
    return "/".join(scopes), source, backward, str(info.name_stack)


def _site(eqn: Any, value: Any, prefix: str) -> NonfiniteSite:
    path, source, backward, _ = _where(eqn)
    x = np.asarray(jax.device_get(value)).astype(np.float64)
    nan = int(np.isnan(x).sum())
    inf = int(np.isinf(x).sum())
    top = float(np.max(np.where(np.isnan(x), 0.0, np.abs(x)))) if x.size else 0.0
    name = "/".join(p for p in (prefix, path) if p) or eqn.primitive.name
    return NonfiniteSite("equation", name, top, nan, inf, str(value.dtype), source,
                         f"{eqn.primitive.name}, {'backward' if backward else 'forward'}")  # fmt: skip


def _sub_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The jaxpr and consts of a call-like equation (pjit, closed_call, remat, custom_jvp/vjp), else None."""
    name = eqn.primitive.name
    if name not in ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"):  # fmt: skip
        return None
    for key in _CALL_PARAMS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # ClosedJaxpr
            return sub.jaxpr, list(sub.consts)
        if hasattr(sub, "eqns"):
            return sub, []
    return None


class _Interpreter:
    def __init__(self) -> None:
        self.sites: list[NonfiniteSite] = []
        self.checked = 0

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any], prefix: str = "") -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if type(v).__name__ == "Literal" else env[v]

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = c
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            sub = _sub_jaxpr(eqn)
            if sub is not None and len(sub[0].invars) == len(invals):
                path, _, _, _ = _where(eqn)
                outs = self.run(sub[0], sub[1], invals, "/".join(p for p in (prefix, path) if p))
            else:
                with eqn_context(eqn):
                    outs = bind(eqn, invals)
                self._check(eqn, invals, outs, prefix)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _check(self, eqn: Any, invals: list[Any], outs: list[Any], prefix: str) -> None:
        floats = [o for o in outs if _is_float(o)]
        if not floats:
            return
        self.checked += 1
        bad = [o for o in floats if not bool(jnp.all(jnp.isfinite(o)))]
        if not bad:
            return
        if all(bool(jnp.all(jnp.isfinite(i))) for i in invals if _is_float(i)):
            self.sites.append(_site(eqn, bad[0], prefix))


def _scale_of(scaler: Any) -> float | None:
    """The loss scale of a :class:`mpx_jax.LossScale` (or anything with ``get_scale()``), a number or a
    0-d array, as a float; None for None."""
    if scaler is None:
        return None
    if hasattr(scaler, "get_scale"):
        return float(scaler.get_scale())
    return check_scale(np.asarray(jax.device_get(getattr(scaler, "loss_scale", scaler))))


def find_nonfinite(
    fn: Callable[..., Any], *args: Any, log: bool = True, scaler: Any = None, **kwargs: Any
) -> NonfiniteReport:
    """Run ``fn(*args, **kwargs)`` equation by equation and name the first that made a non-finite value.

    ``fn`` is any JAX-traceable function: a loss, ``jax.grad(loss)`` (its
    backward equations are checked too and marked ``backward``), or a whole
    training step.  Non-finite *inputs* are reported as the site ``input``.
    Each site of the report is an :class:`mpx.diagnostics.NonfiniteSite` of kind
    ``equation``: ``name`` is the name-stack path (Flax module path or
    ``jax.named_scope``; the primitive when there is none), ``source`` the
    ``file:line (function)`` of the equation, ``detail`` ``"<primitive>, forward"``
    or ``"<primitive>, backward"``.  Loops (``scan``, ``while``) and ``cond``
    run as one equation.  The evaluation is eager and slow (one host read per
    equation): use it on the failing step, not every step.  Logs one line.
    ``scaler`` (keyword, as ``watch``'s in the other backends: a
    :class:`mpx_jax.LossScale`, a number or a 0-d array; default None) puts
    the loss scale of the step in the report.  ``log`` and ``scaler`` are
    find_nonfinite's own keywords; every other keyword goes to ``fn``.
    """
    if not callable(fn):
        raise DiagnosticsError(f"fn: expected a callable, got {type(fn).__name__}")
    scale = _scale_of(scaler)
    closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    flat = jax.tree_util.tree_leaves(args)
    interp = _Interpreter()
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if _is_float(jnp.asarray(leaf)) and not bool(jnp.all(jnp.isfinite(leaf))):
            x = np.asarray(leaf, np.float64)
            top = float(np.max(np.where(np.isnan(x), 0.0, np.abs(x)))) if x.size else 0.0
            interp.sites.append(NonfiniteSite("equation", "input", top,
                                              int(np.isnan(x).sum()), int(np.isinf(x).sum()), str(leaf.dtype),
                                              None, f"argument {jax.tree_util.keystr(path)}"))  # fmt: skip
    interp.run(closed.jaxpr, list(closed.consts), flat)
    return nonfinite_report("jax", interp.sites, checked=interp.checked, scale=scale, log=log)


def _names_and_leaves(grads: Any) -> tuple[list[str], list[Any]]:
    pairs = jax.tree_util.tree_flatten_with_path(grads)[0]
    names, leaves = [], []
    for path, leaf in pairs:
        if _is_float(leaf):
            names.append(jax.tree_util.keystr(path) or "grads")
            leaves.append(leaf)
    return names, leaves


def _counts(
    leaves: Iterable[jax.Array], scale: jax.Array, compute: Any, tiny: float, scaled: bool
) -> jax.Array:
    rows = []
    for g in leaves:
        s = g.astype(jnp.float32)
        if not scaled:
            s = s * scale
        c = jnp.abs(s.astype(compute).astype(jnp.float32))
        zero = c == 0
        top = jnp.max(jnp.abs(s)) if s.size else jnp.float32(0)
        rows.append(jnp.stack([zero.sum().astype(jnp.float32), ((c > 0) & (c < tiny)).sum().astype(jnp.float32),
                               (zero & (s != 0)).sum().astype(jnp.float32), top.astype(jnp.float32)]))  # fmt: skip
    return jnp.stack(rows)


_counts_jit = jax.jit(_counts, static_argnums=(2, 3, 4))  # compiled once per tree structure, dtype and mode


def underflow_stats(grads: Any, scale: Any, *, compute_dtype: Any = "float16", scaled: bool = True,
                    log: bool = True) -> UnderflowReport:  # fmt: skip
    """Per gradient leaf: the fraction of elements zero or subnormal in ``compute_dtype`` at ``scale``.

    ``grads`` is a pytree of gradients (leaf names are their ``keystr`` paths),
    already multiplied by ``scale`` (``scaled=True``: the gradients of
    ``loss_scale.scale(loss)``) or multiplied by it here in float32.
    ``scale`` is a number, a :class:`mpx_jax.LossScale` or a 0-d array.  The
    counts are computed on the device (one jitted computation) and read back in
    one transfer (counts are held as float32: exact to 2**24 elements per leaf).
    See :mod:`mpx.diagnostics` for the definitions and the advice.
    """
    value = check_scale(scale) if scale is None else _scale_of(scale)
    compute = canonical_dtype(compute_dtype, field="compute_dtype")
    names, leaves = _names_and_leaves(grads)
    if not leaves:
        return build_underflow_report("jax", [], [], [], scale=value, compute_dtype=compute, log=log)
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "float64": jnp.float64}[
        compute
    ]
    tiny = dtype_info(compute).smallest_normal
    counts = np.asarray(
        jax.device_get(_counts_jit(leaves, jnp.float32(value), jdt, tiny, scaled))
    )  # one transfer
    return build_underflow_report("jax", names, [int(np.size(x)) for x in leaves], counts, scale=value,
                                  compute_dtype=compute, log=log)  # fmt: skip
