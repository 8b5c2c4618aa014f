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
value), bit-identical to :func:`mpx.scaler_update` for every config: each
product is torch's ``float32(float64(scale) * float64(factor))``, evaluated
without float64 by :func:`mpx.scaling.product_bits` (int32 operations on the
scale's bits and the core's exact split of the factor).

The counters are int32 and saturate, as the reference's, at 2**31 - 1 =
2,147,483,647 (68 years at one step a second); the core bounds
``growth_interval``, ``hysteresis`` and every loaded counter there, so any
state dict the core accepts loads here.

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
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import mpx
from mpx.scaling import INF_BITS, FactorSplit, ScalerConfig, ScalerState, product_bits
from mpx_jax.casting import is_floating_array

__all__ = ["INT32_MAX", "STATE_FIELDS", "LossScale", "all_finite", "select_tree"]

#: The state fields of a :class:`LossScale`, in pytree order: its leaves.
STATE_FIELDS = ("loss_scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps")

#: The largest value an int32 counter holds (:data:`mpx.COUNTER_MAX`).
INT32_MAX = mpx.COUNTER_MAX


def _bits(value: float) -> int:
    """The int32 bit pattern of a non-negative float32 value."""
    return int(np.float32(value).view(np.int32))


def _product_bits(scale: jax.Array, split: FactorSplit) -> jax.Array:
    """The int32 bits of ``float32(float64(scale) * factor)`` (0 below 2**-126, +inf's bits on overflow).

    ``scale`` is a normal positive float32 scalar, ``split`` the core's
    :func:`mpx.scaling.split_factor` of the factor.
    """
    return product_bits(lax.bitcast_convert_type(scale, jnp.int32), split, jnp.where)


@dataclasses.dataclass(frozen=True, eq=False)
class LossScale:
    """The loss-scaling state on device, with its config (an immutable pytree).

    Build one with :meth:`create` or :meth:`from_state_dict`.  Fields:
    ``loss_scale`` (float32 scalar), ``growth_tracker``,
    ``consecutive_nonfinite``, ``steps``, ``skipped_steps`` (int32 scalars)
    and ``config`` (the :class:`mpx.ScalerConfig`, static metadata).

    The surface every mpx scaler shares (:data:`mpx.testing.SURFACE_NAMES`):
    ``config``, ``state`` (an :class:`mpx.ScalerState`), ``get_scale()`` (a
    Python float), ``scale(tree)``, ``state_dict()`` and ``load_state_dict(d)``
    (which returns the loaded ``LossScale``: this one is immutable).  The
    counters are read through ``state``.
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    consecutive_nonfinite: jax.Array
    steps: jax.Array
    skipped_steps: jax.Array
    config: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)

    # -- construction ----------------------------------------------------------
    @classmethod
    def create(cls, config: Any = None) -> LossScale:
        """A fresh loss scale for ``config`` (default: ``mpx.ScalerConfig()``, dynamic, 2**16).

        ``config``: anything :func:`mpx.as_scaler_config` reads: None, an
        ``mpx.ScalerConfig``, its ``to_dict()`` dict, or a policy (an
        ``mpx.Policy``, a spec string such as ``"mixed_float16"``, a policy dict).

        Raises:
            ScalerConfigError: for any other type or a bad config dict.
            PolicyError: for a string or dict that is not a policy spec.
        """
        config = mpx.as_scaler_config(config)
        return cls._from_state(config, mpx.scaler_init(config))

    @classmethod
    def _from_state(cls, config: ScalerConfig, state: ScalerState) -> LossScale:
        for name in ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"):
            if getattr(state, name) > INT32_MAX:  # the core bounds them: unreachable from a state dict
                raise mpx.StateDictError(
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
        scale = plain_loss_scale(self).loss_scale

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
        inv = jnp.float32(1.0) / plain_loss_scale(self).loss_scale
        none = self.config.kind == "none"

        def div(x: Any) -> Any:
            if not is_floating_array(x):
                return x
            wide = jnp.asarray(x).astype(_at_least_f32(x.dtype))
            return wide if none else wide * inv.astype(wide.dtype)

        return jax.tree_util.tree_map(div, tree)

    def update(self, finite: Any, loss_finite: Any = None) -> LossScale:
        """The loss scale after a step whose gradients were ``finite`` (a bool scalar, traced or not).

        Exactly :func:`mpx.scaler_update`, with ``jnp.where`` in place of each branch.
        ``loss_finite`` (optional bool scalar: was the forward loss finite) is
        read by stuck detection only (``config.max_consecutive_skips``, which
        adds a ``jax.debug.callback``, see :mod:`mpx_jax.history`); with the
        option off nothing is added.
        """
        self = plain_loss_scale(self)  # the values of NNX variables (nnx.Optimizer's OptArray)
        if not isinstance(finite, (bool, int, np.bool_, np.integer, np.ndarray, jax.Array)):
            raise mpx.UnsupportedTypeError(
                f"finite: expected a boolean scalar (a bool or a jax/numpy array), got {type(finite).__name__}."
            )
        finite = jnp.asarray(finite)
        if finite.shape != ():
            raise mpx.MPXError(f"finite: expected a scalar boolean, got an array of shape {finite.shape}.")
        finite = finite.astype(bool)
        cfg = self.config
        i32 = jnp.int32

        def bump(counter: jax.Array, by: Any) -> jax.Array:  # + by, saturating at INT32_MAX
            return counter + jnp.logical_and(by, counter < INT32_MAX).astype(i32)

        consecutive = jnp.where(finite, i32(0), bump(self.consecutive_nonfinite, True))
        skipped = jnp.logical_and(jnp.logical_not(finite), cfg.skip_nonfinite)
        scale, tracker = self.loss_scale, self.growth_tracker
        if cfg.kind == "dynamic":
            lo, hi = cfg.bounds
            sbits = lax.bitcast_convert_type(scale, i32)
            grown = _product_bits(scale, cfg.growth_split)
            grown = jnp.where(grown < INF_BITS, jnp.minimum(grown, i32(_bits(hi))), sbits)
            # floored at min_scale (2**-126 for None): a result below 2**-126 comes back as 0
            backed = jnp.maximum(_product_bits(scale, cfg.backoff_split), i32(_bits(lo)))
            counted = tracker + 1
            hit = counted == cfg.growth_interval
            new_bits = jnp.where(
                finite,
                jnp.where(hit, grown, sbits),
                jnp.where(consecutive >= cfg.hysteresis, backed, sbits),
            )
            scale = lax.bitcast_convert_type(new_bits, jnp.float32)
            tracker = jnp.where(finite, jnp.where(hit, i32(0), counted), i32(0))
        if cfg.max_consecutive_skips is not None:
            from mpx_jax.history import stuck_callback

            stuck_callback(cfg, scale, consecutive, loss_finite)
        return dataclasses.replace(
            self,
            loss_scale=scale,
            growth_tracker=tracker,
            consecutive_nonfinite=consecutive,
            steps=bump(self.steps, True),
            skipped_steps=bump(self.skipped_steps, skipped),
        )

    # -- host side ---------------------------------------------------------------
    @property
    def state(self) -> ScalerState:
        """The state as an :class:`mpx.ScalerState` (reads the device values: not under ``jit``)."""
        plain = plain_loss_scale(self)
        values = jax.device_get(tuple(getattr(plain, name) for name in STATE_FIELDS))
        return ScalerState(float(values[0]), *(int(v) for v in values[1:]))

    def get_scale(self) -> float:
        """The current scale as a Python float (a host read: not under ``jit``; there use ``loss_scale``)."""
        return float(jax.device_get(plain_loss_scale(self).loss_scale))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (``mpx.scaler/1``), the same as every mpx backend's."""
        return mpx.state_dict(self.config, self.state)

    def load_state_dict(self, data: Mapping[str, Any]) -> LossScale:
        """The loss scale saved in ``data`` (a :meth:`state_dict` dict, from any backend).

        ``LossScale`` is immutable, so this returns the loaded value (its config
        and state are ``data``'s) and leaves ``self`` as it is; the same as
        :meth:`from_state_dict`.  Put it back into an optimizer state with
        :func:`mpx_jax.set_loss_scale`.

        Raises:
            StateDictError: for a malformed dict (see :func:`mpx.load_state_dict`).
        """
        return type(self).from_state_dict(data)

    @classmethod
    def from_state_dict(cls, data: Mapping[str, Any]) -> LossScale:
        """A loss scale resumed from a :meth:`state_dict` dict (from any backend).

        Raises:
            StateDictError: for a malformed dict (see :func:`mpx.load_state_dict`).
        """
        config, state = mpx.load_state_dict(data)
        return cls._from_state(config, state)

    def __repr__(self) -> str:
        plain = plain_loss_scale(self)
        try:
            return f"LossScale(kind={self.config.kind!r}, scale={float(plain.loss_scale)}, steps={int(plain.steps)})"
        except TypeError:  # traced values (ConcretizationTypeError), or stand-ins such as NNX's VariableRepr
            return f"LossScale(kind={self.config.kind!r}, traced)"


