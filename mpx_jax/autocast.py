"""``autocast(fn, policy)``: the mpx op table applied to any JAX function, as a jaxpr transform.

JAX has no autocast.  This one traces ``fn`` to a jaxpr (``jax.make_jaxpr``)
and evaluates it again equation by equation, casting each equation's inputs
according to the class of its primitive in the mpx op table
(:data:`mpx.OP_TABLE`, or the ``op_table`` you pass):

* LOWER (``dot_general``: matmul, linear, einsum, bmm; ``conv_general_dilated``):
  inputs cast to the compute dtype, products accumulated in float32
  (``preferred_element_type``) and the result cast to the compute dtype;
* FLOAT32 (``exp``, ``log``, ``pow``, ``reduce_sum``/``reduce_prod``/``reduce_max``/
  ``reduce_min``, ``cumsum``..., ``logistic``, ``rsqrt``...): half-precision
  inputs cast to float32, so ``softmax``, ``log_softmax``, ``logsumexp``, means,
  variances, norms and losses built from them return float32;
* PROMOTE (``add``, ``mul``, ``concatenate``, ``select_n``...): inputs that had
  one dtype in the traced program are promoted to the widest of them (weakly
  typed values and scalar literals, such as gelu's ``0.044715``, never widen
  anything);
* PASSTHROUGH (everything else: ``max``-based ``relu``, ``tanh``, reshapes,
  pooling, gathers...): the input dtype flows through.

Elementwise work whose every result feeds a FLOAT32 op (or a cast to float32)
and is not returned runs in float32 too: the difference and the square in a
hand-written ``jnp.mean((pred - y) ** 2)``, the ``x ** 2`` of an RMS norm, the
``1 - labels`` of a binary cross-entropy.  In half precision they would be
rounded before the float32 reduction; JAX has no loss or norm op to classify,
so this is how a loss or norm written out of primitives gets computed in
float32 as the op table's FLOAT32 class promises.

``pow`` means ``lax.pow`` (``jnp.power(x, 2.5)``).  An integer power such as
``x ** 2`` traces to ``integer_pow``, which stays elementwise: JAX inlines it
into composites (``gelu``'s ``x ** 3``) whose dtype must pass through.  A
``dot_general`` traced with a dot algorithm (``jax.nn.dot_product_attention``
picks ``F16_F16_F32`` for float16, which XLA:CPU cannot lower) runs with the
default precision and float32 accumulation instead.

A cast back to half precision of a FLOAT32 op's result (what ``jnp.sum``,
``jnp.mean`` or ``jnp.linalg.norm`` trace for half inputs: upcast, reduce,
cast back) is dropped, so those results are float32 for any input.

Functions JAX names in the jaxpr are classified by that name when the op
table knows it: ``jax.nn.softmax``/``log_softmax`` (FLOAT32, or LOWER when the
policy's ``keep_fp32`` drops softmax), ``jax.nn.standardize`` (layer_norm),
``jax.nn.relu``/``gelu`` and the other activations (PASSTHROUGH).  JAX inlines
``jax.nn.softmax`` into ``reduce_max``/``exp``/``reduce_sum``, which are float32
ops anyway; when softmax's class is not FLOAT32 (``keep_fp32`` without
softmax) ``fn`` is traced under ``jax.softmax_custom_jvp(True)``, which makes
it a named call.  A named function runs at its new dtypes throughout: its own
casts back to the half dtype it was traced at follow it (jax's log_softmax and
standardize of a bfloat16 input sum in float32 and round the sum to bfloat16;
under mpx they are float32 through and through), and a named FLOAT32 function
with a custom JVP rule is differentiated through its primitives at float32,
since the rule would run at the traced half dtype.  Norms and losses written
out of primitives have no name: their reductions and ``exp``/``log`` make
them float32 under every ``keep_fp32``.

Sub-jaxprs are transformed too: ``jit``/``pjit`` calls are inlined,
``scan``/``while_loop``/``cond`` are rebuilt with ``lax.scan``/``lax.while_loop``/
``lax.switch`` (loop carries keep their traced dtypes, so a carry never
changes type between iterations), ``jax.checkpoint`` is kept, and
``custom_jvp``/``custom_vjp`` functions are rebuilt so that their own
derivative rules still apply (run at the dtypes they were traced at).  Any
other primitive with a sub-jaxpr, and any primitive that refuses the new
dtypes, runs exactly as traced (its inputs cast back to the traced dtypes).

The result composes with ``jit``, ``grad`` and ``vmap`` in either order.  For
a policy that does not lower precision (``float32``, ``float64``) ``autocast``
returns ``fn`` itself.  Outputs are not cast to the output dtype: do that
with :func:`mpx_jax.cast_to_output` where you want it.

>>> import jax.numpy as jnp
>>> def f(x, w):
...     h = x @ w
...     return h, jax.nn.softmax(h), jnp.sum(h)
>>> h, p, s = autocast(f, "mixed_bfloat16")(jnp.ones((2, 3)), jnp.ones((3, 4)))
>>> h.dtype, p.dtype, s.dtype
(dtype(bfloat16), dtype('float32'), dtype('float32'))
>>> autocast(f, "float32") is f
True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:
    from jax.extend import core as jcore
except ImportError:  # pragma: no cover - older jax
    from jax import core as jcore  # type: ignore[no-redef]

import mpx
from mpx.ops import OpClass, OpTable
from mpx.policy import PolicySpec
from mpx_jax._jaxpr import bind, eqn_context

__all__ = ["PRIMITIVE_OPS", "autocast"]

#: jax primitive -> canonical op of the mpx op table (its class decides the casts).
PRIMITIVE_OPS: dict[str, str] = {
    "dot_general": "matmul",
    "ragged_dot_general": "matmul",
    "conv_general_dilated": "conv",
    "exp": "exp",
    "exp2": "exp",
    "expm1": "exp",
    "log": "log",
    "log1p": "log",
    "pow": "pow",
    "reduce_sum": "sum",
    "reduce_prod": "prod",
    "cumsum": "cumsum",
    "cumprod": "prod",
    "cumlogsumexp": "logsumexp",
    "add": "add",
    "sub": "add",
    "mul": "mul",
    "div": "mul",
    "concatenate": "cat",
    "select_n": "where",
    "reshape": "reshape",
    "transpose": "transpose",
    "reduce_window_max": "max_pool",
    "gather": "embedding",
}
#: primitives outside the op table that run in float32 (after torch's CUDA float32 list).
_FLOAT32_PRIMITIVES = frozenset(
    {
        "reduce_max", "reduce_min", "cummax", "cummin", "logistic", "rsqrt",
        "erf_inv", "lgamma", "digamma", "tan", "acos", "asin", "cosh", "sinh",
    }
)  # fmt: skip
_LOWERABLE = frozenset({"dot_general", "conv_general_dilated"})
#: names JAX keeps on jit/custom_jvp calls -> canonical op (None: an activation, PASSTHROUGH).
_NAMED: dict[str, str | None] = {
    "softmax": "softmax",
    "_softmax": "softmax",
    "log_softmax": "log_softmax",
    "_log_softmax": "log_softmax",
    "logsumexp": "logsumexp",
    "standardize": "layer_norm",
    "relu": "relu",
    "gelu": "gelu",
    **{
        name: None
        for name in (
            "relu6",
            "silu",
            "swish",
            "elu",
            "celu",
            "selu",
            "leaky_relu",
            "hard_tanh",
            "glu",
            "mish",
        )
    },
}
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_F32 = np.dtype(np.float32)
#: structural primitives whose result is as weak as their inputs (a cast or broadcast of a scalar constant)
_WEAK_KEEPING = frozenset(
    {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy"}
)
#: elementwise and structural primitives: a float32 result stays "computed in float32" through them, and
#: they run in float32 themselves when every value they make feeds float32 work (float32_fed)
_ELEMENTWISE = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "sqrt", "abs", "max", "min", "sign", "square", "integer_pow",
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "select_n", "copy", "transpose",
    }
)  # fmt: skip
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _is_float(dtype: Any) -> bool:
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _dtype(x: Any) -> Any:
    return getattr(x, "dtype", None)


def _cast(x: Any, dtype: Any) -> Any:
    dt = _dtype(x)
    if not _is_float(dt) or not _is_float(dtype) or np.dtype(dt) == np.dtype(dtype):
        return x
    return lax.convert_element_type(x, dtype)


def _has_subjaxpr(params: dict[str, Any]) -> bool:
    def is_jaxpr(v: Any) -> bool:
        return isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))

    for v in params.values():
        if is_jaxpr(v) or (isinstance(v, (tuple, list)) and any(is_jaxpr(u) for u in v)):
            return True
    return False


def _func_name(eqn: Any) -> str | None:
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    call = eqn.params.get("call_jaxpr")
    info = getattr(getattr(call, "jaxpr", call), "debug_info", None)
    src = getattr(info, "func_src_info", None) or getattr(info, "func_name", None)
    if isinstance(src, str) and src:
        return src.split(" at ", 1)[0].strip()
    return None


class _Interpreter:
    def __init__(self, policy: mpx.Policy, table: OpTable) -> None:
        self.policy = policy
        self.table = table
        self.compute = mpx.numpy_dtype(policy.compute_dtype)
        # inside a named function run at new dtypes: traced half dtype -> the dtype it runs at now
        self.retype: dict[np.dtype, np.dtype] = {}

    # -- evaluation -------------------------------------------------------------
    def run_closed(self, closed: Any, args: Sequence[Any], rules: bool) -> list[Any]:
        return self.run(closed.jaxpr, closed.consts, args, rules)

    def run_retyped(
        self, closed: Any, args: Sequence[Any], rules: bool, weak: Sequence[bool] | None = None
    ) -> list[Any]:
        """Run a named or custom function's body at its arguments' new dtypes, its own casts to the half
        dtype it was traced at redirected to the dtype that now stands in for it.

        ``jax.nn.log_softmax`` traced at bfloat16 sums in float32 and casts the sum back to bfloat16; run
        in float32 (FLOAT32 class) that cast must stay float32, and run in float16 (LOWER with a float16
        policy) it must be float16, or the traced dtype leaks into the result.
        """
        new = dict(self.retype)
        for v, x in zip(closed.jaxpr.invars, args, strict=False):
            traced, now = np.dtype(v.aval.dtype), _dtype(x)
            if traced in _HALF and _is_float(now) and np.dtype(now) != traced:
                new[traced] = np.dtype(now)
        previous, self.retype = self.retype, new
        try:
            return self.run(closed.jaxpr, closed.consts, args, rules, weak)
        finally:
            self.retype = previous

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        rules: bool,
        weak_args: Sequence[bool] | None = None,
    ) -> list[Any]:
        env: dict[Any, Any] = {}
        # values that came from weakly typed scalars only: they follow, never widen
        weak: set[Any] = {v for v, w in zip(jaxpr.invars, weak_args or (), strict=False) if w}

        def read(v: Any) -> Any:
            if isinstance(v, jcore.Literal):
                val = v.val
                return val if hasattr(val, "dtype") else np.asarray(val, v.aval.dtype)
            return env[v]

        def is_weak(v: Any) -> bool:
            return isinstance(v, jcore.Literal) or bool(getattr(v.aval, "weak_type", False)) or v in weak

        env.update(zip(jaxpr.constvars, consts, strict=False))
        env.update(zip(jaxpr.invars, args, strict=False))
        fed = self.float32_fed(jaxpr) if rules else frozenset()
        # values a FLOAT32-class op computed (and elementwise results of them only)
        wide: set[Any] = set()
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            invals = [read(v) for v in eqn.invars]
            flags = [is_weak(v) for v in eqn.invars]
            floats = [
                v for v, x, w in zip(eqn.invars, invals, flags, strict=True) if _is_float(_dtype(x)) and not w
            ]
            from_wide = bool(floats) and all(not isinstance(v, jcore.Literal) and v in wide for v in floats)
            if (
                rules
                and name == "convert_element_type"
                and from_wide
                and eqn.params.get("new_dtype") in _HALF
            ):
                # jnp's own "upcast, reduce, cast back" (jnp.mean, jnp.sum of half inputs): a FLOAT32
                # op's result stays float32, as the op table says
                outs = [invals[0]]
            elif name == "convert_element_type" and (
                target := self.retype.get(np.dtype(eqn.params["new_dtype"]))
            ):
                outs = [lax.convert_element_type(invals[0], target)]
            else:
                if name in _ELEMENTWISE and eqn.outvars and all(v in fed for v in eqn.outvars):
                    invals = [_cast(x, _F32) if _dtype(x) in _HALF else x for x in invals]
                with eqn_context(eqn):
                    outs = self.eqn(eqn, invals, rules, flags)
            env.update(zip(eqn.outvars, outs, strict=False))
            if name in _WEAK_KEEPING and flags and all(flags):
                weak.update(eqn.outvars)
            if rules and (
                (name in _ELEMENTWISE and from_wide)
                or self.op_class(name) is OpClass.FLOAT32
                or (name == "convert_element_type" and from_wide)
            ):
                wide.update(v for v, o in zip(eqn.outvars, outs, strict=False) if _dtype(o) == _F32)
        return [read(v) for v in jaxpr.outvars]

    def float32_fed(self, jaxpr: Any) -> set[Any]:
        """Floating variables whose every use wants float32, so elementwise work producing them runs in it.

        A use wants float32 when it is a FLOAT32 op (a reduction, ``exp``...), a cast to float32, or
        elementwise work whose own results are float32-fed; a value the jaxpr returns is never
        float32-fed.  So the ``a - b`` and the square of ``jnp.mean((a - b) ** 2)`` run in float32
        like the mean, where a half-precision difference would be rounded before it is reduced,
        while ``x ** 3`` inside gelu, whose result feeds a matmul or is returned, stays in the input
        dtype.
        """
        returned = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
        uses: dict[Any, list[bool]] = {}
        fed: set[Any] = set()
        for eqn in reversed(jaxpr.eqns):
            for v in eqn.outvars:
                wants = uses.get(v)
                if wants and all(wants) and v not in returned and _is_float(v.aval.dtype):
                    fed.add(v)
            name = eqn.primitive.name
            if name in _ELEMENTWISE:
                want = bool(eqn.outvars) and all(v in fed for v in eqn.outvars)
            elif name == "convert_element_type":
                want = np.dtype(eqn.params["new_dtype"]) == _F32
            else:
                want = not _has_subjaxpr(eqn.params) and self.op_class(name) is OpClass.FLOAT32
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    uses.setdefault(v, []).append(want)
        return fed

    # -- classes ----------------------------------------------------------------
    def op_class(self, name: str) -> OpClass:
        op = PRIMITIVE_OPS.get(name)
        if op is not None and op in self.table:
            return self.table.classify(op, self.policy)
        if name in _FLOAT32_PRIMITIVES:
            return OpClass.FLOAT32
        return OpClass.PASSTHROUGH

    def softmax_by_name(self) -> bool:
        """Whether ``jax.nn.softmax`` must be traced as a named call for its class to apply.

        JAX inlines it by default: ``reduce_max``, ``exp``, ``reduce_sum``, with the max under
        ``stop_gradient``.  When those primitives are FLOAT32, as softmax is, the inlined form is
        computed in float32, forward and backward, and keeps fewer residuals than the named form
        differentiated at float32; otherwise (``keep_fp32`` without softmax, a changed op table) the
        name is needed.
        """
        inlined = all(self.op_class(p) is OpClass.FLOAT32 for p in ("reduce_max", "exp", "reduce_sum"))
        return not (inlined and self.named_class("softmax") is OpClass.FLOAT32)

    def named_class(self, name: str | None) -> OpClass | None:
        if name not in _NAMED:
            return None
        op = _NAMED[name]
        if op is None or op not in self.table:
            return OpClass.PASSTHROUGH
        return self.table.classify(op, self.policy)

    def precast(self, cls: OpClass, invals: Sequence[Any]) -> list[Any]:
        if cls is OpClass.FLOAT32:
            return [_cast(x, _F32) if _dtype(x) in _HALF else x for x in invals]
        if cls is OpClass.LOWER:
            return [_cast(x, self.compute) if _dtype(x) in (*_HALF, _F32) else x for x in invals]
        return list(invals)

    # -- one equation -------------------------------------------------------------
    def eqn(self, eqn: Any, invals: list[Any], rules: bool, weak: list[bool]) -> list[Any]:
        name = eqn.primitive.name
        if name in _CALLS:
            return self.call(eqn, invals, rules, weak)
        if name == "custom_jvp_call":
            return self.custom_jvp(eqn, invals, rules)
        if name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
            return self.custom_vjp(eqn, invals, rules)
        if name == "scan":
            return self.scan(eqn, invals, rules)
        if name == "while":
            return self.while_loop(eqn, invals, rules)
        if name == "cond":
            return self.cond(eqn, invals, rules)
        if name in ("remat2", "checkpoint", "remat"):
            return self.remat(eqn, invals, rules)
        if _has_subjaxpr(eqn.params):
            return self.exact(eqn, invals)
        if rules:
            cls = self.op_class(name)
            if cls is OpClass.LOWER and name in _LOWERABLE:
                return self.lower(eqn, invals, weak)
            invals = self.precast(cls, invals)
        return self.generic(eqn, invals, weak)

    def exact(self, eqn: Any, invals: Sequence[Any]) -> list[Any]:
        """Run the equation at the dtypes it was traced at."""
        return bind(eqn, [_cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars, strict=False)])

    def generic(self, eqn: Any, invals: list[Any], weak: Sequence[bool] | None = None) -> list[Any]:
        """Promote inputs that shared a dtype when traced to their widest current dtype, then bind."""
        groups: dict[Any, list[int]] = {}
        for i, v in enumerate(eqn.invars):
            if _is_float(v.aval.dtype) and _is_float(_dtype(invals[i])):
                groups.setdefault(np.dtype(v.aval.dtype), []).append(i)
        args = list(invals)
        for idx in groups.values():
            strong = [i for i in idx if not (weak[i] if weak is not None else False)]
            target = functools.reduce(jnp.promote_types, [_dtype(args[i]) for i in (strong or idx)])
            for i in idx:
                args[i] = _cast(args[i], target)
        try:
            return bind(eqn, args)
        except (TypeError, ValueError):
            return self.exact(eqn, invals)

    def lower(self, eqn: Any, invals: list[Any], weak: Sequence[bool]) -> list[Any]:
        lhs, rhs = invals[:2]
        if not all(_dtype(x) in (*_HALF, _F32) for x in (lhs, rhs)):
            return self.generic(eqn, invals, weak)
        args = [_cast(lhs, self.compute), _cast(rhs, self.compute), *invals[2:]]
        params = dict(eqn.params)
        if "preferred_element_type" in params:
            params["preferred_element_type"] = _F32
        if isinstance(params.get("precision"), jax.lax.DotAlgorithmPreset):
            # An algorithm such as F16_F16_F32 (jax.nn.dot_product_attention's choice for
            # float16) has no CPU lowering; preferred_element_type already asks for
            # float32 accumulation, which every backend supports.
            params["precision"] = None
        out = bind(eqn, args, params)
        return [_cast(o, self.compute) for o in out]

    # -- higher-order primitives ------------------------------------------------------
    def call(self, eqn: Any, invals: list[Any], rules: bool, weak: Sequence[bool]) -> list[Any]:
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if closed is None:
            return self.exact(eqn, invals)
        if not isinstance(closed, jcore.ClosedJaxpr):
            closed = jcore.ClosedJaxpr(closed, ())
        if rules:
            cls = self.named_class(_func_name(eqn))
            if cls is not None:
                return self.run_retyped(closed, self.precast(cls, invals), False, weak)
        return self.run(closed.jaxpr, closed.consts, invals, rules, weak)

    def _sub(self, eqn: Any, closed: Any, invals: list[Any], rules: bool) -> tuple[list[Any], bool]:
        cls = self.named_class(_func_name(eqn)) if rules else None
        if cls is not None:
            return self.precast(cls, invals), False
        return invals, rules

    def custom_jvp(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        closed = eqn.params["call_jaxpr"]
        if (
            rules
            and self.named_class(_func_name(eqn)) is OpClass.FLOAT32
            and any(_dtype(x) in _HALF for x in invals)
        ):
            # A float32 function (jax.nn.softmax) traced at half precision: its own rule would run at
            # the traced half dtype, so its primitives are differentiated at float32 instead, keeping
            # the backward pass in float32 as well.
            return self.run_retyped(closed, self.precast(OpClass.FLOAT32, invals), False)
        args, inner_rules = self._sub(eqn, closed, invals, rules)
        traced = [v.aval.dtype for v in eqn.invars]

        def primal(*xs: Any) -> list[Any]:
            return self.run_retyped(closed, xs, inner_rules)

        def original(*xs: Any) -> list[Any]:
            return bind(eqn, xs)

        fun = jax.custom_jvp(primal)

        def jvp(primals: Any, tangents: Any) -> Any:
            out = primal(*primals)
            p = [_cast(x, d) for x, d in zip(primals, traced, strict=False)]
            t = [_cast(x, d) for x, d in zip(tangents, traced, strict=False)]
            _, t_out = jax.jvp(original, p, t)
            return out, [_cast(to, _dtype(o)) for to, o in zip(t_out, out, strict=False)]

        fun.defjvp(jvp)
        return list(fun(*args))

    def custom_vjp(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        closed = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        if closed is None:
            return self.exact(eqn, invals)
        args, inner_rules = self._sub(eqn, closed, invals, rules)
        traced_in = [v.aval.dtype for v in eqn.invars]
        traced_out = [v.aval.dtype for v in eqn.outvars]
        arg_dtypes = [_dtype(x) for x in args]

        def primal(*xs: Any) -> list[Any]:
            return self.run_retyped(closed, xs, inner_rules)

        out_dtypes = [s.dtype for s in jax.eval_shape(primal, *args)]

        def original(*xs: Any) -> list[Any]:
            return bind(eqn, xs)

        fun = jax.custom_vjp(primal)

        def fwd(*xs: Any) -> Any:
            out, pullback = jax.vjp(original, *[_cast(x, d) for x, d in zip(xs, traced_in, strict=False)])
            return [_cast(o, d) for o, d in zip(out, out_dtypes, strict=False)], pullback

        def bwd(pullback: Any, cts: Any) -> Any:
            grads = pullback([_cast(c, d) for c, d in zip(cts, traced_out, strict=False)])
            return tuple(_cast(g, d) for g, d in zip(grads, arg_dtypes, strict=False))

        fun.defvjp(fwd, bwd)
        return list(fun(*args))

    def scan(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        p = eqn.params
        body, nc, ncarry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        carry_dtypes = [a.dtype for a in body.in_avals[nc : nc + ncarry]]

        def step(carry: Any, x: Any) -> Any:
            out = self.run_closed(body, [*consts, *carry, *x], rules)
            return [_cast(c, d) for c, d in zip(out[:ncarry], carry_dtypes, strict=False)], out[ncarry:]

        init = [_cast(c, d) for c, d in zip(init, carry_dtypes, strict=False)]
        carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]

    def while_loop(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        dtypes = [a.dtype for a in p["body_jaxpr"].in_avals[bn:]]

        def cond_fun(carry: Any) -> Any:
            return self.run_closed(p["cond_jaxpr"], [*cconsts, *carry], rules)[0]

        def body_fun(carry: Any) -> Any:
            out = self.run_closed(p["body_jaxpr"], [*bconsts, *carry], rules)
            return [_cast(c, d) for c, d in zip(out, dtypes, strict=False)]

        return list(
            lax.while_loop(cond_fun, body_fun, [_cast(c, d) for c, d in zip(init, dtypes, strict=False)])
        )

    def cond(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        branches = eqn.params["branches"]
        index, ops = invals[0], invals[1:]
        fns = [functools.partial(self.run_closed, b, rules=rules) for b in branches]
        specs = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in ops]
        shapes = [jax.eval_shape(lambda *o, f=f: f(o), *specs) for f in fns]
        dtypes = []
        for i, aval in enumerate(branches[0].out_avals):
            seen = {np.dtype(s[i].dtype) for s in shapes}
            dtypes.append(seen.pop() if len(seen) == 1 else aval.dtype)

        def branch(f: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
            return lambda *o: [_cast(x, d) for x, d in zip(f(o), dtypes, strict=False)]

        return list(lax.switch(index, [branch(f) for f in fns], *ops))

    def remat(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        p = eqn.params
        jaxpr = p["jaxpr"]
        closed = jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(jaxpr, ())

        def fn(*xs: Any) -> list[Any]:
            return self.run_closed(closed, xs, rules)

        kwargs = {k: p[k] for k in ("prevent_cse", "policy") if k in p}
        return list(jax.checkpoint(fn, **kwargs)(*invals))


def _named_softmax(named: bool) -> Any:
    """A context in which ``jax.nn.softmax`` traces as a named call (``_softmax``) when ``named``."""
    flag = getattr(jax, "softmax_custom_jvp", None)
    return flag(True) if named and flag is not None else contextlib.nullcontext()


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def autocast(
    fn: Callable[..., Any], policy: PolicySpec, *, op_table: OpTable | None = None
) -> Callable[..., Any]:
    """``fn`` with every op run in the dtype the op table gives it under ``policy``.

    Args:
        fn: any JAX function of arrays (other arguments, such as Python
            numbers, strings or flags, are static: they are baked into the trace).
        policy: an :class:`mpx.Policy` or a spec string; only its compute dtype
            and ``keep_fp32`` matter here.
        op_table: the op classes (default :data:`mpx.OP_TABLE`); change one
            with ``mpx.OP_TABLE.replace(softmax="lower")``.

    Returns:
        ``fn`` itself when the policy's compute dtype is not float16 or
        bfloat16, else a function with ``fn``'s signature and outputs.

    Warns:
        mpx.SlowPolicyWarning: once per process, when the compute dtype is
            measured slow on ``jax.default_backend()`` (float16 and bfloat16 on
            XLA:CPU; see :mod:`mpx.advice`; ``MPX_NO_SLOW_WARNING=1`` silences it).
    """
    pol = mpx.get_policy(policy)
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)
    if not pol.lowers_precision:
        return fn
    table = mpx.OP_TABLE if op_table is None else op_table
    if not isinstance(table, OpTable):
        raise mpx.MPXError(f"op_table: expected an mpx.OpTable, got {type(table).__name__}")
    interp = _Interpreter(pol, table)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]
        dynamic = [leaves[i] for i in where]

        def flat(*values: Any) -> Any:
            full = list(leaves)
            for i, value in zip(where, values, strict=False):
                full[i] = value
            a, k = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*a, **k)

        with _named_softmax(interp.softmax_by_name()):
            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dynamic)
        outs = interp.run_closed(closed, dynamic, rules=True)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
