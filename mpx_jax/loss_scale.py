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

:meth:`LossScale.update` is :func:`mpx.kernels.scale.update`, the one transition every
backend runs, with JAX's table (:data:`mpx_jax._array_ops.JAX_OPS`): selects and int32
arithmetic only (no Python branch on a traced value), bit-identical to
:func:`mpx.scaler_update` for every config, each product torch's
``float32(float64(scale) * float64(factor))`` computed without float64.

History: :meth:`LossScale.record_history` returns a loss scale that also carries the
scaler-history ring buffer every backend keeps (:mod:`mpx.kernels.ring`: two more leaves,
an int32 ``(capacity, 4)`` array of rows and the int32 count of rows written); each
:meth:`~LossScale.update` writes its row on device, inside ``jit`` (no host read), and
:meth:`~LossScale.history` reads them in one transfer.  A loss scale that does not record
has ``None`` there: its leaves are the five state arrays.

The counters are int32 and saturate, as the reference's, at 2**31 - 1 =
2,147,483,647 (68 years at one step a second); the core bounds
``growth_interval``, ``hysteresis`` and every loaded counter there, so any
state dict the core accepts loads here.

>>> import mpx
>>> ls = LossScale.create(mpx.ScalerConfig(growth_interval=2, min_scale=0.25)).record_history()
>>> for finite in (True, True, False):
...     ls = ls.update(finite)
>>> float(ls.loss_scale), int(ls.skipped_steps), ls.history().scale
(65536.0, 1, [65536.0, 131072.0, 65536.0])
>>> leaves, treedef = jax.tree_util.tree_flatten(LossScale.create(mpx.ScalerConfig(min_scale=0.25)))
>>> len(leaves), jax.tree_util.tree_unflatten(treedef, leaves).config.min_scale
(5, 0.25)
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
from mpx.history import ScalerHistory
from mpx.kernels import ring as kring
from mpx.kernels import scale as kscale
from mpx.scaling import ScalerConfig, ScalerState
from mpx_jax._array_ops import JAX_OPS
from mpx_jax._compat import nnx_if_loaded
from mpx_jax.casting import is_floating_array
from mpx_jax.history import floor_callback, stuck_callback

__all__ = ["GROWTH_FIELDS", "HISTORY_FIELDS", "INT32_MAX", "STATE_FIELDS", "LossScale", "all_finite", "select_tree"]

#: The state fields of a :class:`LossScale`, in pytree order: its leaves.
STATE_FIELDS = ("loss_scale", "growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps")
#: The counter only ``hysteresis_reset="growth"`` keeps (None otherwise, so a default config's pytree,
#: checkpoints and compiled step are as they were): an int32 scalar.
GROWTH_FIELDS = ("nonfinite_since_growth",)
#: The history ring's fields (None when not recording): int32 ``(capacity, 4)`` rows, int32 count.
HISTORY_FIELDS = ("history_rows", "history_count")

#: The largest value an int32 counter holds (:data:`mpx.COUNTER_MAX`).
INT32_MAX = mpx.COUNTER_MAX