jax.tree_util.register_dataclass(
    LossScale,
    data_fields=["loss_scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps"],
    meta_fields=["config"],
)


def plain_loss_scale(loss_scale: LossScale) -> LossScale:
    """``loss_scale`` with each state field a plain array: the value of a Flax NNX variable
    (``nnx.Optimizer`` wraps its state leaves in ``OptArray``), else the field itself."""
    from mpx_jax._compat import nnx_if_loaded

    nnx = nnx_if_loaded()
    if nnx is None:
        return loss_scale
    values = {name: getattr(loss_scale, name) for name in STATE_FIELDS}
    if not any(isinstance(v, nnx.Variable) for v in values.values()):
        return loss_scale
    plain = {k: v.get_value() if isinstance(v, nnx.Variable) else v for k, v in values.items()}
    return dataclasses.replace(loss_scale, **plain)


def config_difference(a: ScalerConfig, b: ScalerConfig) -> str:
    """The fields in which two configs differ, as ``"name a vs b"`` phrases ("" when equal)."""
    da, db = a.to_dict(), b.to_dict()
    return ", ".join(f"{k} {da[k]!r} vs {db.get(k)!r}" for k in da if da[k] != db.get(k))


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
        raise mpx.MPXError(f"pred: expected a boolean scalar, got dtype {pred.dtype} and shape {pred.shape}.")
    ta, tb = jax.tree_util.tree_structure(on_true), jax.tree_util.tree_structure(on_false)
    if ta != tb:
        raise mpx.MPXError(f"select_tree: the two trees differ in structure: {ta} and {tb}.")

    def sel(a: Any, b: Any) -> Any:
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            raise mpx.MPXError(
                f"select_tree: leaves differ: {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}."
            )
        return lax.select(pred, a, b) if a.shape == () else jnp.where(pred, a, b)

    return jax.tree_util.tree_map(sel, on_true, on_false)
