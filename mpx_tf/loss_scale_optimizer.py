"""A Keras 3 ``LossScaleOptimizer`` that runs mpx's loss-scaling state machine.

It is Keras's own optimizer API (``scale_loss``, ``apply`` taking scaled
gradients, ``apply_gradients``, ``inner_optimizer``, ``variables``,
``get_config``/``from_config``) with the transition of
:func:`mpx.scaler_update`, bit for bit, as TensorFlow ops on variables:

- the state lives in variables (a float32 ``dynamic_scale``, int64 counters),
  so a ``tf.function`` step reads the current scale and never retraces;
- every scale product is torch's, ``float32(float64(scale) * float64(factor))``
  (:func:`mpx.scaling.scale_product`), computed exactly by the core's
  :func:`mpx.scaling.product_bits` on the scale's int32 bits
  (:mod:`mpx_tf._scale_bits`: ``keras.ops``, no float64, immune to
  TensorFlow's flush-to-zero); the scale is floored at 2**-126;
- the finiteness test is on the unscaled gradients, so a gradient that
  overflows only once divided by a scale below 1 skips the step (as mpx_jax);
- a skipped step runs no update at all (``tf.cond``, as Keras's own
  ``LossScaleOptimizer`` does), so the model's variables and the inner
  optimizer's (``iterations``, moments) stay bit-identical;
- under ``tf.distribute`` the finiteness flag is summed over all replicas
  before the decision, so every replica skips or applies together;
- with the inner optimizer's ``gradient_accumulation_steps=k`` the scaler
  moves once per window of k micro-batches and a window holding a non-finite
  micro-batch is skipped whole (:mod:`mpx_tf.distributed`, :mod:`mpx.accumulation`);
- ``reduce_dtype=`` runs the cross-replica gradient sum in that dtype
  (:func:`mpx_tf.distributed.set_reduce_dtype`).

It subclasses ``keras.optimizers.LossScaleOptimizer`` so that ``model.compile``
under ``mixed_float16`` does not wrap it a second time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import mpx
from mpx.errors import MPXError, UnsupportedTypeError
from mpx_keras._scale_bits import TensorOps, next_scale
from mpx_keras.loss_scale_optimizer import keras_arguments
from mpx_tf import _compat
from mpx_tf.distributed import Window, reduce_dtype_of, set_reduce_dtype, window_step
from mpx_tf.history import HistoryBuffer, LossFlag, stuck_check

__all__ = ["LossScaleOptimizer"]

_HALF = (tf.float16, tf.bfloat16)
#: TensorFlow's own functions for the core's scale product (mpx_tf._scale_bits): an eager step is
#: about twice as fast as through keras.ops' wrappers.
_TF_OPS = TensorOps(
    tf.bitwise.right_shift, tf.bitwise.left_shift, tf.bitwise.bitwise_and, tf.bitwise.bitwise_or,
    tf.math.logical_and, tf.math.logical_or, tf.where, tf.math.minimum, tf.math.maximum,
    lambda x, dtype: tf.bitcast(x, dtype), lambda x: tf.constant(x, tf.int32),
)  # fmt: skip


@keras.saving.register_keras_serializable(package="mpx_tf")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's ``LossScaleOptimizer`` API over mpx's state machine.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` that applies the unscaled gradients.
        config: what :func:`mpx.as_scaler_config` reads, as every mpx scaler: an
            :class:`mpx.ScalerConfig` or its ``to_dict()`` dict; a policy (an
            :class:`mpx.Policy`, a spec string such as ``"mixed_float16"``, or a
            policy dict), giving ``ScalerConfig.for_policy`` (dynamic for float16
            compute; ``none`` for bfloat16: the optimizer then only counts steps
            and passes the gradients through); None (default) for the default
            dynamic config (initial scale 2**16, growth every 2000 finite steps,
            bounds [1, 2**24]).
        initial_scale, dynamic_growth_steps, dynamic: keyword only, Keras's
            arguments: they set ``init_scale`` and ``growth_interval`` of a dynamic
            config (default None: the config's); ``dynamic`` must be True.
        name: the optimizer's name.
        reduce_dtype: keyword only; the dtype of the cross-replica gradient sum
            under ``tf.distribute`` (a dtype, or an :class:`mpx.Policy` / spec
            for its ``reduce_dtype``); None (default) sums in the gradients' dtype.

    Gradient accumulation: give the *inner* optimizer
    ``gradient_accumulation_steps=k``.  ``scale_loss`` then uses one scale for
    the k micro-batches of a window, the scaler makes one transition per window
    (``total_steps`` counts windows), and a window with a non-finite
    micro-batch is skipped whole: the model's and the inner optimizer's
    variables (moments, accumulators, ``iterations``) end bit-identical to
    before the window, so ``iterations`` counts applied optimizer steps.

    In ``model.fit`` Keras's train step calls :meth:`scale_loss` and
    :meth:`apply_gradients` itself, whatever the dtype policy.  In a custom
    loop::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # unscales, checks, maybe skips

    mpx's scaler surface, the same as every mpx backend's: :meth:`get_scale`
    (the scale as a Python float), :meth:`scale` (multiplies a loss; Keras's
    :meth:`scale_loss` is the same), :attr:`state` (an :class:`mpx.ScalerState`:
    read the counters there), :attr:`config`, :meth:`state_dict` /
    :meth:`load_state_dict`, :meth:`record_history` / :meth:`history`.

    The state is five variables, saved by ``model.save`` and ``tf.train.Checkpoint``:
    ``dynamic_scale`` (float32, the scale), ``step_counter`` (int64, mpx's
    ``growth_tracker``; Keras's name), ``consecutive_nonfinite``, ``total_steps``
    (mpx's ``steps``) and ``skipped_steps`` (int64); in a traced step read
    ``dynamic_scale``, on the host :attr:`state`.  ``iterations`` is the inner
    optimizer's: skipped steps do not count.  Build the optimizer before
    tracing a custom step (``optimizer.build(model.trainable_variables)``), or
    ``tf.function`` traces the first step twice to create the inner variables.

    Raises:
        ScalerConfigError: for an invalid config (or a config of another type).
        PolicyError: for a string or policy dict that is not a policy spec.
        UnsupportedTypeError: when ``inner_optimizer`` is not a Keras optimizer, or is itself loss scaling.
        MPXError: for Keras arguments mpx cannot honour.
        FrameworkVersionError: when this Keras lacks an optimizer internal mpx_tf uses.
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
        reduce_dtype: Any = None,
        **kwargs: Any,
    ) -> None:
        reduce = reduce_dtype_of(reduce_dtype)
        cfg = keras_arguments(
            mpx.as_scaler_config(config), initial_scale, dynamic_growth_steps, dynamic, kwargs,
            allowed="name, reduce_dtype",
        )  # fmt: skip
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise UnsupportedTypeError(
                f"inner_optimizer: expected a keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}."
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise UnsupportedTypeError(
                "inner_optimizer: it is already a LossScaleOptimizer; wrap the plain optimizer once."
            )
        _compat.check_optimizer(inner_optimizer)
        super().__init__(
            inner_optimizer,
            initial_scale=cfg.first_scale,
            dynamic_growth_steps=cfg.growth_interval,
            name=name,
        )
        self._config = cfg
        self._reduce_dtype = reduce
        if reduce is not None:
            set_reduce_dtype(inner_optimizer, reduce)

        # The state is created here, not in build(): scale_loss() in a traced
        # step must read a variable even before the first apply().
        # autocast=False: a layer's autocast scope must never read the scale as float16.
        def state(name: str, dtype: str) -> keras.Variable:
            with keras.name_scope(self.name, caller=self):
                return keras.Variable(
                    initializer="zeros",
                    shape=(),
                    dtype=dtype,
                    trainable=False,
                    autocast=False,
                    aggregation="only_first_replica",
                    name=name,
                )

        self.dynamic_scale = state("dynamic_scale", "float32")
        self.step_counter = state("step_counter", "int64")  # mpx's growth_tracker (Keras's name)
        self.consecutive_nonfinite = state("consecutive_nonfinite", "int64")
        self.total_steps = state("steps", "int64")
        self.skipped_steps = state("skipped_steps", "int64")
        self._assign_state(mpx.scaler_init(cfg))
        # history and stuck detection (mpx_tf.history): a plain, untracked object
        self._mpx_extras = _Extras(cfg)

    # -- Keras's optimizer API ------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)  # not Keras's LSO.build: state exists already

    def scale(self, loss: Any) -> Any:
        """``loss`` times the current scale (a half-precision loss is first cast to float32).

        mpx's name, the same in every backend; :meth:`scale_loss` is Keras's name for it.
        With kind ``none`` the loss comes back unchanged.
        """
        return self.scale_loss(loss)

    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the current scale (a half-precision loss is first cast to float32): Keras's name
        for :meth:`scale`, which ``model.fit``'s train step calls."""
        if self._config.kind == "none":
            return loss
        loss = tf.convert_to_tensor(loss)
        if loss.dtype in _HALF:
            loss = tf.cast(loss, tf.float32)
        if self._mpx_extras.loss_flag is not None:  # stuck detection tells a non-finite loss apart
            self._mpx_extras.loss_flag.note(loss)
        return loss * tf.cast(self.dynamic_scale.value, loss.dtype)

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
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if _compat.strategy_supports_no_merge_call():
            self._replica_apply(grads, trainable_variables)
        else:
            tf.distribute.get_replica_context().merge_call(
                self._cross_replica_apply, args=(grads, trainable_variables)
            )

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise ValueError(
            "stateless_apply is not supported with the TensorFlow backend (Keras refuses it for every "
            "optimizer there, as it is incompatible with tf.distribute); use apply() or apply_gradients()"
        )

    # -- the step ----------------------------------------------------------------------
    def _unscale(
        self, grads: list[Any], trainable_variables: Sequence[Any] | None, check: bool = True
    ) -> tuple[list[Any], Any]:
        """(unscaled gradients, bool tensor: all the unscaled ones finite) on one replica.

        The check is on the unscaled gradients (the ones applied), as mpx_jax's: a
        scaled gradient that is not finite stays so, and a finite one that
        overflows when divided by a scale below 1 is caught too.
        """
        if self._config.kind != "none":  # a none scale is exactly 1.0: nothing to divide
            if trainable_variables is None:
                trainable_variables = _compat.optimizer_member(self, "_trainable_variables")
            overwritten = _compat.optimizer_member(self, "_overwrite_variable_with_gradient")
            scale = self.dynamic_scale.value
            grads = [
                g if g is None or overwritten(v) else _divide(g, scale)
                for g, v in zip(grads, trainable_variables, strict=True)
            ]
        if not check:  # accumulation: the window's check runs at its last micro-batch (Window.finite)
            return grads, tf.constant(True)
        flags = [tf.reduce_all(tf.math.is_finite(_values(g))) for g in grads if g is not None]
        finite = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
        return grads, finite

    def _window(self) -> Window | None:
        return Window(self.inner_optimizer) if self.inner_optimizer.gradient_accumulation_steps else None

    def _replica_apply(self, grads: list[Any], trainable_variables: Any) -> None:
        window = self._window()
        grads, finite = self._unscale(grads, trainable_variables, check=window is None)
        ctx = tf.distribute.get_replica_context()

        def combined(finite: Any) -> Any:
            if ctx is not None and ctx.num_replicas_in_sync > 1:
                nonfinite = ctx.all_reduce(
                    tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
                )
                finite = tf.equal(nonfinite, 0.0)
            return finite

        def apply_fn() -> None:
            self.inner_optimizer.apply(grads, trainable_variables)

        if window is None:
            finite = combined(finite)
            self._apply_unless_skipped(finite, apply_fn)
            self._transition(finite)
            return

        def last_fn() -> None:
            finite = combined(window.finite(grads, trainable_variables))
            self._apply_unless_skipped(finite, apply_fn, window.skip)
            self._transition(finite)

        window_step(window, apply_fn, last_fn)

    def _cross_replica_apply(self, distribution: Any, grads: Any, trainable_variables: Any) -> None:
        # Unscale and check on each replica, then decide once for all of them.
        window = self._window()
        unscaled, finite_per_replica = distribution.extended.call_for_each_replica(
            self._unscale, args=(grads, trainable_variables, window is None)
        )

        def combined(finite_per_replica: Any) -> Any:
            nonfinite = distribution.reduce(
                tf.distribute.ReduceOp.SUM,
                distribution.extended.call_for_each_replica(
                    lambda f: tf.cast(tf.logical_not(f), tf.float32), args=(finite_per_replica,)
                ),
                axis=None,
            )
            return tf.equal(nonfinite, 0.0)

        def apply_fn() -> None:
            distribution.extended.call_for_each_replica(
                self.inner_optimizer.apply, args=(unscaled, trainable_variables)
            )

        # In cross-replica context, as Keras does: a cond in replica context
        # cannot hold the merge_call the inner optimizer makes.
        if window is None:
            finite = combined(finite_per_replica)
            self._apply_unless_skipped(finite, apply_fn)
            self._transition(finite)
            return

        def last_fn() -> None:
            finite = combined(
                distribution.extended.call_for_each_replica(
                    window.finite, args=(unscaled, trainable_variables)
                )
            )
            self._apply_unless_skipped(
                finite, lambda: window.apply(distribution, unscaled, trainable_variables), window.skip
            )
            self._transition(finite)

        window_step(window, lambda: window.accumulate(distribution, unscaled, trainable_variables), last_fn)

    def _apply_unless_skipped(self, finite: Any, apply_fn: Any, skip_fn: Any = None) -> None:
        if self._config.skip_nonfinite:
            keras.ops.cond(finite, apply_fn, skip_fn or (lambda: None))
        else:
            apply_fn()

    def _transition(self, finite: Any) -> None:
        """:func:`mpx.scaler_update` on the variables (``finite``: a bool scalar tensor)."""
        cfg = self._config
        cap = tf.constant(mpx.COUNTER_MAX, tf.int64)  # the counters saturate, as the reference's
        consecutive = tf.where(
            finite, tf.constant(0, tf.int64), tf.minimum(self.consecutive_nonfinite.value + 1, cap)
        )
        if cfg.kind == "dynamic":
            tracker = self.step_counter.value + 1
            at_interval = tf.equal(tracker, cfg.growth_interval)
            back = consecutive >= cfg.hysteresis
            scale = next_scale(cfg, self.dynamic_scale.value, finite, at_interval, back, _TF_OPS)
            self.dynamic_scale.assign(scale)
            self.step_counter.assign(tf.where(finite & tf.logical_not(at_interval), tracker, 0))
        self.consecutive_nonfinite.assign(consecutive)
        self.total_steps.assign(tf.minimum(self.total_steps.value + 1, cap))
        if cfg.skip_nonfinite:
            skipped = self.skipped_steps.value + tf.cast(tf.logical_not(finite), tf.int64)
            self.skipped_steps.assign(tf.minimum(skipped, cap))
        extras = self._mpx_extras
        if extras.history is not None:
            extras.history.record(
                self.dynamic_scale.value, self.step_counter.value, consecutive, self.total_steps.value
            )
        if extras.loss_flag is not None and cfg.max_consecutive_skips is not None:
            stuck_check(cfg, self.dynamic_scale.value, consecutive, extras.loss_flag.take())

    # -- history (mpx_tf.history) ------------------------------------------------------------
    @property
    def recording_history(self) -> bool:
        """Whether :meth:`record_history` is on."""
        return self._mpx_extras.history is not None

    def record_history(self, enabled: bool = True, *, capacity: int = 65536) -> None:
        """Start (or with False stop) recording the state after each step into a ring-buffer variable.

        Keeps the last ``capacity`` steps (default 65536); starting again
        clears the record.  Call it before the training step is traced
        (``model.fit``: or call ``model.make_train_function(force=True)``).
        """
        self._mpx_extras.history = HistoryBuffer(capacity) if enabled else None

    def history(self) -> mpx.ScalerHistory:
        """The recorded steps as an :class:`mpx.ScalerHistory` (one read of the buffer).

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
        return mpx.ScalerState(
            scale=float(np.float32(self.dynamic_scale.numpy())),
            growth_tracker=int(self.step_counter.numpy()),
            consecutive_nonfinite=int(self.consecutive_nonfinite.numpy()),
            steps=int(self.total_steps.numpy()),
            skipped_steps=int(self.skipped_steps.numpy()),
        )

    def get_scale(self) -> float:
        """The current loss scale as a Python float (a host read; in a traced step use ``dynamic_scale``)."""
        return float(np.float32(self.dynamic_scale.numpy()))

    def state_dict(self) -> dict[str, Any]:
        """The neutral JSON-safe state dict (format ``mpx.scaler/1``), as every mpx scaler writes."""
        return mpx.state_dict(self._config, self.state)

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore config and state from any mpx scaler's state dict; on error nothing changes.

        The config is Python-side: a step traced before a load that changes
        it (``model.fit``'s cached train function) keeps the old constants, so
        load before training, or call ``model.make_train_function(force=True)``.

        The dict is validated whole by :func:`mpx.load_state_dict` before
        anything changes (its counters fit the int64 variables).

        Raises:
            StateDictError: for a malformed dict.
        """
        config, state = mpx.load_state_dict(data)  # every check first: below, nothing can fail
        self._assign_state(state)
        self._config = config
        self._mpx_extras.configure(config)
        self.initial_scale = config.first_scale
        self.dynamic_growth_steps = config.growth_interval

    def _assign_state(self, state: mpx.ScalerState) -> None:
        self.dynamic_scale.assign(np.float32(state.scale))
        self.step_counter.assign(np.int64(state.growth_tracker))
        self.consecutive_nonfinite.assign(np.int64(state.consecutive_nonfinite))
        self.total_steps.assign(np.int64(state.steps))
        self.skipped_steps.assign(np.int64(state.skipped_steps))

    # -- serialization ---------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "config": self._config.to_dict(),
            **({"reduce_dtype": self._reduce_dtype} if self._reduce_dtype is not None else {}),
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
            f"<mpx_tf.LossScaleOptimizer kind={self._config.kind!r} "
            f"inner={type(self.inner_optimizer).__name__} name={self.name!r}>"
        )


class _Extras:
    """The optimizer's optional parts: the history buffer and the loss flag (None when off)."""

    def __init__(self, config: mpx.ScalerConfig) -> None:
        self.history: HistoryBuffer | None = None
        self.loss_flag: LossFlag | None = None
        self.configure(config)

    def configure(self, config: mpx.ScalerConfig) -> None:
        if config.max_consecutive_skips is not None and self.loss_flag is None:
            self.loss_flag = LossFlag()


def _values(g: Any) -> Any:
    return g.values if isinstance(g, tf.IndexedSlices) else g


def _divide(g: Any, scale: tf.Tensor) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(g.values, scale), g.indices, g.dense_shape)
    g = tf.convert_to_tensor(g)
    if g.dtype in _HALF:  # unscale in float32, then back to the gradient's dtype
        return tf.cast(tf.cast(g, tf.float32) / scale, g.dtype)
    return g / tf.cast(scale, g.dtype)
