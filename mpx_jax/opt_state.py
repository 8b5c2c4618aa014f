"""Find the loss scale in an optimizer state, and put a changed one back.

:func:`get_loss_scale` reads the :class:`~mpx_jax.LossScale` that
:func:`~mpx_jax.with_loss_scaling` keeps in its state, from anything that holds it:

* a plain optax state (the ``LossScalingState``, or any pytree around it:
  ``optax.chain``, ``inject_hyperparams``, a ``TrainState``...);
* a Flax ``nnx.Optimizer`` (its ``opt_state``), or that ``opt_state`` itself, whose
  leaves NNX wraps in ``OptArray``/``OptVariable`` variables.

It always returns a ``LossScale`` of plain arrays (the variables' values), so
``get_loss_scale(opt).scale(loss)``, ``.get_scale()``, ``.state`` and
``.state_dict()`` work the same for all of them.

:func:`set_loss_scale` is the way back: a new optax state with the loss scale
replaced, or, for an ``nnx.Optimizer`` (or an ``opt_state`` of NNX variables),
the variables set in place.  Its config must be the optimizer's (the transform
was built with it); load a saved scale with
``set_loss_scale(opt, get_loss_scale(opt).load_state_dict(saved))``.

>>> import jax.numpy as jnp, optax, mpx_jax
>>> tx = mpx_jax.with_loss_scaling(optax.adam(1e-3), "mixed_float16")
>>> state = tx.init({"w": jnp.ones(3)})
>>> ls = get_loss_scale(state)
>>> ls.get_scale(), ls.state.steps
(65536.0, 0)
>>> resumed = ls.load_state_dict({**ls.state_dict(), "scale": 1024.0})
>>> get_loss_scale(set_loss_scale(state, resumed)).get_scale()
1024.0
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import mpx
from mpx_jax._compat import nnx_if_loaded
from mpx_jax.loss_scale import (
    GROWTH_FIELDS,
    HISTORY_FIELDS,
    STATE_FIELDS,
    LossScale,
    config_difference,
    plain_loss_scale,
)

__all__ = ["get_loss_scale", "set_loss_scale"]


def _optimizer_state(obj: Any, nnx: Any) -> Any:
    """``obj.opt_state`` for an ``nnx.Optimizer``, else ``obj``."""
    return obj.opt_state if nnx is not None and isinstance(obj, nnx.Optimizer) else obj


def _is_loss_scale(x: Any) -> bool:
    return isinstance(x, LossScale)


def _the_loss_scale(tree: Any, given: Any) -> LossScale:
    found = [leaf for leaf in jax.tree_util.tree_leaves(tree, is_leaf=_is_loss_scale) if _is_loss_scale(leaf)]
    if not found:
        raise mpx.UnsupportedTypeError(
            f"opt_state: {type(given).__name__} holds no LossScale; pass the state of an optimizer built with "
            "mpx_jax.with_loss_scaling(tx) (a plain optax state, an nnx.Optimizer or its opt_state)."
        )
    if len(found) > 1:
        raise mpx.MPXError(f"opt_state: holds {len(found)} LossScale objects; expected exactly one.")
    return found[0]


def get_loss_scale(opt_state: Any) -> LossScale:
    """The :class:`~mpx_jax.LossScale` inside ``opt_state``, as plain arrays.

    ``opt_state``: an optax state holding one (at any depth: chain,
    inject_hyperparams...), an ``nnx.Optimizer`` over ``with_loss_scaling(tx)``,
    or its ``opt_state`` (``OptArray`` variables).  Multiply the loss with it:
    ``get_loss_scale(opt_state).scale(loss)``.

    Raises:
        UnsupportedTypeError: when ``opt_state`` holds no loss scale.
        MPXError: when it holds more than one.
    """
    tree = _optimizer_state(opt_state, nnx_if_loaded())
    return plain_loss_scale(_the_loss_scale(tree, opt_state))


def _check_replacement(old: LossScale, new: Any) -> LossScale:
    if not isinstance(new, LossScale):
        raise mpx.UnsupportedTypeError(
            f"loss_scale: expected an mpx_jax.LossScale, got {type(new).__name__}."
        )
    diff = config_difference(old.config, new.config)
    if diff:
        raise mpx.ScalerConfigError(
            f"loss_scale: its config differs from the one the optimizer was built with ({diff}); "
            "with_loss_scaling(tx, config) keeps its config, so build the optimizer with the new config."
        )
    new = plain_loss_scale(new)
    for name, dtype in zip(STATE_FIELDS, (jnp.float32,) + (jnp.int32,) * 4, strict=True):
        value = getattr(new, name)
        if jnp.shape(value) != () or jnp.result_type(value) != dtype:
            raise mpx.UnsupportedTypeError(
                f"loss_scale.{name}: expected a {jnp.dtype(dtype).name} scalar, got "
                f"{jnp.result_type(value).name}{list(jnp.shape(value))}."
            )
    since = new.nonfinite_since_growth
    if (since is None) != (new.config.hysteresis_reset != "growth") or (
        since is not None and (jnp.shape(since) != () or jnp.result_type(since) != jnp.int32)
    ):
        raise mpx.UnsupportedTypeError(
            "loss_scale.nonfinite_since_growth: expected an int32 scalar under hysteresis_reset='growth' "
            "and None otherwise (LossScale.create makes it)."
        )
    rows, count = new.history_rows, new.history_count
    if (rows is None) != (count is None) or (
        rows is not None
        and (
            jnp.result_type(rows) != jnp.int32
            or jnp.ndim(rows) != 2
            or jnp.shape(rows)[1] != 4
            or jnp.shape(count) != ()
            or jnp.result_type(count) != jnp.int32
        )
    ):
        raise mpx.UnsupportedTypeError(
            "loss_scale.history_rows, history_count: expected both None, or an int32 (capacity, 4) array "
            "and an int32 scalar (LossScale.record_history makes them)."
        )
    return new


def _held(ls: LossScale, nnx: Any) -> tuple[list[Any], bool]:
    """The LossScale's data fields as held (variables or arrays), and whether NNX variables hold them."""
    held = [getattr(ls, name) for name in (*STATE_FIELDS, *HISTORY_FIELDS, *GROWTH_FIELDS)]
    present = [v for v in held if v is not None]
    in_variables = nnx is not None and any(isinstance(v, nnx.Variable) for v in present)
    if in_variables and not all(isinstance(v, nnx.Variable) for v in present):
        raise mpx.MPXError("opt_state: its LossScale mixes NNX variables and plain arrays; cannot set it.")
    return held, in_variables


