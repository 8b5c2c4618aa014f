"""A Keras 3 ``LossScaleOptimizer`` on mpx's state machine, on every Keras backend.

It is Keras's own optimizer API (``scale_loss``, ``apply`` taking scaled
gradients, ``apply_gradients``, ``stateless_apply``, ``inner_optimizer``,
``variables``, ``get_config``/``from_config``) with the transition of
:func:`mpx.scaler_update`, bit for bit, in ``keras.ops``:

- the state lives in variables (a float32 ``dynamic_scale``, int32 counters
  saturating at 2**31 - 1, as the core's), so a traced step reads the current
  scale and never retraces;
- every scale product is torch's, ``float32(float64(scale) * float64(factor))``,
  computed exactly on the scale's int32 bits (:mod:`mpx_keras._scale_bits`,
  :data:`~mpx_keras._scale_bits.KERAS_OPS`: no float64, immune to flush-to-zero);
- the finiteness test is on the unscaled gradients;
- a skipped step runs no update (``keras.ops.cond``), so the model's variables
  and the inner optimizer's (``iterations``, moments) stay bit-identical.

Per backend: ``apply`` runs eagerly on torch (and inside ``tf.function`` on
TensorFlow); the jax trainer calls :meth:`LossScaleOptimizer.stateless_apply`,
a pure function of the variables' values (a ``cond`` on the finite flag and
selects, no Python branch on a traced value).  On TensorFlow,
:class:`mpx_tf.LossScaleOptimizer` adds ``tf.distribute``, gradient
accumulation and the reduce dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

import mpx
from mpx.errors import MPXError, ScalerConfigError, UnsupportedTypeError
from mpx_keras import _compat
from mpx_keras._scale_bits import KERAS_OPS, next_scale

__all__ = ["LossScaleOptimizer", "keras_arguments"]

ops = keras.ops
_HALF = ("float16", "bfloat16")

#: Keras's base-optimizer arguments its LossScaleOptimizer accepts at their defaults only (older
#: saved configs carry them) and refuses otherwise, advising to set them on the inner optimizer.
INNER_ONLY = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def keras_arguments(
    cfg: mpx.ScalerConfig,
    initial_scale: float | None,
    dynamic_growth_steps: int | None,
    dynamic: Any,
    kwargs: dict[str, Any],
    allowed: str = "name",
) -> mpx.ScalerConfig:
    """The config after Keras's LossScaleOptimizer arguments; raises for those mpx cannot honour."""
    if dynamic is not True:
        raise MPXError(
            f"dynamic: only True is accepted (Keras 3's LossScaleOptimizer is always dynamic), got {dynamic!r}; "
            "for a fixed scale pass config=mpx.ScalerConfig(kind='static', init_scale=...)"
        )
    for arg, default in INNER_ONLY.items():
        if arg in kwargs and kwargs.pop(arg) != default:
            advice = (
                " (mpx's scaler then moves once per optimizer step and skips a window with a "
                "non-finite micro-batch whole)"
                if arg == "gradient_accumulation_steps"
                else ""
            )
            raise MPXError(
                f"LossScaleOptimizer does not support `{arg}`. Instead, set `{arg}` on the `inner_optimizer`{advice}."
            )
    if kwargs:
        raise MPXError(
            f"LossScaleOptimizer: unknown arguments {', '.join(repr(k) for k in kwargs)}; allowed: "
            f"inner_optimizer, config (an mpx.ScalerConfig, its dict, or a policy), {allowed}, and "
            "Keras's initial_scale, dynamic_growth_steps, dynamic=True"
        )
    changes: dict[str, Any] = {}
    if initial_scale is not None:
        changes["init_scale"] = float(initial_scale)
    if dynamic_growth_steps is not None:
        changes["growth_interval"] = dynamic_growth_steps
    if not changes:
        return cfg
    if cfg.kind != "dynamic":
        raise ScalerConfigError(
            f"initial_scale / dynamic_growth_steps: they configure a dynamic scaler, but config.kind is {cfg.kind!r}"
        )
    return mpx.ScalerConfig.from_dict({**cfg.to_dict(), **changes})


