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

Named activations (``jax.nn.silu``, ``relu``, ``gelu``, ``elu``...) are
PASSTHROUGH at their boundary (their result has their input's dtype) and
follow the op table inside: silu's ``logistic`` runs in float32.

**The authors' float32 stays float32.**  Two kinds of values start a
float32 island: float32 that ``fn`` makes from nothing the caller passed in
(``jnp.arange(n, dtype=jnp.float32)`` positions, frequencies computed from
them, constants and numpy arrays it builds, floats converted from integers,
random bits), and an explicit upcast, ``x.astype(jnp.float32)``, of a value
the trace holds in half precision.  Everything computed from islands alone is
an island: its equations run at their traced dtypes, a matmul or einsum of
them is not lowered and a named function of them is not reclassified (a
FLOAT32 op's result still stays float32).  keras-hub's rotary embedding
computes ``einsum("bi,j->bij", positions, inverse_freq)`` this way: lowered
to bfloat16 it loses long-context positions (max error 7.4 at 2048 positions
against 0.029 for Keras's own ``mixed_bfloat16``; kept in float32, 0.014).
Where an island meets a value the caller passed in (a parameter, an input,
a ``jax.Array`` the function closes over), the op table applies as usual.
The trace is taken at the dtypes of the arguments, so an upcast of a value
that is float32 there (a float32 input) is a no-op JAX does not record and
starts no island; it does when the caller passes half-precision values.
(Tracing at the compute dtype instead would show those upcasts, but also
every cast a framework inserts, such as a Keras float32 layer casting its
inputs to float32, which would keep every layer out of the policy.)

**A nested float32 autocast forces float32**, like ``torch.autocast(
enabled=False)`` and mpx_torch's float32 policy inside a mixed one:
``autocast(g, "float32")`` called inside ``autocast(f, "mixed_bfloat16")``
computes the LOWER and FLOAT32 ops of ``g`` at float32 (half inputs cast up),
nothing in ``g`` lowered.  Outside a mixed autocast it runs ``g`` unchanged.
The regions are JAX name scopes (``mpx_autocast_float32``, and
``mpx_autocast`` for a mixed autocast, so the innermost one decides).

Sub-jaxprs are transformed too: ``jit``/``pjit`` calls are inlined,
``scan``/``while_loop``/``cond`` are rebuilt with ``lax.scan``/``lax.while_loop``/
``lax.switch`` (loop carries keep their traced dtypes, so a carry never
changes type between iterations), ``jax.checkpoint`` is kept, and
``custom_jvp``/``custom_vjp`` functions are rebuilt so that their own
derivative rules still apply (run at the dtypes they were traced at).
Scatters and generic reductions run at their traced dtypes (their combiner
jaxpr is traced at one dtype).  Any other primitive with a sub-jaxpr, and
any primitive that refuses the new dtypes, runs exactly as traced (its
inputs cast back to the traced dtypes) after a
:class:`AutocastFallbackWarning` naming the primitive and the dtypes (once
per primitive and autocast function); ``strict=True`` raises
:class:`AutocastError` instead.

**FP8** (a policy with ``fp8=``, :mod:`mpx.float8`): every ``dot_general`` the op table lowers and
that has no batch dimensions (``x @ w``, a linear layer, ``einsum("btd,df->btf", ...)``) runs as
:func:`mpx_jax.float8.fp8_dot_general`: both operands quantized from the values as they arrive
(float32 master weights from float32, never through a bfloat16 copy) in the recipe's forward format
(e4m3), ``lax.dot_general`` on the float8 operands with float32 accumulation, both inverse scales,
the result in the compute dtype; the backward quantizes the output gradient (e5m2 under ``hybrid``)
and runs both transposed products on the quantized values.  A non-finite operand or gradient makes
that product NaN, so the loss scaler skips the step.  Batched dot_generals (``bmm``,
attention's products) and convolutions follow the compute dtype, as the op table's ``bmm``,
``attention`` and ``conv`` do; so does everything else (norms, softmax, losses, elementwise ops),
as without FP8; nothing inside a nested float32 autocast or a float32 island is FP8.

A function transform has no place for per-tensor state, so autocast's FP8 is *current* scaling:
each operand's scale comes from its own amax (:func:`mpx.float8.compute_scale` with
``scaling="current"``, torchao's ``tensorwise``).  The policy must say so (``fp8_scaling=current``,
or the preset ``mixed_bfloat16_fp8_current``): a delayed-scaling recipe (``fp8=hybrid`` alone,
``mixed_bfloat16_fp8``) raises :class:`mpx.Float8Error` rather than run a different recipe than
the policy names.  Delayed scaling keeps state that must commit only on applied optimizer steps;
it lives in the Flax layers, :class:`mpx_jax.float8_flax.Float8Linear` (NNX) and
:class:`mpx_jax.float8_linen.Float8Dense` (linen), which carry it explicitly.  A policy whose
compute dtype is float32 (``float32,fp8=hybrid,fp8_scaling=current``) runs FP8 dots in a float32
program.  Under ``jax.vmap`` each mapped slice is quantized with its own amax, as ``fn`` applied to
that slice alone.

**Block-scaled recipes** (``fp8=mxfp8``, ``fp8=fp8_blockwise``, ``fp4=nvfp4``...,
:class:`mpx.blocks.BlockRecipe`): the same dot_generals run as :func:`mpx_jax.blocks.block_dot_general`,
each GEMM's operands quantized and dequantized by the core's kernel along that GEMM's reduction
dimension (forward, input gradient, weight gradient: the roles and blocks of ``mpx_torch``'s
``BlockLinear``), then multiplied in float32 (emulated) and the result returned in the compute dtype.
Block scales are stateless, so they need no ``fp8_scaling``.  A seeded recipe (``fp4=nvfp4_te``: stochastic
rounding of gradients, the random Hadamard transform) needs ``rng=mpx_jax.blocks.BlockRng(seed, step)``:
``step`` is a traced int32 scalar you pass in (one compile serves every step), and the block dots are
numbered ``rng.index``, ``rng.index + 1``... in trace order (their gradients' keys ``2 * i`` and
``2 * i + 1``, torch ``BlockLinear``'s).

The result composes with ``jit``, ``grad`` and ``vmap`` in either order.
Outputs are not cast to the output dtype: do that
with :func:`mpx_jax.cast_to_output` where you want it.

>>> import jax.numpy as jnp
>>> def f(x, w):
...     h = x @ w
...     return h, jax.nn.softmax(h), jnp.sum(h)
>>> h, p, s = autocast(f, "mixed_bfloat16")(jnp.ones((2, 3)), jnp.ones((3, 4)))
>>> h.dtype, p.dtype, s.dtype
(dtype(bfloat16), dtype('float32'), dtype('float32'))
>>> float32 = autocast(lambda x, w: x @ w, "float32")
>>> autocast(lambda x, w: float32(x, w) + 1, "mixed_bfloat16")(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
dtype('float32')
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import mpx
from mpx.ops import OpTable
from mpx.policy import PolicySpec
from mpx_jax._autocast_interpreter import (
    FLOAT32_SCOPE,
    MIXED_SCOPE,
    AutocastError,
    AutocastFallbackWarning,
    Interpreter,
)
from mpx_jax._autocast_rules import PRIMITIVE_OPS, Rules, rule_primitives
from mpx_jax._compat import check_autocast_primitives, softmax_custom_jvp
from mpx_jax.blocks import BlockRng, is_seeded

__all__ = ["PRIMITIVE_OPS", "AutocastError", "AutocastFallbackWarning", "autocast"]


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def autocast(
    fn: Callable[..., Any],
    policy: PolicySpec,
    *,
    op_table: OpTable | None = None,
    strict: bool = False,
    rng: BlockRng | None = None,
) -> Callable[..., Any]:
    """``fn`` with every op run in the dtype the op table gives it under ``policy``.

    Args:
        fn: any JAX function of arrays (other arguments, such as Python
            numbers, strings or flags, are static: they are baked into the trace).
        policy: an :class:`mpx.Policy` or a spec string; only its compute dtype,
            ``keep_fp32`` and ``fp8`` recipe matter here (overrides name modules, which
            a function has none of).  An FP8 recipe must use current scaling; a block
            recipe (:class:`mpx.blocks.BlockRecipe`) runs as it is.
        op_table: the op classes (default :data:`mpx.OP_TABLE`); change one
            with ``mpx.OP_TABLE.replace(softmax="lower")``.
        strict: raise :class:`AutocastError` when an equation cannot run at
            the dtypes the op table gives it (default False: a
            :class:`AutocastFallbackWarning`, and it runs at its traced dtypes).
        rng: the keys of a seeded block recipe (:class:`mpx_jax.blocks.BlockRng`: ``seed``, the traced
            ``step``, the first dot's ``index``); required under one, ignored otherwise (default None).

    Returns:
        A function with ``fn``'s signature and outputs.  For a policy that does
        not lower precision (``float32``, ``float64``): ``fn`` run unchanged,
        except inside a mixed autocast, where its LOWER and FLOAT32 ops compute
        at float32 (a nested float32 region).

    Raises:
        mpx.PolicyError: a bad policy; mpx.Float8Error: an FP8 recipe with delayed
        scaling, or a seeded block recipe without ``rng``; mpx.MPXError: ``op_table`` is not an
        :class:`mpx.OpTable`, ``strict`` not a bool or ``rng`` not a ``BlockRng``.

    Warns:
        mpx.SlowPolicyWarning: once per process, when the compute dtype is
            measured slow on ``jax.default_backend()`` (float16 and bfloat16 on
            XLA:CPU; see :mod:`mpx.advice`; ``MPX_NO_SLOW_WARNING=1`` silences it).
    """
    pol = mpx.get_policy(policy)
    table = mpx.OP_TABLE if op_table is None else op_table
    if not isinstance(table, OpTable):
        raise mpx.MPXError(
            f"op_table: expected an mpx.OpTable (mpx.OP_TABLE or mpx.OP_TABLE.replace(...)), got "
            f"{type(table).__name__}"
        )
    if not isinstance(strict, bool):
        raise mpx.MPXError(f"strict: expected True or False, got {type(strict).__name__}")
    if isinstance(pol.fp8, mpx.Float8Recipe) and pol.fp8.scaling != "current":
        raise mpx.Float8Error(
            f"policy: mpx_jax.autocast runs FP8 with current scaling only (a function transform keeps "
            f"no per-tensor state), but {str(pol)!r} asks for {pol.fp8.scaling} scaling. Add "
            "fp8_scaling=current to the policy (or use the preset mixed_bfloat16_fp8_current), or "
            "use the Flax layers mpx_jax.float8_flax.Float8Linear / mpx_jax.float8_linen.Float8Dense, "
            "which keep delayed-scaling state."
        )
    if rng is not None and not isinstance(rng, BlockRng):
        raise mpx.MPXError(
            f"rng: expected an mpx_jax.blocks.BlockRng(seed, step, index) or None, got {type(rng).__name__}"
        )
    if is_seeded(pol.fp8) and rng is None:
        raise mpx.Float8Error(
            f"rng: {str(pol)!r} rounds gradients stochastically or applies the Hadamard transform, so "
            "mpx_jax.autocast needs rng=mpx_jax.blocks.BlockRng(seed, step) (a Python int seed, the step "
            "as a traced int32 scalar)."
        )
    check_autocast_primitives(rule_primitives())
    mpx.warn_if_slow("jax", pol, jax.default_backend(), stacklevel=3)
    if not pol.lowers_precision and pol.fp8 is None:

        @functools.wraps(fn)
        def region(*args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(FLOAT32_SCOPE):
                return fn(*args, **kwargs)

        return region

    rules = Rules(pol, table)
    interp = Interpreter(rules, strict=strict).with_float32_regions()
    interp.block_rng = rng

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

        interp.block_next = 0 if rng is None else rng.index
        with jax.named_scope(MIXED_SCOPE):
            if rules.softmax_by_name():
                with softmax_custom_jvp(True):
                    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dynamic)
            else:
                closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*dynamic)
            outs = interp.run_closed(closed, dynamic, rules=True)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
