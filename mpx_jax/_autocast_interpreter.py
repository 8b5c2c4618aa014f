"""autocast's interpreter: evaluates a traced jaxpr again, equation by equation, under the op rules.

Each equation's inputs are cast according to the class of its primitive (:class:`Rules`); calls are
inlined, named functions (``jax.nn.softmax``...) follow their class, float32 islands (the float32 a
function makes itself or upcasts, :func:`mpx_jax._autocast_rules.float32_islands`) run as traced, equations traced in
a nested float32 autocast run at float32, and what the interpreter cannot retype is reported
(:class:`AutocastFallbackWarning`, or :class:`AutocastError` under ``strict``) before it runs at its
traced dtypes.  The higher-order primitives are in :mod:`mpx_jax._autocast_control`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mpx
from mpx.blocks import BlockRecipe
from mpx.ops import OpClass
from mpx_jax._autocast_control import ControlFlow
from mpx_jax._autocast_rules import (
    ELEMENTWISE,
    F32,
    HALF,
    LOWERABLE,
    WEAK_KEEPING,
    Rules,
    cast,
    dtype_of,
    float32_islands,
    func_name,
    has_subjaxpr,
    is_float,
)
from mpx_jax._compat import INLINE_CALL_PRIMITIVES, ClosedJaxpr, Literal, name_scopes, param
from mpx_jax._jaxpr import bind, eqn_context
from mpx_jax.blocks import block_dot_general
from mpx_jax.float8 import fp8_dot_general

__all__ = ["FLOAT32_SCOPE", "MIXED_SCOPE", "AutocastError", "AutocastFallbackWarning", "Interpreter"]

#: the name scopes autocast enters: equations traced inside the innermost one follow its policy
FLOAT32_SCOPE = "mpx_autocast_float32"
MIXED_SCOPE = "mpx_autocast"
#: primitives whose jaxpr parameter is a combiner traced at one dtype (``x.at[i].add(v)``, generic
#: reductions): by rule they run at their traced dtypes, as PROMOTE would give them
_COMBINERS = frozenset(
    {
        "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub",
        "reduce", "reduce_window", "select_and_scatter",
    }
)  # fmt: skip


class AutocastFallbackWarning(UserWarning):
    """mpx_jax.autocast ran an equation at its traced dtypes, outside the op table (see its message)."""


class AutocastError(mpx.MPXError):
    """Under ``autocast(..., strict=True)``: an equation could not be run at the dtypes the op table gives."""


class Interpreter(ControlFlow):
    """One policy's evaluation of jaxprs.

    ``scopes`` maps autocast's name scopes to their interpreters: this one for a mixed autocast's, and
    (after :meth:`with_float32_regions`) a float32 one for the regions of a nested float32 autocast.
    ``warned`` (the primitives already warned about) is shared by both.
    """

    def __init__(self, rules: Rules, *, strict: bool = False, warned: set[str] | None = None) -> None:
        self.rules = rules
        self.strict = strict
        self.warned: set[str] = set() if warned is None else warned
        # inside a named function run at new dtypes: traced half dtype -> the dtype it runs at now
        self.retype: dict[np.dtype, np.dtype] = {}
        self.scopes: dict[str, Interpreter] = {MIXED_SCOPE: self}
        # a seeded block recipe's keys (mpx_jax.blocks.BlockRng) and the index of the next block dot
        self.block_rng: Any = None
        self.block_next = 0

    def with_float32_regions(self) -> Interpreter:
        """Attach the interpreter of nested float32 regions (LOWER and FLOAT32 ops at float32); self."""
        region = Interpreter(
            Rules(self.rules.policy, self.rules.table, F32, fp8=False), strict=self.strict, warned=self.warned
        )
        region.scopes = self.scopes
        self.scopes[FLOAT32_SCOPE] = region
        return self

    # -- evaluation ----------------------------------------------------------------------------------------
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
            traced, now = np.dtype(v.aval.dtype), dtype_of(x)
            if traced in HALF and is_float(now) and np.dtype(now) != traced:
                new[traced] = np.dtype(now)
        previous, self.retype = self.retype, new
        try:
            return self.run(closed.jaxpr, closed.consts, args, rules, weak)
        finally:
            self.retype = previous

    def scope_of(self, eqn: Any) -> Interpreter:
        """The interpreter of the innermost autocast scope ``eqn`` was traced in (self when none)."""
        for kind, name in reversed(name_scopes(eqn.source_info)):
            if kind == "Scope" and name in self.scopes:
                return self.scopes[name]
        return self

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        rules: bool,
        weak_args: Sequence[bool] | None = None,
        island_args: Sequence[bool] | None = None,
    ) -> list[Any]:
        env: dict[Any, Any] = {}
        # values that came from weakly typed scalars only: they follow, never widen
        weak: set[Any] = {v for v, w in zip(jaxpr.invars, weak_args or (), strict=False) if w}

        def read(v: Any) -> Any:
            if isinstance(v, Literal):
                val = v.val
                return val if hasattr(val, "dtype") else np.asarray(val, v.aval.dtype)
            return env[v]

        def is_weak(v: Any) -> bool:
            return isinstance(v, Literal) or bool(getattr(v.aval, "weak_type", False)) or v in weak

        env.update(zip(jaxpr.constvars, consts, strict=False))
        env.update(zip(jaxpr.invars, args, strict=False))
        fed = self.rules.float32_fed(jaxpr) if rules else frozenset()
        island = float32_islands(jaxpr, consts, island_args) if rules else frozenset()
        # values a FLOAT32-class op computed (and elementwise results of them only)
        wide: set[Any] = set()
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            invals = [read(v) for v in eqn.invars]
            flags = [is_weak(v) for v in eqn.invars]
            floats = [
                v
                for v, x, w in zip(eqn.invars, invals, flags, strict=True)
                if is_float(dtype_of(x)) and not w
            ]
            from_wide = bool(floats) and all(not isinstance(v, Literal) and v in wide for v in floats)
            in_island = rules and bool(floats) and all(isinstance(v, Literal) or v in island for v in floats)
            target = self.scope_of(eqn) if rules else self
            if rules and name == "convert_element_type" and from_wide and param(eqn, "new_dtype") in HALF:
                # jnp's own "upcast, reduce, cast back" (jnp.mean, jnp.sum of half inputs): a FLOAT32
                # op's result stays float32, as the op table says
                outs = [invals[0]]
            elif target is not self:
                # traced inside a nested autocast (a float32 region): that interpreter's rules
                with eqn_context(eqn):
                    outs = target.eqn(eqn, invals, True, flags)
            elif in_island and not has_subjaxpr(eqn.params):
                # the function's own float32 (positions, frequencies, an explicit upcast): as traced,
                # neither lowered nor cast by its class
                with eqn_context(eqn):
                    outs = self.generic(eqn, invals, flags)
            elif name == "convert_element_type" and (
                target_dtype := self.retype.get(np.dtype(param(eqn, "new_dtype")))
            ):
                outs = [jax.lax.convert_element_type(invals[0], target_dtype)]
            else:
                if name in ELEMENTWISE and eqn.outvars and all(v in fed for v in eqn.outvars):
                    invals = [cast(x, F32) if dtype_of(x) in HALF else x for x in invals]
                with eqn_context(eqn):
                    island_flags = (
                        [isinstance(v, Literal) or v in island for v in eqn.invars] if rules else None
                    )
                    outs = self.eqn(eqn, invals, rules, flags, island_flags)
            env.update(zip(eqn.outvars, outs, strict=False))
            if name in WEAK_KEEPING and flags and all(flags):
                weak.update(eqn.outvars)
            if rules and (
                (name in ELEMENTWISE and from_wide)
                or self.rules.op_class(name) is OpClass.FLOAT32
                or (name == "convert_element_type" and from_wide)
            ):
                wide.update(v for v, o in zip(eqn.outvars, outs, strict=False) if dtype_of(o) == F32)
        return [read(v) for v in jaxpr.outvars]

    # -- one equation ----------------------------------------------------------------------------------------
    def eqn(
        self,
        eqn: Any,
        invals: list[Any],
        rules: bool,
        weak: list[bool],
        island: Sequence[bool] | None = None,
    ) -> list[Any]:
        name = eqn.primitive.name
        if name in INLINE_CALL_PRIMITIVES:
            return self.call(eqn, invals, rules, weak, island)
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
        if has_subjaxpr(eqn.params):
            if name in _COMBINERS or not rules:
                return self.exact(eqn, invals)
            return self.fallback(eqn, invals, "autocast does not look inside this primitive's jaxpr")
        if rules:
            cls = self.rules.op_class(name)
            if cls is OpClass.LOWER and name in LOWERABLE:
                return self.lower(eqn, invals, weak)
            invals = self.rules.precast(cls, invals)
        return self.generic(eqn, invals, weak)

    def exact(self, eqn: Any, invals: Sequence[Any]) -> list[Any]:
        """Run the equation at the dtypes it was traced at."""
        return bind(eqn, [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars, strict=False)])

    def fallback(self, eqn: Any, invals: Sequence[Any], why: str) -> list[Any]:
        """Run ``eqn`` at its traced dtypes after saying so: warn once per primitive, or raise under strict."""
        name = eqn.primitive.name
        now = [str(dtype_of(x)) for x, v in zip(invals, eqn.invars, strict=False) if is_float(v.aval.dtype)]
        traced = [str(v.aval.dtype) for v in eqn.invars if is_float(v.aval.dtype)]
        message = (
            f"mpx_jax.autocast could not run {name} with inputs of dtype {now or 'none'} (traced at "
            f"{traced or 'none'}): {why}."
        )
        if self.strict:
            raise AutocastError(f"{message} Raised because autocast was called with strict=True.")
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(
                f"{message} It runs at its traced dtypes instead, outside the op table; pass strict=True "
                "to make this an error.",
                AutocastFallbackWarning,
                stacklevel=2,
            )
        return self.exact(eqn, invals)

    def generic(self, eqn: Any, invals: list[Any], weak: Sequence[bool] | None = None) -> list[Any]:
        """Promote inputs that shared a dtype when traced to their widest current dtype, then bind."""
        groups: dict[Any, list[int]] = {}
        for i, v in enumerate(eqn.invars):
            if is_float(v.aval.dtype) and is_float(dtype_of(invals[i])):
                groups.setdefault(np.dtype(v.aval.dtype), []).append(i)
        args = list(invals)
        for idx in groups.values():
            strong = [i for i in idx if not (weak[i] if weak is not None else False)]
            target = functools.reduce(jnp.promote_types, [dtype_of(args[i]) for i in (strong or idx)])
            for i in idx:
                args[i] = cast(args[i], target)
        try:
            return bind(eqn, args)
        except (TypeError, ValueError) as exc:
            retyped = any(
                is_float(v.aval.dtype) and np.dtype(dtype_of(x)) != np.dtype(v.aval.dtype)
                for x, v in zip(args, eqn.invars, strict=False)
                if dtype_of(x) is not None
            )
            if not retyped:
                raise
            return self.fallback(
                eqn, invals, f"it refused them ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            )

    def lower(self, eqn: Any, invals: list[Any], weak: Sequence[bool]) -> list[Any]:
        lhs, rhs = invals[:2]
        if not all(dtype_of(x) in (*HALF, F32) for x in (lhs, rhs)):
            return self.generic(eqn, invals, weak)
        compute = self.rules.compute
        if self.rules.fp8_dot(eqn):
            # quantized from the operands as they arrive (float32 master weights from float32), current
            # scaling (autocast keeps no state), the result in the compute dtype
            dims = param(eqn, "dimension_numbers")
            if isinstance(self.rules.fp8, BlockRecipe):  # block-scaled, emulated (mpx_jax.blocks)
                keys: dict[str, Any] = {}
                if self.block_rng is not None:  # numbered in trace order, as BlockRng says
                    keys = {
                        "seed": self.block_rng.seed,
                        "step": self.block_rng.step,
                        "index": self.block_next,
                    }
                    self.block_next += 1
                return [block_dot_general(lhs, rhs, dims, self.rules.fp8, out_dtype=compute, **keys)]
            return [fp8_dot_general(lhs, rhs, dims, self.rules.fp8, out_dtype=compute)]
        args = [cast(lhs, compute), cast(rhs, compute), *invals[2:]]
        param(eqn, "preferred_element_type")  # the float32 accumulation is asked for through it
        params = dict(eqn.params, preferred_element_type=F32)
        if isinstance(param(eqn, "precision"), jax.lax.DotAlgorithmPreset):
            # An algorithm such as F16_F16_F32 (jax.nn.dot_product_attention's choice for
            # float16) has no CPU lowering; preferred_element_type already asks for
            # float32 accumulation, which every backend supports.
            params["precision"] = None
        out = bind(eqn, args, params)
        return [cast(o, compute) for o in out]

    def call(
        self,
        eqn: Any,
        invals: list[Any],
        rules: bool,
        weak: Sequence[bool],
        island: Sequence[bool] | None = None,
    ) -> list[Any]:
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if closed is None:
            return self.fallback(eqn, invals, "its body is not in its parameters")
        if not isinstance(closed, ClosedJaxpr):
            closed = ClosedJaxpr(closed, ())
        if rules:
            floating = [i for i, v in enumerate(eqn.invars) if is_float(v.aval.dtype) and not weak[i]]
            if floating and island is not None and all(island[i] for i in floating):
                # a function of the float32 the caller made itself: its islands run as traced
                return self.run(closed.jaxpr, closed.consts, invals, True, weak, island)
            cls = self.rules.named_class(func_name(eqn))
            if cls is OpClass.PASSTHROUGH:
                return self.activation(closed, invals, weak)
            if cls is not None:
                return self.run_retyped(closed, self.rules.precast(cls, invals), False, weak)
        return self.run(closed.jaxpr, closed.consts, invals, rules, weak, island)

    def activation(self, closed: Any, invals: list[Any], weak: Sequence[bool]) -> list[Any]:
        """A named activation: PASSTHROUGH at its boundary (results in the input's dtype), the op table
        inside (silu's ``logistic`` runs in float32, as the table's FLOAT32 class says)."""
        outs = self.run(closed.jaxpr, closed.consts, invals, True, weak)
        pairs = [
            (np.dtype(v.aval.dtype), dtype_of(x))
            for v, x in zip(closed.jaxpr.invars, invals, strict=False)
            if is_float(v.aval.dtype) and is_float(dtype_of(x))
        ]
        if not pairs:
            return outs
        traced_in, now = pairs[0]
        return [
            cast(o, now) if is_float(v.aval.dtype) and np.dtype(v.aval.dtype) == traced_in else o
            for o, v in zip(outs, closed.jaxpr.outvars, strict=False)
        ]