def check_inner(inner_optimizer: Any) -> None:
    """Raise :class:`mpx.UnsupportedTypeError` unless ``inner_optimizer`` is a plain Keras optimizer."""
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise UnsupportedTypeError(
            f"inner_optimizer: expected a keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}."
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise UnsupportedTypeError(
            "inner_optimizer: it is already a LossScaleOptimizer; wrap the plain optimizer once."
        )
    _compat.check_optimizer(inner_optimizer, _METHODS)


#: The Keras optimizer internals this (backend-neutral) optimizer calls.
_METHODS = ("_overwrite_variable_with_gradient",)

#: The state variables, in order: (attribute, saved name, dtype).
STATE_VARIABLES = (
    ("dynamic_scale", "dynamic_scale", "float32"),
    ("step_counter", "step_counter", "int32"),  # mpx's growth_tracker (Keras's name)
    ("consecutive_nonfinite", "consecutive_nonfinite", "int32"),
    ("total_steps", "steps", "int32"),
    ("skipped_steps", "skipped_steps", "int32"),
)


def _as_value(v: Any) -> Any:
    return v.value if isinstance(v, keras.Variable) else v


def _increment(counter: Any, by: Any = 1) -> Any:
    """``counter + by`` saturating at :data:`mpx.COUNTER_MAX` (no int32 wrap-around)."""
    return ops.where(counter < mpx.COUNTER_MAX - by, counter + by, mpx.COUNTER_MAX)


def next_state(config: mpx.ScalerConfig, state: Sequence[Any], finite: Any) -> list[Any]:
    """:func:`mpx.scaler_update` on tensors: the five state values after a step (pure, ``keras.ops``).

    ``state``: (scale float32, growth_tracker, consecutive_nonfinite, steps, skipped_steps) int32
    tensors; ``finite``: a bool scalar tensor.
    """
    scale, tracker, consecutive, steps, skipped = (_as_value(v) for v in state)
    zero = ops.zeros((), "int32")
    consecutive = ops.where(finite, zero, _increment(consecutive))
    if config.kind == "dynamic":
        grown_tracker = tracker + 1
        at_interval = ops.equal(grown_tracker, config.growth_interval)
        back = consecutive >= config.hysteresis
        scale = next_scale(config, scale, finite, at_interval, back, KERAS_OPS)
        tracker = ops.where(ops.logical_and(finite, ops.logical_not(at_interval)), grown_tracker, zero)
    steps = _increment(steps)
    if config.skip_nonfinite:
        skipped = ops.where(finite, skipped, _increment(skipped))
    return [scale, tracker, consecutive, steps, skipped]


def all_finite(grads: Sequence[Any]) -> Any:
    """A bool scalar tensor: every element of every (not None) gradient is finite."""
    flags = [ops.all(ops.isfinite(g)) for g in grads if g is not None]
    return ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)


def _is_concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (eager), not a traced placeholder (``tf.function``, jax tracing)."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True  # torch runs eagerly (torch.compile traces through Python branches)


def branch(pred: Any, true_fn: Any, false_fn: Any) -> Any:
    """``true_fn()`` if ``pred`` else ``false_fn()``: ``keras.ops.cond`` on TensorFlow and torch; on jax
    a Python branch on the concrete flag (``apply`` runs eagerly there: a traced jax step calls
    :meth:`LossScaleOptimizer.stateless_apply`, whose branches are pure)."""
    if keras.config.backend() != "jax":
        return ops.cond(pred, true_fn, false_fn)
    if not _is_concrete(pred):
        raise _compat.unsupported_on_backend(
            "LossScaleOptimizer.apply() inside a traced (jitted) function",
            "variables cannot be assigned inside jax tracing; call stateless_apply (as Keras's jax trainer "
            "does) with the variables' values",
        )
    return true_fn() if bool(pred) else false_fn()