def set_loss_scale(opt_state: Any, loss_scale: LossScale) -> Any:
    """``opt_state`` with its loss scale replaced by ``loss_scale`` (the way back from :func:`get_loss_scale`).

    * A plain optax state: returns a new state (the input is not changed).
    * An ``nnx.Optimizer``, or an ``opt_state`` whose loss scale is held in NNX
      variables: sets those variables in place and returns ``opt_state`` itself.

    ``loss_scale`` may start or stop recording (``get_loss_scale(opt).record_history()``):
    the state then gains or loses the history ring's two leaves (for an
    ``nnx.Optimizer``, two variables made like its other ones; pass the optimizer
    itself, outside a transformation).

    Raises:
        UnsupportedTypeError: when ``opt_state`` holds no loss scale, or
            ``loss_scale`` is not a ``LossScale`` of scalar float32/int32 arrays
            (and int32 history ring arrays).
        MPXError: when recording starts or stops on an NNX ``opt_state`` given without its optimizer.
        ScalerConfigError: when ``loss_scale.config`` is not the optimizer's
            config (naming the fields that differ); nothing is changed.
    """
    nnx = nnx_if_loaded()
    tree = _optimizer_state(opt_state, nnx)
    old = _the_loss_scale(tree, opt_state)
    new = _check_replacement(old, loss_scale)
    held, in_variables = _held(old, nnx)
    if in_variables:
        names = (*STATE_FIELDS, *HISTORY_FIELDS, *GROWTH_FIELDS)
        if all((v is None) == (getattr(new, n) is None) for n, v in zip(names, held, strict=True)):
            for name, variable in zip(names, held, strict=True):
                if variable is not None:
                    variable.set_value(getattr(new, name))
            return opt_state
        if tree is opt_state:
            raise mpx.MPXError(
                "opt_state: starting or stopping history recording adds or removes NNX variables, which "
                "needs the nnx.Optimizer itself: set_loss_scale(optimizer, loss_scale)."
            )
        # recording starts or stops: the state's variables stay, the ring's are made like them
        values: dict[str, Any] = {}
        for name, variable in zip(names, held, strict=True):
            value = getattr(new, name)
            if value is None:
                values[name] = None
            elif variable is not None:
                variable.set_value(value)
                values[name] = variable
            else:
                values[name] = held[0].replace(value)
        replacement = dataclasses.replace(new, **values)
        opt_state.opt_state = _replace_loss_scale(tree, replacement, keep=nnx.Variable)
        return opt_state
    if tree is not opt_state:  # an nnx.Optimizer whose opt_state holds plain arrays
        raise mpx.UnsupportedTypeError(
            "opt_state: this nnx.Optimizer holds its loss scale as plain arrays, not variables; "
            "set optimizer.opt_state = set_loss_scale(optimizer.opt_state, loss_scale)."
        )
    return _replace_loss_scale(tree, new)


def _replace_loss_scale(tree: Any, new: LossScale, keep: type | None = None) -> Any:
    """``tree`` with its LossScale replaced by ``new``; nodes of type ``keep`` are kept as they are."""

    def is_leaf(x: Any) -> bool:
        return _is_loss_scale(x) or (keep is not None and isinstance(x, keep))

    return jax.tree_util.tree_map(lambda x: new if _is_loss_scale(x) else x, tree, is_leaf=is_leaf)
