"""autocast's higher-order primitives: custom derivative rules, ``scan``, ``while``, ``cond`` and ``remat``,
rebuilt around the interpreter so the op table holds inside them.

``scan``/``while_loop``/``cond`` are rebuilt with ``lax.scan``/``lax.while_loop``/``lax.switch`` (loop
carries keep their traced dtypes, so a carry never changes type between iterations; ``cond`` branches
that disagree on a result's dtype give it its traced dtype), ``jax.checkpoint`` is kept with its policy,
and ``custom_jvp``/``custom_vjp`` functions are rebuilt so that their own derivative rules still apply
(run at the dtypes they were traced at).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from mpx.ops import OpClass
from mpx_jax._autocast_rules import HALF, Rules, cast, dtype_of, func_name
from mpx_jax._compat import ClosedJaxpr, param
from mpx_jax._jaxpr import bind

__all__ = ["ControlFlow"]


class ControlFlow:
    """The higher-order primitives of :class:`mpx_jax._autocast_interpreter.Interpreter` (a mixin)."""

    rules: Rules

    # provided by the interpreter
    def run_closed(self, closed: Any, args: Sequence[Any], rules: bool) -> list[Any]:
        raise NotImplementedError

    def run_retyped(
        self, closed: Any, args: Sequence[Any], rules: bool, weak: Sequence[bool] | None = None
    ) -> list[Any]:
        raise NotImplementedError

    def fallback(self, eqn: Any, invals: Sequence[Any], why: str) -> list[Any]:
        raise NotImplementedError

    # -- custom derivative rules -------------------------------------------------------------------------
    def _sub(self, eqn: Any, invals: list[Any], rules: bool) -> tuple[list[Any], bool]:
        cls = self.rules.named_class(func_name(eqn)) if rules else None
        if cls is not None:
            return self.rules.precast(cls, invals), False
        return invals, rules

    def custom_jvp(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        closed = param(eqn, "call_jaxpr")
        if (
            rules
            and self.rules.named_class(func_name(eqn)) is OpClass.FLOAT32
            and any(dtype_of(x) in HALF for x in invals)
        ):
            # A float32 function (jax.nn.softmax) traced at half precision: its own rule would run at
            # the traced half dtype, so its primitives are differentiated at float32 instead, keeping
            # the backward pass in float32 as well.
            return self.run_retyped(closed, self.rules.precast(OpClass.FLOAT32, invals), False)
        args, inner_rules = self._sub(eqn, invals, rules)
        traced = [v.aval.dtype for v in eqn.invars]

        def primal(*xs: Any) -> list[Any]:
            return self.run_retyped(closed, xs, inner_rules)

        def original(*xs: Any) -> list[Any]:
            return bind(eqn, xs)

        fun = jax.custom_jvp(primal)

        def jvp(primals: Any, tangents: Any) -> Any:
            out = primal(*primals)
            p = [cast(x, d) for x, d in zip(primals, traced, strict=False)]
            t = [cast(x, d) for x, d in zip(tangents, traced, strict=False)]
            _, t_out = jax.jvp(original, p, t)
            return out, [cast(to, dtype_of(o)) for to, o in zip(t_out, out, strict=False)]

        fun.defjvp(jvp)
        return list(fun(*args))

    def custom_vjp(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        closed = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        if closed is None:
            return self.fallback(eqn, invals, "its body is not in its parameters")
        args, inner_rules = self._sub(eqn, invals, rules)
        traced_in = [v.aval.dtype for v in eqn.invars]
        traced_out = [v.aval.dtype for v in eqn.outvars]
        arg_dtypes = [dtype_of(x) for x in args]

        def primal(*xs: Any) -> list[Any]:
            return self.run_retyped(closed, xs, inner_rules)

        out_dtypes = [s.dtype for s in jax.eval_shape(primal, *args)]

        def original(*xs: Any) -> list[Any]:
            return bind(eqn, xs)

        fun = jax.custom_vjp(primal)

        def fwd(*xs: Any) -> Any:
            out, pullback = jax.vjp(original, *[cast(x, d) for x, d in zip(xs, traced_in, strict=False)])
            return [cast(o, d) for o, d in zip(out, out_dtypes, strict=False)], pullback

        def bwd(pullback: Any, cts: Any) -> Any:
            grads = pullback([cast(c, d) for c, d in zip(cts, traced_out, strict=False)])
            return tuple(cast(g, d) for g, d in zip(grads, arg_dtypes, strict=False))

        fun.defvjp(fwd, bwd)
        return list(fun(*args))

    # -- loops, branches, rematerialization ----------------------------------------------------------------
    def scan(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        body, nc, ncarry = param(eqn, "jaxpr"), param(eqn, "num_consts"), param(eqn, "num_carry")
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        carry_dtypes = [a.dtype for a in body.in_avals[nc : nc + ncarry]]

        def step(carry: Any, x: Any) -> Any:
            out = self.run_closed(body, [*consts, *carry, *x], rules)
            return [cast(c, d) for c, d in zip(out[:ncarry], carry_dtypes, strict=False)], out[ncarry:]

        init = [cast(c, d) for c, d in zip(init, carry_dtypes, strict=False)]
        carry, ys = lax.scan(
            step,
            init,
            xs,
            length=param(eqn, "length"),
            reverse=param(eqn, "reverse"),
            unroll=param(eqn, "unroll"),
        )
        return [*carry, *ys]

    def while_loop(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        cn, bn = param(eqn, "cond_nconsts"), param(eqn, "body_nconsts")
        cond_jaxpr, body_jaxpr = param(eqn, "cond_jaxpr"), param(eqn, "body_jaxpr")
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        dtypes = [a.dtype for a in body_jaxpr.in_avals[bn:]]

        def cond_fun(carry: Any) -> Any:
            return self.run_closed(cond_jaxpr, [*cconsts, *carry], rules)[0]

        def body_fun(carry: Any) -> Any:
            out = self.run_closed(body_jaxpr, [*bconsts, *carry], rules)
            return [cast(c, d) for c, d in zip(out, dtypes, strict=False)]

        return list(
            lax.while_loop(cond_fun, body_fun, [cast(c, d) for c, d in zip(init, dtypes, strict=False)])
        )

    def cond(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        branches = param(eqn, "branches")
        index, ops = invals[0], invals[1:]
        fns = [functools.partial(self.run_closed, b, rules=rules) for b in branches]
        specs = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)) for x in ops]
        shapes = [jax.eval_shape(lambda *o, f=f: f(o), *specs) for f in fns]
        dtypes = []
        for i, aval in enumerate(branches[0].out_avals):
            seen = {np.dtype(s[i].dtype) for s in shapes}
            dtypes.append(seen.pop() if len(seen) == 1 else aval.dtype)

        def branch(f: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
            return lambda *o: [cast(x, d) for x, d in zip(f(o), dtypes, strict=False)]

        return list(lax.switch(index, [branch(f) for f in fns], *ops))

    def remat(self, eqn: Any, invals: list[Any], rules: bool) -> list[Any]:
        jaxpr = param(eqn, "jaxpr")
        closed = jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())

        def fn(*xs: Any) -> list[Any]:
            return self.run_closed(closed, xs, rules)

        kwargs = {k: eqn.params[k] for k in ("prevent_cse", "policy") if k in eqn.params}
        return list(jax.checkpoint(fn, **kwargs)(*invals))
