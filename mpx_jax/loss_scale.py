"""A jit-native loss scale: the mpx state machine as an immutable JAX pytree.

:class:`LossScale` holds the five state fields of :class:`mpx.ScalerState` as
device arrays (a float32 scale, four int32 counters) and its
:class:`mpx.ScalerConfig` as *static* pytree metadata.  So:

* ``jax.tree_util`` flattening, ``tree_map``, ``jit`` arguments and results,
  ``lax.cond``/``scan`` carries and leaf-based checkpoints keep every field:
  the leaves are the state, the tree definition carries the whole config
  (``min_scale`` below 1 included, which jmp drops when it flattens);
* changing the scale or the counters never recompiles a jitted function; only
  a different config does (it is part of the tree definition, like a shape);
* ``tree_map(f, loss_scale)`` applies ``f`` to the state arrays only, never to
  config numbers.

:meth:`LossScale.update` is a pure function of arrays built from
``jnp.where`` and integer arithmetic only (no Python branch on a traced
value), bit-identical to :func:`mpx.scaler_update` for every config: the
float32 products are computed exactly (round to nearest even) with integer
operations, because XLA:CPU flushes subnormal float32 results to zero where
numpy does not.

The counters are int32: ``steps`` and ``skipped_steps`` wrap after
2**31 - 1 = 2,147,483,647 updates (68 years at one step a second), and
``growth_interval`` and ``hysteresis`` must be at most 2**31 - 1.

>>> import mpx
>>> ls = LossScale.create(mpx.ScalerConfig(growth_interval=2, min_scale=0.25))
>>> for finite in (True, True, False):
...     ls = ls.update(finite)
>>> float(ls.loss_scale), int(ls.skipped_steps)
(65536.0, 1)
>>> leaves, treedef = jax.tree_util.tree_flatten(ls)
>>> jax.tree_util.tree_unflatten(treedef, leaves).config.min_scale
0.25
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpx
from mpx.scaling import ScalerConfig, ScalerState
from mpx_jax.casting import is_floating_array

__all__ = ["INT32_MAX", "LossScale", "all_finite", "select_tree"]

#: The largest value an int32 counter holds.
INT32_MAX = 2**31 - 1
_INF_BITS = 0x7F800000


def _bits(value: float) -> int:
    """The int32 bit pattern of a non-negative float32 value."""
    return int(np.float32(value).view(np.int32))


def _split(factor: float) -> tuple[int, int]:
    """``float32(factor) == m * 2**e`` with ``m`` a 24-bit integer."""
    mant, exp = math.frexp(float(np.float32(factor)))
    return int(mant * 2**24), exp - 24


def _mul_f32(a: jax.Array, factor: float) -> jax.Array:
    """The int32 bits of ``a * float32(factor)`` rounded to nearest even, subnormals exact.

    ``a`` is a non-negative finite float32 scalar (subnormal or zero allowed),
    ``factor`` a positive constant.  Overflow gives the bits of +inf.
    """
    mb, eb = _split(factor)
    b1, b0 = mb >> 12, mb & 0xFFF
    i32 = jnp.int32
    bits = lax.bitcast_convert_type(a, i32)
    exp_a = lax.shift_right_logical(bits, i32(23))
    man_a = bits & i32(0x7FFFFF)
    ma = jnp.where(exp_a == 0, man_a, man_a | i32(0x800000))
    e = jnp.where(exp_a == 0, i32(1), exp_a) - i32(150) + i32(eb)
    # exact 48-bit product ma * mb = hi * 2**24 + lo, from 12-bit limbs
    a1, a0 = lax.shift_right_logical(ma, i32(12)), ma & i32(0xFFF)
    t0 = a0 * i32(b0)
    t1 = a1 * i32(b0) + a0 * i32(b1)
    t2 = a1 * i32(b1)
    low = t0 + lax.shift_left(t1 & i32(0xFFF), i32(12))
    hi = t2 + lax.shift_right_logical(t1, i32(12)) + lax.shift_right_logical(low, i32(24))
    lo = low & i32(0xFFFFFF)
    nbits = jnp.where(hi > 0, i32(56) - lax.clz(hi), i32(32) - lax.clz(lo))
    # keep 24 significant bits, or stop at the subnormal grid 2**-149
    shift = jnp.maximum(nbits - i32(24), i32(-149) - e)
    s = jnp.clip(shift, 1, 60)
    k = s - 1
    in_lo = s <= 24
    q = jnp.where(
        in_lo,
        lax.shift_left(hi, jnp.clip(24 - s, 0, 31)) | lax.shift_right_logical(lo, jnp.clip(s, 0, 31)),
        lax.shift_right_logical(hi, jnp.clip(s - 24, 0, 31)),
    )
    guard = jnp.where(
        in_lo,
        lax.shift_right_logical(lo, jnp.clip(k, 0, 31)) & 1,
        lax.shift_right_logical(hi, jnp.clip(k - 24, 0, 31)) & 1,
    )
    sticky = jnp.where(
        in_lo,
        (lo & (lax.shift_left(i32(1), jnp.clip(k, 0, 30)) - 1)) != 0,
        (lo != 0) | ((hi & (lax.shift_left(i32(1), jnp.clip(k - 24, 0, 30)) - 1)) != 0),
    )
    rounded = q + (guard & (sticky.astype(i32) | (q & 1)))
    r = jnp.where(shift <= 0, lax.shift_left(lo, jnp.clip(-shift, 0, 31)), rounded)
    top = e + shift + i32(149)
    field = top + lax.shift_right_logical(r, i32(23))
    out = jnp.where(field >= 255, i32(_INF_BITS), top * i32(1 << 23) + r)
    return jnp.where(bits == 0, i32(0), out)


@dataclasses.dataclass(frozen=True, eq=False)
class LossScale:
    """The loss-scaling state on device, with its config (an immutable pytree).

    Build one with :meth:`create` or :meth:`from_state_dict`.  Fields:
    ``loss_scale`` (float32 scalar), ``growth_tracker``,
    ``consecutive_nonfinite``, ``steps``, ``skipped_steps`` (int32 scalars)
    and ``config`` (the :class:`mpx.ScalerConfig`, static metadata).
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    consecutive_nonfinite: jax.Array
    steps: jax.Array
    skipped_steps: jax.Array
    config: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)

    # -- construction ----------------------------------------------------------
    @classmethod
    def create(cls, config: ScalerConfig | None = None) -> LossScale:
        """A fresh loss scale for ``config`` (default: ``mpx.ScalerConfig()``, dynamic, 2**16).

        Raises:
            ScalerConfigError: when ``config`` is not an ``mpx.ScalerConfig``.
            ValueError: when ``growth_interval`` or ``hysteresis`` exceeds int32.
        """
        config = _check_config(config)
        return cls._from_state(config, mpx.scaler_init(config))

    @classmethod
    def _from_state(cls, config: ScalerConfig, state: ScalerState) -> LossScale:
        for name in ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"):
            if getattr(state, name) > INT32_MAX:
                raise ValueError(
                    f"{name}: {getattr(state, name)} does not fit the int32 counter of LossScale."
                )
        return cls(
            loss_scale=jnp.asarray(state.scale, jnp.float32),
            growth_tracker=jnp.asarray(state.growth_tracker, jnp.int32),
            consecutive_nonfinite=jnp.asarray(state.consecutive_nonfinite, jnp.int32),
            steps=jnp.asarray(state.steps, jnp.int32),
            skipped_steps=jnp.asarray(state.skipped_steps, jnp.int32),
            config=config,
        )

    # -- use ---------------------------------------------------------------------
    def scale(self, tree: Any) -> Any:
        """Multiply every floating leaf of ``tree`` (usually the loss) by the scale.

        Half-precision leaves come back float32 (a float16 loss times 2**16
        would overflow float16); float32 and float64 leaves keep their dtype.
        Non-floating leaves are returned unchanged.
        """
        scale = self.loss_scale

        def mul(x: Any) -> Any:
            if not is_floating_array(x):
                return x
            return jnp.asarray(x).astype(_at_least_f32(x.dtype)) * scale.astype(_at_least_f32(x.dtype))

        return jax.tree_util.tree_map(mul, tree)

    def unscale(self, tree: Any) -> Any:
        """Divide every floating leaf of ``tree`` (the gradients) by the scale; results float32.

        Half-precision leaves are cast to float32 first, so small unscaled
        gradients do not underflow; float64 leaves stay float64.  Each leaf is
        multiplied by the float32 reciprocal of the scale (as torch does).
        """
        inv = jnp.float32(1.0) / self.loss_scale
        none = self.config.kind == "none"

        def div(x: Any) -> Any:
            if not is_floating_array(x):
                return x
            wide = jnp.asarray(x).astype(_at_least_f32(x.dtype))
            return wide if none else wide * inv.astype(wide.dtype)

        return jax.tree_util.tree_map(div, tree)

    def update(self, finite: Any) -> LossScale:
        """The loss scale after a step whose gradients were ``finite`` (a bool scalar, traced or not).

        Exactly :func:`mpx.scaler_update`, with ``jnp.where`` in place of each branch.
        """
        finite = jnp.asarray(finite)
        if finite.shape != ():
            raise ValueError(f"finite: expected a scalar boolean, got an array of shape {finite.shape}.")
        finite = finite.astype(bool)
        cfg = self.config
        i32 = jnp.int32
        consecutive = jnp.where(finite, i32(0), self.consecutive_nonfinite + 1)
        skipped = jnp.logical_and(jnp.logical_not(finite), cfg.skip_nonfinite)
        scale, tracker = self.loss_scale, self.growth_tracker
        if cfg.kind == "dynamic":
            lo, hi = cfg.bounds
            sbits = lax.bitcast_convert_type(scale, i32)
            grown = _mul_f32(scale, cfg.growth_factor)
            grown = jnp.where(grown < _INF_BITS, jnp.minimum(grown, i32(_bits(hi))), sbits)
            backed = jnp.maximum(_mul_f32(scale, cfg.backoff_factor), i32(_bits(lo)))
            counted = tracker + 1
            hit = counted == cfg.growth_interval
            new_bits = jnp.where(
                finite,
                jnp.where(hit, grown, sbits),
                jnp.where(consecutive >= cfg.hysteresis, backed, sbits),
            )
            scale = lax.bitcast_convert_type(new_bits, jnp.float32)
            tracker = jnp.where(finite, jnp.where(hit, i32(0), counted), i32(0))
        return dataclasses.replace(
            self,
            loss_scale=scale,
            growth_tracker=tracker,
            consecutive_nonfinite=consecutive,
            steps=self.steps + 1,
            skipped_steps=self.skipped_steps + skipped.astype(i32),
        )

    # -- host side ---------------------------------------------------------------
    @property
    def state(self) -> ScalerState:
        """The state as an :class:`mpx.ScalerState` (reads the device values: not under ``jit``)."""
        values = jax.device_get(
            (self.loss_scale, self.growth_tracker, self.consecutive_nonfinite, self.steps, self.skipped_steps)
        )
        return ScalerState(float(values[0]), *(int(v) for v in values[1:]))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (``mpx.scaler/1``), the same as every mpx backend's."""
        return mpx.state_dict(self.config, self.state)

    @classmethod
    def from_state_dict(cls, data: Mapping[str, Any]) -> LossScale:
        """A loss scale resumed from a :meth:`state_dict` dict (from any backend).

        Raises:
            StateDictError: for a malformed dict (see :func:`mpx.load_state_dict`).
        """
        config, state = mpx.load_state_dict(data)
        _check_config(config)
        return cls._from_state(config, state)

    def __repr__(self) -> str:
        try:
            return f"LossScale(kind={self.config.kind!r}, scale={float(self.loss_scale)}, steps={int(self.steps)})"
        except Exception:  # traced values
            return f"LossScale(kind={self.config.kind!r}, traced)"


