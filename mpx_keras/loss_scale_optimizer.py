"""A Keras 3 ``LossScaleOptimizer`` on mpx's state machine, on every Keras backend.

It is Keras's own optimizer API (``scale_loss``, ``apply`` taking scaled
gradients, ``apply_gradients``, ``stateless_apply``, ``inner_optimizer``,
``variables``, ``get_config``/``from_config``) with the transition of
:func:`mpx.scaler_update`, bit for bit, in ``keras.ops``:

- the state lives in variables (a float32 ``dynamic_scale``, int32 counters
  saturating at 2**31 - 1, as the core's), so a traced step reads the current
  scale and never retraces;
- the transition is the core's kernel, :func:`mpx.kernels.scale.update`, run with
  :data:`~mpx_keras._array_ops.KERAS_ARRAY_OPS` (``keras.ops``): every scale product is
  torch's, ``float32(float64(scale) * float64(factor))``, exactly on every backend;
- the finiteness test is on the unscaled gradients;
- a skipped step runs no update (``keras.ops.cond``), so the model's variables
  and the inner optimizer's (``iterations``, moments) stay bit-identical.

Per backend: ``apply`` runs eagerly on torch (and inside ``tf.function`` on
TensorFlow); the jax trainer calls :meth:`LossScaleOptimizer.stateless_apply`,
a pure function of the variables' values (a ``cond`` on the finite flag and
selects, no Python branch on a traced value).  Gradient accumulation
(:mod:`mpx_keras.accumulation`), history and stuck detection
(:mod:`mpx_keras.history`) work on every backend.  On TensorFlow,
:class:`mpx_tf.LossScaleOptimizer` subclasses this one and adds ``tf.distribute``
and the reduce dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

import mpx
from mpx.errors import MPXError
from mpx.kernels import ArrayOps
from mpx.kernels import scale as scale_kernel
from mpx_keras import _compat
from mpx_keras._array_ops import KERAS_ARRAY_OPS
from mpx_keras._step import (
    GROWTH_VARIABLE,
    HALF,
    INNER_ONLY,
    STATE_VARIABLES,
    all_finite,
    branch,
    check_inner,
    divide,
    is_concrete,
    keras_arguments,
)
from mpx_keras._wrapper import InnerWrapper
from mpx_keras.accumulation import Window
from mpx_keras.history import FloorMark, HistoryBuffer, LossFlag, check_floor_in_step, check_stuck_in_step

__all__ = ["INNER_ONLY", "LossScaleOptimizer", "keras_arguments"]

ops = keras.ops


@keras.saving.register_keras_serializable(package="mpx_keras")
class LossScaleOptimizer(InnerWrapper, keras.optimizers.LossScaleOptimizer):
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

    Gradient accumulation: give the *inner* optimizer ``gradient_accumulation_steps=k``
    (:mod:`mpx_keras.accumulation`).  The scale is constant for the k micro-batches of
    a window, the scaler makes one transition per window (``steps`` counts windows),
    and a window with a non-finite micro-batch is skipped whole: the model's and the
    inner optimizer's variables (moments, accumulators, ``iterations``) end
    bit-identical to before the window, so ``iterations`` counts applied steps.

    mpx's scaler surface: :meth:`get_scale` (a host read), :meth:`scale`
    (Keras's :meth:`scale_loss` is the same), :attr:`state`, :attr:`config`,
    :meth:`state_dict` / :meth:`load_state_dict`, :meth:`record_history` /
    :meth:`history`, :meth:`last_step_skipped`.  The state is five variables saved with the model:
    ``dynamic_scale`` (float32), ``step_counter`` (mpx's ``growth_tracker``),
    ``consecutive_nonfinite``, ``steps`` and ``skipped_steps`` (int32), and under
    ``hysteresis_reset="growth"`` a sixth, ``nonfinite_since_growth`` (int32).  On the jax
    trainer, read the state after ``fit`` or from a callback: Keras copies the
    values back into the variables at the end of each epoch and when a callback
    reads them.

    History and stuck detection work in every kind of step, compiled ones included
    (:mod:`mpx_keras.history`): the history is a ring buffer written inside the step
    and read on the host by :meth:`history`; with ``max_consecutive_skips`` the
    stuck check runs on the host after each optimizer step (in Python when eager,
    through ``tf.py_function`` in a ``tf.function``, through ``jax.debug.callback``
    in the jax trainer's jitted step).

    Raises:
        ScalerConfigError: for an invalid config (or a config of another type).
        PolicyError: for a string or policy dict that is not a policy spec.
        UnsupportedTypeError: when ``inner_optimizer`` is not a Keras optimizer, or is itself loss scaling.
        MPXError: for Keras arguments mpx cannot honour, and for what this backend cannot do.
        FrameworkVersionError: when this Keras lacks an optimizer internal mpx uses.
    """

    #: Keras arguments beside the inner optimizer and config (named in the unknown-argument error).
    _ALLOWED = "name"
    #: The array-ops table the core's kernels run with (the transition, the history ring).
    _array_ops: ArrayOps = KERAS_ARRAY_OPS

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
            mpx.as_scaler_config(config), initial_scale, dynamic_growth_steps, dynamic, kwargs, self._ALLOWED
        )
        check_inner(inner_optimizer)
        super().__init__(
            inner_optimizer,
            initial_scale=cfg.first_scale,
            dynamic_growth_steps=cfg.growth_interval,
            name=name,
        )
        self._config = cfg
        # The state is created here, not in build(): scale_loss() in a traced step must read a
        # variable even before the first apply().  autocast=False: never read as float16.
        for spec in STATE_VARIABLES:
            self._make_state_variable(*spec)
        self._assign_state(mpx.scaler_init(cfg), cfg)
        self._mpx_extras = _Extras(cfg)  # a plain object: not tracked, not saved
        self._mpx_window = (  # checked now: an error inside fit's traced step would be masked
            self._window_class(inner_optimizer, f"{type(self).__module__.split('.')[0]}.LossScaleOptimizer")
            if inner_optimizer.gradient_accumulation_steps
            else None
        )

    def _make_state_variable(self, attr: str, saved: str, dtype: str) -> None:
        with keras.name_scope(self.name, caller=self):
            var = keras.Variable(initializer="zeros", shape=(), dtype=dtype, trainable=False, autocast=False,
                                 aggregation="only_first_replica", name=saved)  # fmt: skip
        setattr(self, attr, var)

    def _state_variables(self) -> list[keras.Variable]:
        """The five state variables, and ``nonfinite_since_growth`` where it was made."""
        specs = (*STATE_VARIABLES, GROWTH_VARIABLE)
        return [v for v in (getattr(self, attr, None) for attr, _, _ in specs) if v is not None]

    # -- Keras's optimizer API ------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)  # not Keras's LSO.build: the state exists already

    def _unsaved_variables(self) -> list[keras.Variable]:
        """On jax while recording, the history buffer's variables (listed last in :attr:`variables`: the jax
        trainer threads only these through its step); none otherwise."""
        extras = getattr(self, "_mpx_extras", None)
        if extras is None or extras.history is None or keras.config.backend() != "jax":
            return []
        return extras.history.variables

    def save_own_variables(self, store: Any) -> None:
        """Keras's saving: the state and the inner optimizer's variables (never the history buffer)."""
        for i, variable in enumerate(self._saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        """Keras's loading, of what :meth:`save_own_variables` saved (Keras's LSO files load too)."""
        saved = self._saved_variables()
        if len(store.keys()) != len(saved):
            super().load_own_variables(store)  # Keras's own warning and skip
            return
        for i, variable in enumerate(saved):
            variable.assign(store[str(i)])

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
        if dtype in HALF:
            loss, dtype = ops.cast(loss, "float32"), "float32"
        if self._config.max_consecutive_skips is not None:  # the stuck check tells a non-finite loss apart
            if is_concrete(loss):
                self._mpx_extras.loss = loss
            elif self._mpx_extras.loss_flag is not None:
                self._mpx_extras.loss_flag.note(loss)
        return ops.multiply(loss, ops.cast(self.dynamic_scale.value, dtype))

    # -- the step's parts (a backend subclass overrides them: mpx_tf) --------------------------------
    def _divide(self, g: Any, scale: Any) -> Any:
        """One gradient unscaled (:func:`divide`)."""
        return divide(g, scale)

    def _all_finite(self, grads: Sequence[Any]) -> Any:
        """A bool scalar tensor: every (not None) gradient finite (:func:`all_finite`)."""
        return all_finite(grads)

    def _combine(self, finite: Any) -> Any:
        """The flag every replica decides on (one process: ``finite`` itself)."""
        return finite

    #: The accumulation window's class (a backend subclass adds its own parts).
    _window_class: type[Window] = Window

    def _accumulation_window(self) -> Window | None:
        """The accumulation window, or None without inner ``gradient_accumulation_steps``."""
        return self._mpx_window

    def _unscaled(self, grads: list[Any], trainable_variables: Sequence[Any], scale: Any) -> list[Any]:
        if self._config.kind == "none":  # a none scale is exactly 1.0: nothing to divide
            return grads
        overwritten = _compat.optimizer_member(self, "_overwrite_variable_with_gradient")
        return [
            g if g is None or overwritten(v) else self._divide(g, scale)
            for g, v in zip(grads, trainable_variables, strict=True)
        ]

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Unscale the (scaled) ``grads``, update the scaler state, apply them unless the step is skipped."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = self._build_for(trainable_variables)
        self._replica_apply(grads, trainable_variables, variables)

    def _replica_apply(self, grads: list[Any], trainable_variables: Any, variables: list[Any]) -> None:
        unscaled = self._unscaled(grads, variables, self.dynamic_scale.value)
        window = self._accumulation_window()

        def apply_fn() -> None:
            self.inner_optimizer.apply(unscaled, trainable_variables)

        if window is None:
            finite = self._combine(self._all_finite(unscaled))
            self._apply_unless_skipped(finite, apply_fn)
            self._transition(finite)
            return

        def apply_and_reset() -> None:
            apply_fn()
            window.reset()  # +0.0 everywhere (torch's reset multiplies by 0: -0.0), as a skip leaves them

        def last_fn() -> None:
            finite = self._combine(window.finite(unscaled, variables))
            self._apply_unless_skipped(finite, apply_and_reset, window.skip)
            self._transition(finite)

        branch(window.is_last(), last_fn, apply_fn)  # an earlier micro-batch: the inner one accumulates

    def _apply_unless_skipped(self, finite: Any, apply_fn: Any, skip_fn: Any = None) -> None:
        if self._config.skip_nonfinite:
            branch(finite, apply_fn, skip_fn or (lambda: None))
        else:
            apply_fn()

    def _next_state(self, state: Sequence[Any], finite: Any) -> scale_kernel.ScaleState:
        """The six state values after a step (the core's kernel on the table; ``state``: their values, the
        sixth None when no variable holds it: the kernel then passes it through)."""
        padded = scale_kernel.ScaleState(*state, *[None] * (len(scale_kernel.ScaleState._fields) - len(state)))
        return scale_kernel.update(self._array_ops, self._config, padded, finite)

    def _transition(self, finite: Any) -> None:
        """:func:`mpx.scaler_update` on the variables, the history row and the stuck check."""
        state = self._state_variables()
        new = self._next_state([v.value for v in state], finite)
        cfg = self._config
        hit = scale_kernel.floor_hit(self._array_ops, cfg, state[0].value, new) if cfg.on_floor == "raise" else None
        extras = self._mpx_extras
        if extras.history is not None:  # from the tracker before the step: read before the assignments
            events = scale_kernel.events(self._array_ops, cfg, state[1].value, new)
        for var, value in zip(state, new[: len(state)], strict=True):
            var.assign(value)
        if extras.history is not None:
            extras.history.record(self._array_ops, new, events)
        if hit is not None:  # on_floor="raise": where the stuck check runs, after the step
            if is_concrete(finite):
                mpx.check_floor(cfg, *(ops.convert_to_numpy(t) for t in (hit, new.steps, new.scale)))
            elif _compat.in_xla_context():  # XLA cannot call the host: check_stuck() raises, after the step
                extras.floor.mark(hit, new.steps, new.scale)
            else:
                check_floor_in_step(cfg, hit, new.steps, new.scale, None)
        if self._config.max_consecutive_skips is None:
            return
        if is_concrete(finite):
            loss, extras.loss = extras.loss, None
            flag = None if loss is None else bool(np.all(np.isfinite(ops.convert_to_numpy(loss))))
            mpx.check_stuck(self._config, *(ops.convert_to_numpy(t) for t in (new[0], new[2])), flag,
                            stacklevel=self._stuck_stacklevel)  # fmt: skip
        elif _compat.in_xla_context():  # XLA cannot call the host: check_stuck() does, between steps
            extras.unchecked = True
        else:
            flag = None if extras.loss_flag is None else extras.loss_flag.take()
            check_stuck_in_step(self._config, new[0], new[2], flag, None)

    def check_stuck(self) -> None:
        """The stuck check of the current state, on the host, for steps that could not check themselves.

        Every step checks itself (:mod:`mpx_keras.history`) except one compiled by XLA on
        TensorFlow (``jit_compile=True``), which cannot call the host: for those this
        method runs :func:`mpx.check_stuck` (once per optimizer step) and raises the floor error such a step
        marked (:class:`mpx_keras.history.FloorMark`), and :class:`mpx_keras.LossScaleMonitor` calls it after
        each batch.  Otherwise it does nothing.

        Raises:
            ScalerStuckError: in raise mode, when the scaler is stuck.
            ScalerFloorError: ``on_floor="raise"``: a jit_compile step's back-off was due at ``min_scale``.
        """
        extras = self._mpx_extras
        if extras.floor is not None:
            extras.floor.check(self._config)
        if not extras.unchecked or self._config.max_consecutive_skips is None:
            return
        state = self.state
        if state.steps == extras.checked_at:
            return
        extras.checked_at = state.steps
        flag = None if extras.loss_flag is None else int(ops.convert_to_numpy(extras.loss_flag.flag.value))
        mpx.check_stuck(self._config, state.scale, state.consecutive_nonfinite, flag, stacklevel=3)

    #: How far up the eager stuck check's warning points (the user's apply call).
    _stuck_stacklevel = 5

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """The step as a pure function of the variables' values (the jax trainer calls it).

        Returns ``(new trainable values, new optimizer values)``, ``optimizer_variables``
        ordered as :attr:`variables`.  A skipped step (a skipped window's last
        micro-batch) returns the trainable and inner values as before it (the window).
        Branches are ``keras.ops.cond`` and selects, never a Python branch on a value.
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
        cfg = self._config
        variables = self.variables
        own = self._variables
        inner_vars = list(self.inner_optimizer.variables)
        extra = self._unsaved_variables()
        optimizer_variables = list(optimizer_variables)
        trainable_values = list(trainable_variables)
        inner_values = optimizer_variables[len(own) : len(own) + len(inner_vars)]
        model_variables = list(_compat.optimizer_member(self, "_trainable_variables"))
        mapping = list(zip(variables, optimizer_variables, strict=True))
        window = self._accumulation_window()
        with _compat.StatelessScope(
            state_mapping=mapping + list(zip(model_variables, trainable_values, strict=True))
        ) as scope:
            state = [scope.get_current_value(v) for v in self._state_variables()]
            unscaled = self._unscaled(list(grads), model_variables, state[0])
            if window is None:
                finite, last = self._all_finite(unscaled), None
            else:
                finite, last = window.finite(unscaled, model_variables), window.is_last()

        def apply_fn() -> Any:
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                inner_values, unscaled, trainable_values
            )
            return list(new_trainable), list(new_inner)

        def skip_fn() -> Any:
            if window is None:
                return list(trainable_values), list(inner_values)
            with _compat.StatelessScope(
                state_mapping=list(zip(inner_vars, inner_values, strict=True))
            ) as skipped:
                window.skip()
                return list(trainable_values), [skipped.get_current_value(v) for v in inner_vars]

        if cfg.skip_nonfinite:
            skip = ops.logical_not(finite) if last is None else ops.logical_and(last, ops.logical_not(finite))
            new_trainable, new_inner = ops.cond(skip, skip_fn, apply_fn)
        else:
            new_trainable, new_inner = apply_fn()
        with _compat.StatelessScope(state_mapping=mapping) as scope:
            new = self._next_state(state, finite)
            if last is not None:  # the scaler moves at the window's last micro-batch only
                new = scale_kernel.ScaleState(
                    *(ops.where(last, n, s) for n, s in zip(new, state, strict=False)), *new[len(state) :]
                )
            for var, value in zip(self._state_variables(), new[: len(state)], strict=True):
                var.assign(value)
            if self._mpx_extras.history is not None:
                events = scale_kernel.events(self._array_ops, cfg, state[1], new)
                self._mpx_extras.history.record(self._array_ops, new, events, when=last)
            new_own = [scope.get_current_value(v) for v in own]
            new_extra = [scope.get_current_value(v) for v in extra]
        if cfg.max_consecutive_skips is not None:
            check_stuck_in_step(cfg, new[0], new[2], None, last)
        if cfg.on_floor == "raise":
            check_floor_in_step(cfg, scale_kernel.floor_hit(self._array_ops, cfg, state[0], new), new.steps,
                                new.scale, last)  # fmt: skip
        return list(new_trainable), new_own + list(new_inner) + new_extra

    # -- history (mpx_keras.history) ------------------------------------------------------------
    @property
    def recording_history(self) -> bool:
        """Whether :meth:`record_history` is on."""
        return self._mpx_extras.history is not None

    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each optimizer step.

        Keeps the last ``capacity`` steps (default 65536) in a ring-buffer variable
        written inside the step (eager, ``tf.function``, ``jit_compile``, the jax
        trainer's jitted step); starting again clears the record.  Call it before
        the step is traced (for an already traced ``fit``:
        ``model.make_train_function(force=True)``).

        Raises:
            MPXError: for a ``capacity`` that is not an int in [1, 2**31 - 1].
        """
        self._mpx_extras.history = HistoryBuffer(capacity) if enabled else None

    def history(self) -> mpx.ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory` (one host read of the buffer).

        Raises:
            MPXError: when :meth:`record_history` was not called.
        """
        if self._mpx_extras.history is None:
            raise MPXError("history: not recording; call optimizer.record_history() before training.")
        return self._mpx_extras.history.read(self._config)

    # -- mpx's scaler API ------------------------------------------------------------------
    @property
    def config(self) -> mpx.ScalerConfig:
        """The :class:`mpx.ScalerConfig` (read-only)."""
        return self._config

    @property
    def state(self) -> mpx.ScalerState:
        """The current state, read from the variables (a host read)."""
        values = [ops.convert_to_numpy(v.value) for v in self._state_variables()]
        return mpx.ScalerState(
            scale=float(np.float32(values[0])),
            growth_tracker=int(values[1]),
            consecutive_nonfinite=int(values[2]),
            steps=int(values[3]),
            skipped_steps=int(values[4]),
            nonfinite_since_growth=int(values[5]) if len(values) > 5 else 0,
        )

    def get_scale(self) -> float:
        """The current loss scale as a Python float (a host read; in a traced step use ``dynamic_scale``)."""
        return float(np.float32(ops.convert_to_numpy(self.dynamic_scale.value)))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (format ``mpx.scaler/1``), as every mpx scaler writes."""
        return mpx.state_dict(self._config, self.state)

    def last_step_skipped(self) -> Any:
        """Whether the last optimizer step (an accumulation window's last micro-batch) was skipped: a bool
        scalar tensor, read from the state with no host read (usable inside a traced step); False before the
        first step and for a config that does not skip."""
        if not self._config.skip_nonfinite:
            return ops.convert_to_tensor(False)
        return ops.greater(self.consecutive_nonfinite.value, 0)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore config and state from any mpx scaler's state dict; on error nothing changes.

        The config is Python-side: a step traced before a load that changes it keeps the
        old constants, so load before training (or call ``model.make_train_function(force=True)``).

        Raises:
            StateDictError: for a malformed dict.
        """
        config, state = mpx.load_state_dict(state_dict)  # every check first: below, nothing can fail
        self._assign_state(state, config)
        self._config = config
        self._mpx_extras.configure(config)
        self.initial_scale = config.first_scale
        self.dynamic_growth_steps = config.growth_interval

    def _assign_state(self, state: mpx.ScalerState, config: mpx.ScalerConfig) -> None:
        if config.hysteresis_reset == "growth" and getattr(self, GROWTH_VARIABLE[0], None) is None:
            self._make_state_variable(*GROWTH_VARIABLE)  # a load into a scaler built without it
        values = (np.float32(state.scale), state.growth_tracker, state.consecutive_nonfinite, state.steps,
                  state.skipped_steps, state.nonfinite_since_growth)  # fmt: skip
        for var, value in zip(self._state_variables(), values, strict=False):
            var.assign(np.asarray(value, dtype=var.dtype))

    # -- serialization ---------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """``name``, the serialized ``inner_optimizer`` and ``config`` (``from_config`` also reads Keras's
        ``initial_scale`` and ``dynamic_growth_steps``)."""
        return {**super().get_config(), "config": self._config.to_dict()}

    def __repr__(self) -> str:
        return (
            f"<{type(self).__module__.split('.')[0]}.LossScaleOptimizer kind={self._config.kind!r} "
            f"inner={type(self.inner_optimizer).__name__} name={self.name!r}>"
        )


class _Extras:
    """The optimizer's optional parts: the history buffer, the loss flag (None when off) and the
    last eager loss; a plain object, so nothing in it is tracked or saved."""

    def __init__(self, config: mpx.ScalerConfig) -> None:
        self.history: HistoryBuffer | None = None
        self.loss_flag: LossFlag | None = None
        self.floor: FloorMark | None = None  # on_floor="raise" on TensorFlow: a jit_compile step marks, check_stuck raises
        self.loss: Any = None
        self.unchecked = False  # a step was traced where it cannot check itself (XLA on TensorFlow)
        self.checked_at = -1  # the step count check_stuck() last checked
        self.configure(config)

    def configure(self, config: mpx.ScalerConfig) -> None:
        """A loss flag for a traced TensorFlow step, once the config checks for stuck scaling."""
        if (
            config.max_consecutive_skips is not None
            and self.loss_flag is None
            and keras.config.backend() == "tensorflow"
        ):
            self.loss_flag = LossFlag()
        if config.on_floor == "raise" and self.floor is None and keras.config.backend() == "tensorflow":
            self.floor = FloorMark()