def divide(g: Any, scale: Any) -> Any:
    """``g / scale``; a half gradient is unscaled in float32, then cast back."""
    dtype = keras.backend.standardize_dtype(g.dtype)
    if dtype in _HALF:
        return ops.cast(ops.divide(ops.cast(g, "float32"), scale), dtype)
    return ops.divide(g, ops.cast(scale, dtype))


@keras.saving.register_keras_serializable(package="mpx_keras")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's ``LossScaleOptimizer`` API over mpx's state machine, on any Keras backend.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the unscaled gradients.
        config: what :func:`mpx.as_scaler_config` reads, as every mpx scaler: an
            :class:`mpx.ScalerConfig` or its ``to_dict()`` dict; a policy (an
            :class:`mpx.Policy`, a spec string such as ``"mixed_float16"``, or a
            policy dict), giving ``ScalerConfig.for_policy``; None (default) for the
            default dynamic config (initial scale 2**16, growth every 2000 finite
            steps, bounds [1, 2**24]).
        name: the optimizer's name.
        initial_scale, dynamic_growth_steps, dynamic: keyword only, Keras's
            arguments: they set ``init_scale`` and ``growth_interval`` of a dynamic
            config (default None: the config's); ``dynamic`` must be True.

    In ``model.fit`` Keras's train step calls :meth:`scale_loss` and
    :meth:`apply` (torch, TensorFlow) or :meth:`stateless_apply` (jax) itself.
    In a custom step: ``grads`` of ``optimizer.scale_loss(loss)``, then
    ``optimizer.apply(grads, variables)`` (unscales, checks, maybe skips).

    mpx's scaler surface: :meth:`get_scale` (a host read), :meth:`scale`
    (Keras's :meth:`scale_loss` is the same), :attr:`state`, :attr:`config`,
    :meth:`state_dict` / :meth:`load_state_dict`.  The state is five variables
    saved with the model: ``dynamic_scale`` (float32), ``step_counter`` (mpx's
    ``growth_tracker``), ``consecutive_nonfinite``, ``steps`` and ``skipped_steps``
    (int32).  On the jax trainer, read the state after ``fit`` (or from a
    :class:`mpx_keras.LossScaleMonitor`): Keras copies the values back into the
    variables at the end of each epoch and when a callback reads them.

    Raises:
        ScalerConfigError: for an invalid config (or a config of another type).
        PolicyError: for a string or policy dict that is not a policy spec.
        UnsupportedTypeError: when ``inner_optimizer`` is not a Keras optimizer, or is itself loss scaling.
        MPXError: for Keras arguments mpx cannot honour, and for what this backend cannot do
            (gradient accumulation off TensorFlow: use ``mpx_tf.LossScaleOptimizer`` there).
        FrameworkVersionError: when this Keras lacks an optimizer internal mpx uses.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        config: mpx.ScalerConfig | mpx.PolicySpec | Mapping[str, Any] | None = None,
        name: str | None = None,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        dynamic: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("reduce_dtype") is not None:
            raise _compat.unsupported_on_backend(
                "reduce_dtype",
                "mpx_keras.LossScaleOptimizer does not choose the cross-replica sum's dtype (on jax, XLA picks "
                "the all-reduce); on TensorFlow use mpx_tf.LossScaleOptimizer(..., reduce_dtype=...)",
            )
        kwargs.pop("reduce_dtype", None)
        cfg = keras_arguments(
            mpx.as_scaler_config(config), initial_scale, dynamic_growth_steps, dynamic, kwargs
        )
        check_inner(inner_optimizer)
        if inner_optimizer.gradient_accumulation_steps:
            raise _compat.unsupported_on_backend(
                "gradient accumulation (the inner optimizer's gradient_accumulation_steps) with "
                "mpx_keras.LossScaleOptimizer",
                "accumulate the gradients of k micro-batches in your train step and apply them once, or on "
                "TensorFlow use mpx_tf.LossScaleOptimizer, which skips a window with a non-finite micro-batch whole",
            )
        super().__init__(
            inner_optimizer,
            initial_scale=cfg.first_scale,
            dynamic_growth_steps=cfg.growth_interval,
            name=name,
        )
        self._config = cfg
        # The state is created here, not in build(): scale_loss() in a traced step must read a
        # variable even before the first apply().  autocast=False: never read as float16.
        for attr, saved, dtype in STATE_VARIABLES:
            with keras.name_scope(self.name, caller=self):
                var = keras.Variable(
                    initializer="zeros",
                    shape=(),
                    dtype=dtype,
                    trainable=False,
                    autocast=False,
                    aggregation="only_first_replica",
                    name=saved,
                )
            setattr(self, attr, var)
        self._assign_state(mpx.scaler_init(cfg))
        self._mpx_extras = _Extras()  # a plain object: not tracked, not saved

    def _state_variables(self) -> list[keras.Variable]:
        return [getattr(self, attr) for attr, _, _ in STATE_VARIABLES]

    # -- Keras's optimizer API ------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)  # not Keras's LSO.build: the state exists already

    def scale(self, loss: Any) -> Any:
        """``loss`` times the current scale (a half-precision loss is first cast to float32).

        mpx's name, the same in every backend; :meth:`scale_loss` is Keras's.  With kind
        ``none`` the loss comes back unchanged.
        """
        return self.scale_loss(loss)

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the current scale: Keras's name for :meth:`scale`, which ``fit`` calls."""
        if self._config.kind == "none":
            return loss
        loss = ops.convert_to_tensor(loss)
        dtype = keras.backend.standardize_dtype(loss.dtype)
        if dtype in _HALF:
            loss, dtype = ops.cast(loss, "float32"), "float32"
        if self._config.max_consecutive_skips is not None and _is_concrete(loss):
            self._mpx_extras.loss = loss  # the stuck check tells a non-finite loss apart
        return ops.multiply(loss, ops.cast(self.dynamic_scale.value, dtype))

    def _unscaled(self, grads: list[Any], trainable_variables: Sequence[Any], scale: Any) -> list[Any]:
        if self._config.kind == "none":  # a none scale is exactly 1.0: nothing to divide
            return grads
        overwritten = _compat.optimizer_member(self, "_overwrite_variable_with_gradient")
        return [
            g if g is None or overwritten(v) else divide(g, scale)
            for g, v in zip(grads, trainable_variables, strict=True)
        ]

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Unscale the (scaled) ``grads``, update the scaler state, apply them unless the step is skipped."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "apply() without trainable_variables needs a built optimizer; pass the variables "
                    "on the first call or call optimizer.build(model.trainable_variables) first"
                )
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = (
            trainable_variables
            if trainable_variables is not None
            else _compat.optimizer_member(self, "_trainable_variables")
        )
        unscaled = self._unscaled(grads, variables, self.dynamic_scale.value)
        finite = all_finite(unscaled)

        def apply_fn() -> None:
            self.inner_optimizer.apply(unscaled, trainable_variables)

        if self._config.skip_nonfinite:
            branch(finite, apply_fn, lambda: None)
        else:
            apply_fn()
        state = self._state_variables()
        for var, value in zip(state, next_state(self._config, state, finite), strict=True):
            var.assign(value)
        if _is_concrete(finite):
            self._after_eager_step()

    # -- history and stuck detection (host side) --------------------------------------------------
    def _after_eager_step(self) -> None:
        """After a step that ran eagerly: record the history, run the stuck check (host reads, only when on)."""
        extras = self._mpx_extras
        if extras.history is None and self._config.max_consecutive_skips is None:
            return
        state = self.state
        if extras.history is not None:
            extras.history.note(state)
        if self._config.max_consecutive_skips is not None:
            loss = extras.loss
            flag = None if loss is None else bool(np.all(np.isfinite(keras.ops.convert_to_numpy(loss))))
            extras.loss = None
            mpx.check_stuck(self._config, state.scale, state.consecutive_nonfinite, flag, stacklevel=4)

    def note_state(self) -> None:
        """Record the current state in the history if a step ran since the last record (the
        :class:`mpx_keras.LossScaleMonitor` calls it after each batch: jax's ``fit`` steps are pure)."""
        if self._mpx_extras.history is not None:
            self._mpx_extras.history.note(self.state)

    @property
    def recording_history(self) -> bool:
        """Whether :meth:`record_history` is on."""
        return self._mpx_extras.history is not None

    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each step; keeps the last ``capacity``.

        Steps that run eagerly (torch; custom loops on jax and TensorFlow) record themselves, a host
        read each; steps inside ``fit`` on jax (pure) or a ``tf.function`` record through a
        :class:`mpx_keras.LossScaleMonitor` (after each batch).  Starting again clears the record.
        """
        self._mpx_extras.history = _HostHistory(capacity, self.state.steps) if enabled else None

    def history(self) -> mpx.ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory`.

        Raises:
            MPXError: when :meth:`record_history` was not called, or when steps ran where nothing
                recorded them (a traced step without a :class:`mpx_keras.LossScaleMonitor`).
        """
        if self._mpx_extras.history is None:
            raise MPXError("history: not recording; call optimizer.record_history() before training.")
        return self._mpx_extras.history.read(self._config, self.state.steps)

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """The step as a pure function of the variables' values (the jax trainer calls it).

        Returns ``(new trainable values, new optimizer values)``, ``optimizer_variables``
        ordered as :attr:`variables` (this optimizer's own, then the inner one's).  A
        skipped step returns the trainable and inner values it was given.
        """
        if keras.config.backend() == "tensorflow":
            raise _compat.unsupported_on_backend(
                "stateless_apply",
                "Keras refuses it for every optimizer there; use apply() or apply_gradients()",
            )
        if not self.built:
            raise ValueError(
                "stateless_apply needs a built optimizer; call optimizer.build(trainable_variables) first."
            )
        variables = list(self.variables)  # this optimizer's own, then the inner one's
        own = variables[: len(variables) - len(self.inner_optimizer.variables)]
        optimizer_variables = list(optimizer_variables)
        trainable_variables = list(trainable_variables)
        inner_values = optimizer_variables[len(own) :]
        mapping = list(zip(variables, optimizer_variables, strict=True))
        with _compat.StatelessScope(state_mapping=mapping) as scope:
            state = [scope.get_current_value(v) for v in self._state_variables()]
            unscaled = self._unscaled(
                list(grads), _compat.optimizer_member(self, "_trainable_variables"), state[0]
            )
            finite = all_finite(unscaled)

            def apply_fn() -> Any:
                new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                    inner_values, unscaled, trainable_variables
                )
                return list(new_trainable), list(new_inner)

            if self._config.skip_nonfinite:
                new_trainable, new_inner = ops.cond(
                    finite, apply_fn, lambda: (list(trainable_variables), list(inner_values))
                )
            else:
                new_trainable, new_inner = apply_fn()
            for var, value in zip(
                self._state_variables(), next_state(self._config, state, finite), strict=True
            ):
                var.assign(value)
            new_own = [scope.get_current_value(v) for v in own]
        return list(new_trainable), new_own + list(new_inner)

    # -- mpx's scaler API ------------------------------------------------------------------
    @property
    def config(self) -> mpx.ScalerConfig:
        """The :class:`mpx.ScalerConfig` (read-only)."""
        return self._config

    @property
    def state(self) -> mpx.ScalerState:
        """The current state, read from the variables (a host read)."""
        values = [keras.ops.convert_to_numpy(v.value) for v in self._state_variables()]
        return mpx.ScalerState(
            scale=float(np.float32(values[0])),
            growth_tracker=int(values[1]),
            consecutive_nonfinite=int(values[2]),
            steps=int(values[3]),
            skipped_steps=int(values[4]),
        )

    def get_scale(self) -> float:
        """The current loss scale as a Python float (a host read; in a traced step use ``dynamic_scale``)."""
        return float(np.float32(keras.ops.convert_to_numpy(self.dynamic_scale.value)))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (format ``mpx.scaler/1``), as every mpx scaler writes."""
        return mpx.state_dict(self._config, self.state)

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore config and state from any mpx scaler's state dict; on error nothing changes.

        The config is Python-side: a step traced before a load that changes it keeps the
        old constants, so load before training (or call ``model.make_train_function(force=True)``).

        Raises:
            StateDictError: for a malformed dict.
        """
        config, state = mpx.load_state_dict(data)  # every check first: below, nothing can fail
        self._assign_state(state)
        self._config = config
        if self._mpx_extras.history is not None:
            self.record_history(capacity=self._mpx_extras.history.capacity)
        self.initial_scale = config.first_scale
        self.dynamic_growth_steps = config.growth_interval

    def _assign_state(self, state: mpx.ScalerState) -> None:
        values = (np.float32(state.scale), state.growth_tracker, state.consecutive_nonfinite, state.steps,
                  state.skipped_steps)  # fmt: skip
        for var, value in zip(self._state_variables(), values, strict=True):
            var.assign(np.asarray(value, dtype=var.dtype))

    # -- serialization ---------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "config": self._config.to_dict(),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        """An optimizer from mpx's config or from Keras's (``initial_scale``, ``dynamic_growth_steps``)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__module__.split('.')[0]}.LossScaleOptimizer kind={self._config.kind!r} "
            f"inner={type(self.inner_optimizer).__name__} name={self.name!r}>"
        )


