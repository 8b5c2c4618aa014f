"""autocast's op rules: which class of the mpx op table a JAX primitive or named function belongs to,
and the analyses of one jaxpr that decide where those classes apply.

* :data:`PRIMITIVE_OPS` maps primitives to the op table's canonical ops; :data:`FLOAT32_PRIMITIVES`
  are outside the table and run in float32 (after torch's CUDA float32 list); :data:`NAMED` maps the
  names JAX keeps on ``jit``/``custom_jvp`` calls (``jax.nn.softmax``...) to ops.
* :meth:`Rules.float32_fed`: elementwise work whose every use wants float32 (the difference and square
  of a hand-written MSE) runs in float32.
* :func:`float32_islands`: the float32 the function makes itself (``iota``/``arange`` positions,
  constants, values converted from integers, random bits) or upcasts explicitly from a half-precision
  value, and everything computed from those alone: the float32 islands autocast runs as traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpx
from mpx.blocks import BlockRecipe
from mpx.float8 import Float8Recipe
from mpx.ops import OpClass, OpTable
from mpx_jax._compat import INLINE_CALL_PRIMITIVES, ClosedJaxpr, Jaxpr, Literal, function_name, param

__all__ = ["FLOAT32_PRIMITIVES", "NAMED", "PRIMITIVE_OPS", "Rules", "float32_islands"]

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
FLOAT32_PRIMITIVES = frozenset(
    {
        "reduce_max", "reduce_min", "cummax", "cummin", "logistic", "rsqrt",
        "erf_inv", "lgamma", "digamma", "tan", "acos", "asin", "cosh", "sinh",
    }
)  # fmt: skip
LOWERABLE = frozenset({"dot_general", "conv_general_dilated"})
#: primitives the rules above name that jax.extend.core.primitives does not export (not version-checked)
UNEXPORTED = frozenset({"ragged_dot_general"})
#: names JAX keeps on jit/custom_jvp calls -> canonical op (None: an activation, PASSTHROUGH).
NAMED: dict[str, str | None] = {
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
HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
F32 = np.dtype(np.float32)
#: structural primitives whose result is as weak as their inputs (a cast or broadcast of a scalar constant)
WEAK_KEEPING = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy"})
#: elementwise and structural primitives: a float32 result stays "computed in float32" through them, and
#: they run in float32 themselves when every value they make feeds float32 work (float32_fed)
ELEMENTWISE = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "sqrt", "abs", "max", "min", "sign", "square", "integer_pow",
        "broadcast_in_dim", "reshape", "squeeze", "select_n", "copy", "transpose",
    }
)  # fmt: skip


def rule_primitives() -> frozenset[str]:
    """Every primitive name the rules match on (checked against this JAX when autocast is built)."""
    return (PRIMITIVE_OPS.keys() | FLOAT32_PRIMITIVES | LOWERABLE | ELEMENTWISE | WEAK_KEEPING) - UNEXPORTED


def is_float(dtype: Any) -> bool:
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def dtype_of(x: Any) -> Any:
    return getattr(x, "dtype", None)


def cast(x: Any, dtype: Any) -> Any:
    """``x`` converted to ``dtype`` when both are floating and differ; anything else as it is."""
    dt = dtype_of(x)
    if not is_float(dt) or not is_float(dtype) or np.dtype(dt) == np.dtype(dtype):
        return x
    return lax.convert_element_type(x, dtype)


def has_subjaxpr(params: dict[str, Any]) -> bool:
    def is_jaxpr(v: Any) -> bool:
        return isinstance(v, (Jaxpr, ClosedJaxpr))

    for v in params.values():
        if is_jaxpr(v) or (isinstance(v, (tuple, list)) and any(is_jaxpr(u) for u in v)):
            return True
    return False


def func_name(eqn: Any) -> str | None:
    """The name JAX kept on a call equation (``jax.nn.softmax`` -> ``"softmax"``), or None."""
    return function_name(eqn)


def is_weak_var(v: Any) -> bool:
    return isinstance(v, Literal) or bool(getattr(v.aval, "weak_type", False))


def float32_islands(jaxpr: Any, consts: Sequence[Any], island_args: Sequence[bool] | None = None) -> set[Any]:
    """The floating variables of ``jaxpr`` that are the function's own float32: its float32 islands.

    An island starts where the function makes float32 from nothing the caller passed in: an ``iota``
    (``jnp.arange(n, dtype=jnp.float32)``), a constant it builds (``jnp.zeros``, a numpy array it
    converts), a float converted from integers or booleans, random bits; or where it upcasts a value
    the trace holds in half precision (``x.astype(jnp.float32)``, a ``convert_element_type`` from
    float16/bfloat16 to float32).  Results of equations whose floating operands are all islands
    (weakly typed scalars aside) are islands too: keras-hub's rotary ``einsum("bi,j->bij", positions,
    inverse_freq)`` is.  A closed-over ``jax.Array`` (a parameter a function closes over) is not.
    ``island_args`` marks arguments that are islands in the caller's jaxpr (a ``jit`` call's operands).
    """
    island: set[Any] = {
        v
        for v, c in zip(jaxpr.constvars, consts, strict=False)
        if is_float(v.aval.dtype) and not isinstance(c, jax.Array)
    }
    island.update(v for v, i in zip(jaxpr.invars, island_args or (), strict=False) if i)
    for eqn in jaxpr.eqns:
        flags = [isinstance(v, Literal) or v in island for v in eqn.invars]
        if eqn.primitive.name in INLINE_CALL_PRIMITIVES and isinstance(eqn.params.get("jaxpr"), ClosedJaxpr):
            body = eqn.params["jaxpr"]
            inner = float32_islands(body.jaxpr, body.consts, flags)
            island.update(
                v
                for v, w in zip(eqn.outvars, body.jaxpr.outvars, strict=False)
                if isinstance(w, Literal) or w in inner
            )
        elif eqn.primitive.name == "convert_element_type" and _upcast(eqn):
            island.update(eqn.outvars)
        elif not has_subjaxpr(eqn.params) and all(
            f for v, f in zip(eqn.invars, flags, strict=True) if is_float(v.aval.dtype) and not is_weak_var(v)
        ):
            island.update(v for v in eqn.outvars if is_float(v.aval.dtype))
    return island


def _upcast(eqn: Any) -> bool:
    """Whether a ``convert_element_type`` equation casts a half-precision value to float32."""
    (x,) = eqn.invars
    return np.dtype(x.aval.dtype) in HALF and np.dtype(param(eqn, "new_dtype")) == F32


class Rules:
    """The op table under one policy: the class of a primitive or named function, and the casts it asks."""

    def __init__(
        self, policy: mpx.Policy, table: OpTable, compute: np.dtype | None = None, *, fp8: bool = True
    ) -> None:
        self.policy = policy
        self.table = table
        self.compute = compute if compute is not None else mpx.numpy_dtype(policy.compute_dtype)
        #: the FP8 recipe of the LOWER dots (None: no FP8 here, as in a nested float32 region)
        self.fp8: Float8Recipe | BlockRecipe | None = policy.fp8 if fp8 and mpx.ops.as_op_table(table).fp8_applies("matmul", policy) else None

    def fp8_dot(self, eqn: Any) -> bool:
        """Whether a LOWER equation runs as an FP8 GEMM: a ``dot_general`` without batch dimensions
        (``x @ w``, a linear layer, an einsum such as ``"btd,df->btf"``) under a policy with FP8.

        A ``dot_general`` with batch dimensions is a ``bmm`` (attention's query-key and
        probability-value products, a batched ``jnp.matmul``), which FP8 leaves to the compute dtype as
        the op table's ``bmm`` and ``attention`` (:data:`mpx.FP8_OPS` is linear, matmul, einsum).
        """
        if self.fp8 is None or eqn.primitive.name != "dot_general":
            return False
        (_, (lhs_batch, _)) = param(eqn, "dimension_numbers")
        return not tuple(lhs_batch)

    def op_class(self, name: str) -> OpClass:
        op = PRIMITIVE_OPS.get(name)
        if op is not None and op in self.table:
            return self.table.classify(op, self.policy)
        if name in FLOAT32_PRIMITIVES:
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
        if name not in NAMED:
            return None
        op = NAMED[name]
        if op is None or op not in self.table:
            return OpClass.PASSTHROUGH
        return self.table.classify(op, self.policy)

    def precast(self, cls: OpClass, invals: Sequence[Any]) -> list[Any]:
        if cls is OpClass.FLOAT32:
            return [cast(x, F32) if dtype_of(x) in HALF else x for x in invals]
        if cls is OpClass.LOWER:
            return [cast(x, self.compute) if dtype_of(x) in (*HALF, F32) else x for x in invals]
        return list(invals)

    def float32_fed(self, jaxpr: Any) -> set[Any]:
        """Floating variables whose every use wants float32, so elementwise work producing them runs in it.

        A use wants float32 when it is a FLOAT32 op (a reduction, ``exp``...), a cast to float32, or
        elementwise work whose own results are float32-fed; a value the jaxpr returns is never
        float32-fed.  So the ``a - b`` and the square of ``jnp.mean((a - b) ** 2)`` run in float32
        like the mean, where a half-precision difference would be rounded before it is reduced,
        while ``x ** 3`` inside gelu, whose result feeds a matmul or is returned, stays in the input
        dtype.
        """
        returned = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        uses: dict[Any, list[bool]] = {}
        fed: set[Any] = set()
        for eqn in reversed(jaxpr.eqns):
            for v in eqn.outvars:
                wants = uses.get(v)
                if wants and all(wants) and v not in returned and is_float(v.aval.dtype):
                    fed.add(v)
            name = eqn.primitive.name
            if name in ELEMENTWISE:
                want = bool(eqn.outvars) and all(v in fed for v in eqn.outvars)
            elif name == "convert_element_type":
                want = np.dtype(param(eqn, "new_dtype")) == F32
            else:
                want = not has_subjaxpr(eqn.params) and self.op_class(name) is OpClass.FLOAT32
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    uses.setdefault(v, []).append(want)
        return fed