@dataclasses.dataclass(frozen=True, eq=False)
class LossScale:
    """The loss-scaling state on device, with its config (an immutable pytree).

    Build one with :meth:`create` or :meth:`from_state_dict`.  Fields:
    ``loss_scale`` (float32 scalar), ``growth_tracker``,
    ``consecutive_nonfinite``, ``steps``, ``skipped_steps`` (int32 scalars),
    ``config`` (the :class:`mpx.ScalerConfig`, static metadata),
    ``nonfinite_since_growth`` (int32 scalar under ``hysteresis_reset="growth"``, else None) and, while
    recording (:meth:`record_history`), ``history_rows`` and ``history_count``.

    The surface every mpx scaler shares (:data:`mpx.testing.SURFACE_NAMES`):
    ``config``, ``state`` (an :class:`mpx.ScalerState`), ``get_scale()`` (a
    Python float), ``scale(tree)``, ``state_dict()``, ``load_state_dict(state_dict)``,
    ``record_history()``, ``history()`` and ``last_step_skipped()``.  This one is
    immutable, so ``load_state_dict`` and ``record_history`` return the new
    ``LossScale``.  The counters are read through ``state``.
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    consecutive_nonfinite: jax.Array
    steps: jax.Array
    skipped_steps: jax.Array
    config: ScalerConfig = dataclasses.field(default_factory=ScalerConfig)
    history_rows: jax.Array | None = None
    history_count: jax.Array | None = None
    nonfinite_since_growth: jax.Array | None = None

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
        for name in ("growth_tracker", "consecutive_nonfinite", "steps", "skipped_steps", "nonfinite_since_growth"):
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
            nonfinite_since_growth=jnp.asarray(state.nonfinite_since_growth, jnp.int32)
            if config.hysteresis_reset == "growth" else None,
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

        :func:`mpx.kernels.scale.update` with JAX's table (exactly :func:`mpx.scaler_update`);
        while recording, the state after the step is written to the history ring
        (:func:`mpx.kernels.ring.record`).  ``loss_finite`` (optional bool scalar: was
        the forward loss finite) is read by stuck detection only
        (``config.max_consecutive_skips``, which adds a ``jax.debug.callback``, see
        :mod:`mpx_jax.history`); with the option off nothing is added.
        """
        self = plain_loss_scale(self)  # the values of NNX variables (nnx.Optimizer's OptArray)
        if not isinstance(finite, (bool, int, np.bool_, np.integer, np.ndarray, jax.Array)):
            raise mpx.UnsupportedTypeError(
                f"finite: expected a boolean scalar (a bool or a jax/numpy array), got {type(finite).__name__}."
            )
        finite = jnp.asarray(finite)
        if finite.shape != ():
            raise mpx.MPXError(f"finite: expected a scalar boolean, got an array of shape {finite.shape}.")
        cfg, o = self.config, JAX_OPS
        state = kscale.ScaleState(*(getattr(self, name) for name in (*STATE_FIELDS, *GROWTH_FIELDS)))
        new = kscale.update(o, cfg, state, finite.astype(bool))
        if cfg.max_consecutive_skips is not None:
            stuck_callback(cfg, new.scale, new.consecutive_nonfinite, loss_finite)
        if cfg.on_floor == "raise":
            floor_callback(cfg, kscale.floor_hit(o, cfg, state.scale, new), new.steps, new.scale)
        rows, count = self.history_rows, self.history_count
        if rows is not None:
            events = kscale.events(o, cfg, state.growth_tracker, new)
            row = kring.row(o, new.scale, events, new.consecutive_nonfinite, new.steps)
            rows, count = kring.record(o, rows, count, row)
        return dataclasses.replace(
            self, **dict(zip((*STATE_FIELDS, *GROWTH_FIELDS), new, strict=True)), history_rows=rows,
            history_count=count,
        )

    # -- history -------------------------------------------------------------------
    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> LossScale:
        """This loss scale recording the state after each :meth:`update` (or, with False, not recording).

        The last ``capacity`` steps (default 65536: 1 MiB of int32 rows) are kept in the ring buffer
        every backend keeps (:mod:`mpx.kernels.ring`), as two more leaves of the pytree; starting again
        clears the record.  ``LossScale`` is immutable: use the returned value (in an optimizer state:
        ``set_loss_scale(opt_state, get_loss_scale(opt_state).record_history())``).  The new leaves
        change the pytree's structure, so a jitted step traces once more for it.

        Raises:
            MPXError: for a ``capacity`` that is not an int in [1, 2**31 - 1].
        """
        plain = plain_loss_scale(self)
        if not enabled:
            return dataclasses.replace(plain, history_rows=None, history_count=None)
        rows = jnp.zeros((kring.check_capacity(capacity), len(kring.ROW_FIELDS)), jnp.int32)
        return dataclasses.replace(plain, history_rows=rows, history_count=jnp.zeros((), jnp.int32))

    def history(self) -> ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory` (one transfer: not under ``jit``).

        Raises:
            MPXError: when this loss scale does not record (see :meth:`record_history`).
        """
        plain = plain_loss_scale(self)
        if plain.history_rows is None:
            raise mpx.MPXError(
                "history: this LossScale does not record; use loss_scale = loss_scale.record_history() "
                "(or set_loss_scale(opt_state, get_loss_scale(opt_state).record_history())) before the steps."
            )
        rows, count = jax.device_get((plain.history_rows, plain.history_count))
        return ScalerHistory.from_rows(self.config, rows, int(count))

    def last_step_skipped(self) -> jax.Array:
        """A bool scalar array: the last :meth:`update` skipped its step (False before the first).

        No host read (usable under ``jit``); from the state, as :meth:`mpx.ScalerHistory.events`.
        """
        plain = plain_loss_scale(self)
        return jnp.logical_and(plain.consecutive_nonfinite != 0, bool(self.config.skip_nonfinite))

    # -- host side ---------------------------------------------------------------
    @property
    def state(self) -> ScalerState:
        """The state as an :class:`mpx.ScalerState` (reads the device values: not under ``jit``)."""
        plain = plain_loss_scale(self)
        values = jax.device_get(tuple(getattr(plain, name) for name in STATE_FIELDS))
        since = plain.nonfinite_since_growth
        since = 0 if since is None else int(jax.device_get(since))
        return ScalerState(float(values[0]), *(int(v) for v in values[1:]), nonfinite_since_growth=since)

    def get_scale(self) -> float:
        """The current scale as a Python float (a host read: not under ``jit``; there use ``loss_scale``)."""
        return float(jax.device_get(plain_loss_scale(self).loss_scale))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (``mpx.scaler/1``), the same as every mpx backend's."""
        return mpx.state_dict(self.config, self.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> LossScale:
        """The loss scale saved in ``state_dict`` (a :meth:`state_dict` dict, from any backend).

        ``LossScale`` is immutable, so this returns the loaded value (its config
        and state are ``state_dict``'s; it keeps recording into this one's history
        ring, as the core's :class:`mpx.LossScaler` does) and leaves ``self`` as
        it is.  Put it back into an optimizer state with :func:`mpx_jax.set_loss_scale`.

        Raises:
            StateDictError: for a malformed dict (see :func:`mpx.load_state_dict`).
        """
        plain = plain_loss_scale(self)
        loaded = type(self).from_state_dict(state_dict)
        return dataclasses.replace(loaded, history_rows=plain.history_rows, history_count=plain.history_count)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any]) -> LossScale:
        """A loss scale resumed from a :meth:`state_dict` dict (from any backend; not recording).

        Raises:
            StateDictError: for a malformed dict (see :func:`mpx.load_state_dict`).
        """
        config, state = mpx.load_state_dict(state_dict)
        return cls._from_state(config, state)

    def __repr__(self) -> str:
        plain = plain_loss_scale(self)
        try:
            return f"LossScale(kind={self.config.kind!r}, scale={float(plain.loss_scale)}, steps={int(plain.steps)})"
        except TypeError:  # traced values (ConcretizationTypeError), or stand-ins such as NNX's VariableRepr
            return f"LossScale(kind={self.config.kind!r}, traced)"


jax.tree_util.register_dataclass(
    LossScale, data_fields=[*STATE_FIELDS, *HISTORY_FIELDS, *GROWTH_FIELDS], meta_fields=["config"]
)


def plain_loss_scale(loss_scale: LossScale) -> LossScale:
    """``loss_scale`` with each state field a plain array: the value of a Flax NNX variable
    (``nnx.Optimizer`` wraps its state leaves in ``OptArray``), else the field itself."""
    nnx = nnx_if_loaded()
    if nnx is None:
        return loss_scale
    values = {name: getattr(loss_scale, name) for name in (*STATE_FIELDS, *HISTORY_FIELDS, *GROWTH_FIELDS)}
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