class _HostHistory:
    """The states after each step, recorded on the host (a deque of the last ``capacity`` rows)."""

    def __init__(self, capacity: int, steps: int) -> None:
        if (
            not isinstance(capacity, int)
            or isinstance(capacity, bool)
            or not 1 <= capacity <= mpx.COUNTER_MAX
        ):
            raise MPXError(f"capacity: expected an int in [1, 2**31 - 1] (steps kept), got {capacity!r}")
        self.capacity = capacity
        self.start = steps  # the step count when recording began
        self.rows: list[list[int]] = []
        self.recorded = 0

    def note(self, state: mpx.ScalerState) -> None:
        last = self.rows[(self.recorded - 1) % self.capacity][3] if self.recorded else self.start
        if state.steps <= last:
            return
        row = [int(np.float32(state.scale).view(np.int32)), state.growth_tracker, state.consecutive_nonfinite,
               state.steps]  # fmt: skip
        if len(self.rows) < self.capacity:
            self.rows.append(row)
        else:
            self.rows[self.recorded % self.capacity] = row
        self.recorded += 1

    def read(self, config: mpx.ScalerConfig, steps: int) -> mpx.ScalerHistory:
        seen = self.start + self.recorded
        if steps != seen and steps < mpx.COUNTER_MAX:
            raise MPXError(
                f"history: {steps - seen} step(s) ran where nothing recorded them (a step traced inside "
                "tf.function or jax's fit); add mpx_keras.LossScaleMonitor() to fit's callbacks, which "
                "records after each batch"
            )
        rows = np.zeros((self.capacity, 4), np.int64)
        if self.rows:
            rows[: len(self.rows)] = np.asarray(self.rows, np.int64)
        return mpx.ScalerHistory.from_rows(config, rows, self.recorded)


class _Extras:
    """The optimizer's host-side parts: the history (None when off) and the last eager loss."""

    def __init__(self) -> None:
        self.history: _HostHistory | None = None
        self.loss: Any = None