jax.tree_util.register_dataclass(
    LossScale,
    data_fields=["loss_scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"],
    meta_fields=["config"],
)


def _check_config(config: Any) -> ScalerConfig:
    if config is None:
        return ScalerConfig()
    if not isinstance(config, ScalerConfig):
        raise mpx.ScalerConfigError(
            f"config: expected an mpx.ScalerConfig or None, got {type(config).__name__}"
        )
    for name in ("growth_interval", "hysteresis"):
        if getattr(config, name) > INT32_MAX:
            raise ValueError(
                f"{name}: {getattr(config, name)} exceeds the int32 counters of LossScale (at most {INT32_MAX})."
            )
    return config


def _at_least_f32(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def all_finite(tree: Any) -> jax.Array:
    """A boolean scalar: True when no floating leaf of ``tree`` holds an inf or a NaN.

    Non-floating leaves are ignored; an empty tree is finite.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])})), bool(all_finite({}))
    (False, True)
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_floating_array(x)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """Leaf by leaf ``on_true if pred else on_false`` for a boolean scalar ``pred`` (jit-safe).

    Both trees must have the same structure, shapes and dtypes.

    >>> select_tree(jnp.asarray(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})["a"].tolist()
    [0.0, 0.0]
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"pred: expected a boolean scalar, got dtype {pred.dtype} and shape {pred.shape}.")
    ta, tb = jax.tree_util.tree_structure(on_true), jax.tree_util.tree_structure(on_false)
    if ta != tb:
        raise ValueError(f"select_tree: the two trees differ in structure: {ta} and {tb}.")

    def sel(a: Any, b: Any) -> Any:
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(
                f"select_tree: leaves differ: {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}."
            )
        return lax.select(pred, a, b) if a.shape == () else jnp.where(pred, a, b)

    return jax.tree_util.tree_map(sel, on_true, on_false)
