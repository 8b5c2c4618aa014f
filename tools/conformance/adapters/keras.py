"""The Keras 3 adapter, on whichever backend Keras runs (``KERAS_BACKEND``): the cases Keras answers itself.

Natively: Keras's dtype policies (``keras.mixed_precision``) and ``keras.optimizers.LossScaleOptimizer``;
under mpx: :mod:`mpx_keras` (``policy_scope``/``apply_policy``, its ``LossScaleOptimizer``, its op table
for functional ``keras.ops`` code through ``autocast``).  Tensors are made with ``keras.ops`` and numpy.
What differs per backend is small and lives in :class:`KerasAdapter`'s hooks:

- :meth:`~KerasAdapter.value_and_grad`: a loss and its gradients (``jax.value_and_grad`` through a
  ``keras.StatelessScope`` on jax, ``torch.autograd.grad`` on torch; TensorFlow's adapter: a tape);
- :meth:`~KerasAdapter.apply`: one optimizer step the way ``fit`` takes it (jax: the pure
  ``stateless_apply`` under ``jax.jit``, its results assigned back; elsewhere the eager ``apply``).

The modules ``keras_jax`` and ``keras_torch`` set ``KERAS_BACKEND`` and export one adapter;
:mod:`conformance.adapters.tf` subclasses :class:`KerasAdapter` with what is TensorFlow's own.

Native code paths import nothing of mpx (conformance/isolation.py); mpx paths import it inside
the function (:meth:`KerasAdapter.mpx`).  A scaler config in ``params`` is ``mpx.ScalerConfig.to_dict()``'s
dict: the native paths read its keys, the mpx paths hand it to the scaler as it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from conformance.adapters._common import (
    dtype_name,
    flag_gradient,
    max_rel_error,
    mlp_data,
    mlp_reference,
    op_input,
    rel_error,
)
from mpx_tools.skip import Skip

L = keras.layers
ops = keras.ops

#: op -> (layer factory, input shape (without batch), number of inputs): ops a Keras layer computes
LAYERS: dict[str, tuple[Any, tuple[int, ...], int]] = {
    "linear": (lambda: L.Dense(6), (8,), 1),
    "conv": (lambda: L.Conv2D(3, 3), (6, 6, 2), 1),
    "conv_transpose": (lambda: L.Conv2DTranspose(3, 3), (6, 6, 2), 1),
    "einsum": (lambda: L.EinsumDense("ab,bc->ac", output_shape=3), (8,), 1),
    "attention": (lambda: L.MultiHeadAttention(2, 4), (4, 8), 2),
    "softmax": (lambda: L.Softmax(), (8,), 1),
    "log_softmax": (lambda: L.Activation("log_softmax"), (8,), 1),
    "layer_norm": (lambda: L.LayerNormalization(), (8,), 1),
    "batch_norm": (lambda: L.BatchNormalization(), (8,), 1),
    "group_norm": (lambda: L.GroupNormalization(groups=2), (6, 6, 2), 1),
    "rms_norm": (lambda: L.RMSNormalization(), (8,), 1),
    "relu": (lambda: L.ReLU(), (8,), 1),
    "gelu": (lambda: L.Activation("gelu"), (8,), 1),
    "max_pool": (lambda: L.MaxPooling2D(2), (6, 6, 2), 1),
    "reshape": (lambda: L.Reshape((2, 4)), (8,), 1),
    "transpose": (lambda: L.Permute((2, 1)), (4, 8), 1),
    "dropout": (lambda: L.Dropout(0.5), (8,), 1),
    "add": (lambda: L.Add(), (8,), 2),
    "mul": (lambda: L.Multiply(), (8,), 2),
    "cat": (lambda: L.Concatenate(), (8,), 2),
}

#: Keras's own policy names (what a native run can set)
KERAS_POLICIES = ("float32", "float16", "bfloat16", "float64", "mixed_float16", "mixed_bfloat16")


def keras_policy(p: dict) -> str:
    """The Keras policy a native run uses for the case's mpx policy (Keras has no keep_fp32 or overrides):
    ``mixed_<compute>`` for float32 parameters computing in half, else the compute dtype, from the
    ``policy_dtypes`` the runner precomputed (:func:`conformance.cases.policy_dtypes`)."""
    d = p.get("policy_dtypes")
    if d is None:
        if p["policy"] in KERAS_POLICIES:
            return p["policy"]
        raise Skip(f"no Keras dtype policy for {p['policy']!r} (the case has no policy_dtypes)")
    if d["lowers_precision"] and d["param_dtype"] == "float32":
        return f"mixed_{d['compute_dtype']}"
    return d["compute_dtype"]


def _call(layer: Any, op: str, inputs: list) -> Any:
    if op == "attention":
        return layer(inputs[0], inputs[1])
    if len(inputs) == 2:
        return layer(inputs)
    if op in ("dropout", "batch_norm"):
        return layer(inputs[0], training=True)
    return layer(inputs[0])


def _group_norm(a: Any) -> Any:
    g = ops.reshape(a, (1, 6, 6, 2, 1))
    mean, var = ops.moments(g, axes=(1, 2, 4), keepdims=True)
    return ops.reshape((g - mean) * ops.rsqrt(var + 1e-5), ops.shape(a))


def _nll(a: Any, target: Any) -> Any:
    return -ops.mean(ops.take_along_axis(a, ops.expand_dims(target, -1), axis=-1))


def _batch_norm(a: Any) -> Any:
    mean, var = ops.moments(a, axes=(0,))
    return ops.batch_normalization(a, mean, var, axis=-1, epsilon=1e-5)


#: ops Keras has no function for, written by hand: under mpx they are declared with ``autocast_op``
#: (what a user does for such a function)
COMPOSITES = {"group_norm": _group_norm, "nll_loss": _nll}


def _tensor(x: np.ndarray, dtype: str) -> Any:
    return ops.cast(ops.convert_to_tensor(x), dtype)


def _numpy(x: Any) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


class KerasAdapter:
    """The cases on Keras 3, on the backend this process runs Keras on.

    A subclass changes the hooks (:meth:`mpx`, :meth:`functions`, :meth:`value_and_grad`,
    :meth:`apply`) or a case; :func:`export` binds an instance's ``info``, ``save_state`` and
    ``run_*`` methods as a module's functions (what the worker calls).
    """

    #: the conformance backend's name (the report's column)
    name = "keras"

    def __init__(self) -> None:
        self._jitted: dict[int, tuple[Any, Any]] = {}

    # -- hooks ------------------------------------------------------------------------------------
    def mpx(self) -> Any:
        """The mpx package the mpx paths use (imported here, never on a native path)."""
        return importlib.import_module("mpx_keras")

    def info(self) -> dict:
        backend = keras.backend.backend()
        version = getattr(importlib.import_module(backend), "__version__", "?")
        return {"version": f"keras {keras.__version__} on {backend} {version}", "device": "cpu"}

    def value_and_grad(self, fn: Callable[[], Any], variables: Sequence[Any]) -> tuple[Any, list]:
        """``fn()`` and its gradients with respect to the Keras ``variables``."""
        backend = keras.backend.backend()
        if backend == "jax":
            jax = importlib.import_module("jax")

            def pure(values: list) -> Any:
                with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                    return fn()

            loss, grads = jax.value_and_grad(pure)([v.value for v in variables])
            return loss, list(grads)
        if backend == "torch":
            torch = importlib.import_module("torch")
            loss = fn()
            return loss, list(torch.autograd.grad(loss, [v.value for v in variables]))
        raise NotImplementedError(f"no gradients for Keras's {backend} backend in {type(self).__name__}")

    def apply(self, opt: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """One optimizer step as ``fit`` takes it: on jax the pure ``stateless_apply`` (jitted), else ``apply``."""
        if keras.backend.backend() != "jax":
            opt.apply(list(grads), list(variables))
            return
        jax = importlib.import_module("jax")
        if not opt.built:
            opt.build(list(variables))
        held, step = self._jitted.get(id(opt), (None, None))
        if held is not opt:  # one compilation per optimizer (kept alive with it: ids are not reused)
            step = jax.jit(opt.stateless_apply)
            self._jitted[id(opt)] = (opt, step)
        new_vars, new_opt = step([v.value for v in opt.variables], list(grads), [v.value for v in variables])
        for var, value in zip(variables, new_vars, strict=True):
            var.assign(value)
        for var, value in zip(opt.variables, new_opt, strict=True):
            var.assign(value)

    # -- ops ----------------------------------------------------------------------------------------
    def _x(self, shape: tuple[int, ...], dtype: str, seed: int = 0, positive: bool = False) -> Any:
        return _tensor(op_input(shape, seed, positive), dtype)

    def composite(self, op: str, mode: str) -> Any:
        fn = COMPOSITES.get(op)
        return self.mpx().autocast_op(op)(fn) if fn is not None and mode == "mpx" else fn

    def functions(
        self, op: str, dtype: str, other: str | None = None, upcast: bool = False, mode: str = "mpx"
    ):
        """``(fn, args)``: the canonical op as a ``keras.ops`` / ``keras.losses`` call on inputs of ``dtype``
        (``upcast``: those inputs cast to float32); under mpx the composites are declared with ``autocast_op``.

        Each function is looked up when ``fn`` is called (``lambda a: ops.exp(a)``, not ``ops.exp``): the op
        table's dispatch is installed while a policy needs it, so a function taken before the scope is
        the original (as in user code that binds ``exp = keras.ops.exp`` at import)."""

        def t(shape, dt=dtype, seed=0, positive=False):
            x = self._x(shape, dt, seed, positive)
            return ops.cast(x, "float32") if upcast else x

        x, y, w = t((4, 8)), t((4, 8), other or dtype, seed=1), t((6, 8), seed=2)
        img = t((1, 6, 6, 2))
        labels = ops.convert_to_tensor(np.array([0, 1, 2, 3], np.int32))
        target = ops.sigmoid(self._x((4, 8), other or dtype, seed=1))  # probabilities, at the input dtype
        target = ops.cast(target, "float32") if upcast else target
        qkv = [t((1, 4, 2, 8), seed=s) for s in (6, 7, 8)]
        composite = self.composite(op, mode)
        table = {
            "matmul": (lambda a, b: ops.matmul(a, b), (x, t((8, 3), seed=3))),
            "linear": (lambda a, b: ops.matmul(a, ops.transpose(b)), (x, w)),
            "conv": (lambda a, k: ops.conv(a, k, 1, "valid"), (img, t((3, 3, 2, 3), seed=4))),
            "conv_transpose": (lambda a, k: ops.conv_transpose(a, k, 1, "valid"), (img, t((3, 3, 3, 2), seed=4))),
            "bmm": (lambda a, b: ops.matmul(a, b), (t((2, 4, 8)), t((2, 8, 3), seed=5))),
            "einsum": (lambda a, b: ops.einsum("ij,kj->ik", a, b), (x, w)),
            "attention": (lambda q, k, v: ops.dot_product_attention(q, k, v), tuple(qkv)),
            "softmax": (lambda a: ops.softmax(a, axis=-1), (x,)),
            "log_softmax": (lambda a: ops.log_softmax(a, axis=-1), (x,)),
            "layer_norm": (lambda a: ops.layer_normalization(a, epsilon=1e-5), (x,)),
            "batch_norm": (_batch_norm, (x,)),
            "group_norm": (composite, (img,)),
            "rms_norm": (lambda a: ops.rms_normalization(a, epsilon=1e-6), (x,)),
            "cross_entropy": (lambda a: keras.losses.sparse_categorical_crossentropy(labels, a, from_logits=True), (x,)),
            "nll_loss": (lambda a: composite(a, labels), (x,)),
            "mse_loss": (lambda a, b: keras.losses.mean_squared_error(b, a), (x, y)),
            "bce_with_logits": (lambda a, b: ops.binary_crossentropy(b, a, from_logits=True), (x, target)),
            "exp": (lambda a: ops.exp(a), (x,)),
            "log": (lambda a: ops.log(a), (t((4, 8), positive=True),)),
            "pow": (lambda a: ops.power(a, 2.5), (ops.abs(x),)),
            "sum": (lambda a: ops.sum(a), (x,)),
            "mean": (lambda a: ops.mean(a), (x,)),
            "cumsum": (lambda a: ops.cumsum(a, axis=0), (x,)),
            "prod": (lambda a: ops.prod(a), (x,)),
            "logsumexp": (lambda a: ops.logsumexp(a, axis=-1), (x,)),
            "vector_norm": (lambda a: ops.norm(a), (x,)),
            "add": (lambda a, b: ops.add(a, b), (x, y)),
            "mul": (lambda a, b: ops.multiply(a, b), (x, y)),
            "cat": (lambda a, b: ops.concatenate([a, b], 0), (x, y)),
            "stack": (lambda a, b: ops.stack([a, b]), (x, y)),
            "where": (lambda a, b: ops.where(a > 0, a, b), (x, y)),
            "relu": (lambda a: ops.relu(a), (x,)),
            "gelu": (lambda a: ops.gelu(a), (x,)),
            "max_pool": (lambda a: ops.max_pool(a, 2, 2, "valid"), (img,)),
            "reshape": (lambda a: ops.reshape(a, (8, 4)), (x,)),
            "transpose": (lambda a: ops.transpose(a), (x,)),
            "dropout": (lambda a: keras.random.dropout(a, 0.5, seed=0), (x,)),
            "embedding": (lambda table: ops.take(table, ops.convert_to_tensor(np.array([0, 2, 1], np.int32)), axis=0),
                          (w,)),
        }  # fmt: skip
        return table[op]

    def _run_layer(self, p: dict, mode: str, upcast: bool = False) -> Any:
        """The op's layer under ``p["policy"]`` (natively or through mpx) on inputs of ``p["dtype"]``; with
        ``upcast``, a float32 layer on those inputs cast to float32 (the reference of ``run_op_value``)."""
        op = p["op"]
        make, shape, n = LAYERS[op]
        dtypes = [p["dtype"], p.get("other") or p["dtype"]][:n]
        inputs = [self._x((4, *shape), d, seed=i) for i, d in enumerate(dtypes)]
        layer = make()
        if upcast:
            layer.dtype_policy = keras.DTypePolicy("float32")
            inputs = [ops.cast(x, "float32") for x in inputs]
        elif mode == "native":
            layer.dtype_policy = keras.DTypePolicy(keras_policy(p))
        else:
            model = keras.Sequential([layer]) if n == 1 else None
            if model is None:
                ins = [keras.Input(shape) for _ in range(n)]
                model = keras.Model(ins, layer(*ins) if op == "attention" else layer(ins))
            self.mpx().apply_policy(model, p["policy"])
        return _call(layer, op, inputs)

    def _run_function(self, p: dict, mode: str, upcast: bool = False) -> Any:
        fn, args = self.functions(p["op"], p["dtype"], p.get("other"), upcast=upcast, mode=mode)
        if mode == "native" or upcast:
            return fn(*args)
        with self.mpx().autocast(p["policy"]):
            return fn(*args)

    def _run(self, p: dict, mode: str, upcast: bool = False) -> Any:
        """Ops a Keras layer computes run as that layer (natively under Keras's policy, under mpx after
        ``apply_policy``); the others as functions (under mpx inside ``autocast``)."""
        if p["op"] in LAYERS:
            return self._run_layer(p, mode, upcast)
        return self._run_function(p, mode, upcast)

    def run_op(self, p: dict, mode: str) -> dict:
        return {"dtype": dtype_name(keras.backend.standardize_dtype(self._run(p, mode).dtype))}

    def run_op_value(self, p: dict, mode: str) -> dict:
        out = self._run(p, mode)
        ref = self._run(p, mode, upcast=True)
        return {"max_rel_error": rel_error(_numpy(ops.cast(out, "float32")), _numpy(ref))}

    # -- policies and numerics ----------------------------------------------------------------------
    def _build_under(self, spec: str, mode: str, build: Callable[[], keras.Model]) -> keras.Model:
        if mode == "native":
            prior = keras.mixed_precision.dtype_policy()
            keras.mixed_precision.set_dtype_policy(spec)  # Keras names only
            try:
                return build()
            finally:
                keras.mixed_precision.set_dtype_policy(prior)
        with self.mpx().policy_scope(spec):
            model = build()
        return self.mpx().apply_policy(model, spec)

    def run_policy(self, p: dict, mode: str) -> dict:
        x = np.ones((2, 4), np.float32)

        def build() -> keras.Model:
            inp = keras.Input((4,))
            return keras.Model(inp, L.Dense(3, name="dense")(inp))

        model = self._build_under(p["spec"], mode, build)
        dense = model.get_layer("dense")
        return {
            "params": dtype_name(keras.backend.standardize_dtype(dense.kernel.dtype)),
            "compute": dtype_name(keras.backend.standardize_dtype(dense(x).dtype)),
            "output": dtype_name(keras.backend.standardize_dtype(model(x).dtype)),
        }

    def run_numerics(self, p: dict, mode: str) -> dict:
        d = mlp_data(p["seed"])

        def build() -> keras.Model:
            inp = keras.Input((8,))
            h = L.Dense(32, activation="tanh", name="fc1")(inp)
            return keras.Model(inp, L.Dense(4, name="fc2")(h))

        model = self._build_under(p["policy"], mode, build)
        fc1, fc2 = model.get_layer("fc1"), model.get_layer("fc2")
        for var, key in ((fc1.kernel, "w1"), (fc1.bias, "b1"), (fc2.kernel, "w2"), (fc2.bias, "b2")):
            var.assign(d[key])
        variables = [fc1.kernel, fc1.bias, fc2.kernel, fc2.bias]
        x, y = ops.convert_to_tensor(d["x"]), ops.convert_to_tensor(d["y"])

        def loss_fn() -> Any:
            return ops.mean(ops.square(ops.cast(model(x), "float32") - y))

        loss, grads = self.value_and_grad(loss_fn, variables)
        got = {
            "loss": _numpy(loss),
            **{k: _numpy(g) for k, g in zip(("w1", "b1", "w2", "b2"), grads, strict=True)},
        }
        loss_dtype = dtype_name(keras.backend.standardize_dtype(loss.dtype))
        return {"max_rel_error": max_rel_error(got, mlp_reference(d)), "loss_dtype": loss_dtype}

    # -- loss scaling -------------------------------------------------------------------------------
    def optimizer(self, mode: str, config: dict, inner: keras.optimizers.Optimizer) -> Any:
        """The loss-scale optimizer over ``inner``: Keras's natively (its fixed factors), else mpx's."""
        if mode == "native":
            if config["kind"] != "dynamic":
                raise Skip(f"Keras LossScaleOptimizer has no {config['kind']!r} mode")
            if config["growth_factor"] != 2.0 or config["backoff_factor"] != 0.5:
                raise Skip("Keras LossScaleOptimizer's factors are fixed at 2 and 0.5")
            return keras.optimizers.LossScaleOptimizer(
                inner, initial_scale=config["init_scale"], dynamic_growth_steps=config["growth_interval"]
            )
        return self.mpx().LossScaleOptimizer(inner, config)

    @staticmethod
    def current_scale(opt: Any) -> float:
        if hasattr(opt, "get_scale"):  # mpx's scaler surface
            return opt.get_scale()
        return float(_numpy(opt.dynamic_scale.value)) if opt.built else float(opt.initial_scale)

    def train_flags(self, opt: Any, flags: list[bool]) -> tuple[list[float], int]:
        """One step per flag on a 3-vector (gradient: the current scale, times inf for a False flag)."""
        var = keras.Variable(np.ones(3, np.float32))
        scales, skipped = [], 0
        for finite in flags:
            before = var.numpy().copy()
            grad = ops.full((3,), self.current_scale(opt) * flag_gradient(finite), "float32")
            self.apply(opt, [grad], [var])
            scales.append(self.current_scale(opt))
            skipped += bool(np.array_equal(before, var.numpy()))
        return scales, skipped

    def run_scaler_trace(self, p: dict, mode: str) -> dict:
        if mode == "native" and p.get("native_defaults"):
            opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        else:
            opt = self.optimizer(mode, p["config"], keras.optimizers.SGD(0.1))
        scales, skipped = self.train_flags(opt, p["flags"])
        return {"scales": scales, "skipped": skipped}

    def run_stuck(self, p: dict, mode: str) -> dict:
        """Issue 18's stuck detection in an eager custom step (``scale_loss``, gradients, ``apply``): the
        step that raises ``mpx.ScalerStuckError`` and the cause it names."""
        if mode == "native":
            raise Skip("keras.optimizers.LossScaleOptimizer has no stuck detection")
        from conformance.cases import stuck_cause  # (imports mpx: the mpx path only)

        w = keras.Variable(np.ones(3, np.float32), name="w")
        opt = self.optimizer(mode, p["config"], keras.optimizers.SGD(0.1))
        opt.build([w])
        losses = {
            "ok": lambda: ops.sum(w),
            "grad": lambda: ops.sum(ops.sqrt(w - ops.stop_gradient(w))),  # finite loss, inf gradients
            "loss": lambda: ops.sum(w * np.float32(np.inf)),
        }
        for i, kind in enumerate(p["steps"], 1):
            opt.scale_loss(losses[kind]())  # eagerly: the stuck check tells a non-finite loss apart
            _, grads = self.value_and_grad(lambda k=kind: opt.scale_loss(losses[k]()), [w])
            try:
                opt.apply(grads, [w])
            except importlib.import_module("mpx").ScalerStuckError as err:
                return {"raised_at": i, "cause": stuck_cause(str(err))}
        return {"raised_at": None, "cause": None}

    def run_skip(self, p: dict, mode: str) -> dict:
        inner = (
            keras.optimizers.Adam(1e-2)
            if p["optimizer"] == "adam"
            else keras.optimizers.SGD(1e-2, momentum=0.9)
        )
        opt = self.optimizer(mode, p["config"], inner)
        model = keras.Sequential(
            [keras.Input((4,)), L.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(0))]
        )
        x = ops.convert_to_tensor(op_input((8, 4)))
        opt.build(model.trainable_variables)
        changed, scales = [], []

        def snapshot() -> list[bytes]:
            return [_numpy(v.value).tobytes() for v in model.trainable_variables + list(inner.variables)]

        for step in p["steps"]:
            before = snapshot()
            factor = flag_gradient(step == "ok", step)
            _, grads = self.value_and_grad(
                lambda f=factor: opt.scale_loss(ops.sum(model(x)) * f), model.trainable_variables
            )
            self.apply(opt, grads, model.trainable_variables)
            scales.append(self.current_scale(opt))
            changed.append(snapshot() != before)
        return {"changed": changed, "scale_halved": scales[1] == scales[0] / 2}

    def run_accumulation(self, p: dict, mode: str) -> dict:
        """The inner optimizer's ``gradient_accumulation_steps=k`` under the loss-scale optimizer, one
        step per micro-batch (what ``model.fit`` does)."""
        k = p["steps"]
        inner = keras.optimizers.SGD(p["lr"], gradient_accumulation_steps=k)
        opt = self.optimizer(mode, p["config"], inner)
        var = keras.Variable(np.full(3, p["w0"], np.float32))
        applied, scales, micro = [], [], []
        start = var.numpy().copy()
        for j, finite in enumerate(p["flags"]):
            scale = self.current_scale(opt)
            micro.append(scale)
            grad = ops.full((3,), scale * (j % 4 + 1) * flag_gradient(finite), "float32")
            self.apply(opt, [grad], [var])
            if (j + 1) % k == 0:
                applied.append(not np.array_equal(var.numpy(), start))
                scales.append(self.current_scale(opt))
                start = var.numpy().copy()
        return {"applied": applied, "scales": scales, "micro_scales": micro, "param": float(var.numpy()[0])}

    # -- portability --------------------------------------------------------------------------------
    def save_state(self, config: dict, flags: list[bool]) -> dict:
        """The ``mpx.scaler/1`` state mpx's scaler saves after ``flags`` (``config``: ScalerConfig fields)."""
        config = importlib.import_module("mpx").ScalerConfig(**config)
        opt = self.mpx().LossScaleOptimizer(keras.optimizers.SGD(0.1), config)
        self.train_flags(opt, flags)
        return opt.state_dict()

    def run_portability_save(self, p: dict, mode: str) -> dict:
        opt = self.optimizer(mode, p["config"], keras.optimizers.SGD(0.1))
        self.train_flags(opt, p["flags"])
        if mode == "mpx":
            return {"state_dict": opt.state_dict()}
        names = ("dynamic_scale", "step_counter")  # Keras's own state: two variables
        return {"state_dict": {v.path: _numpy(v.value).item() for v in opt.variables
                               if v.path.split("/")[-1] in names}}  # fmt: skip

    def run_portability(self, p: dict, mode: str) -> dict:
        if mode == "native":
            raise Skip("Keras's LossScaleOptimizer has no state-dict API; its scale lives in Keras variables")
        opt = self.mpx().LossScaleOptimizer(keras.optimizers.SGD(0.1), p["config"])
        opt.load_state_dict(p["state_dict"])
        scales, _ = self.train_flags(opt, p["flags"])
        return {"scales": scales}

    def run_distributed(self, p: dict, mode: str) -> dict:
        """keras.distribution over 4 host devices on JAX (conformance.distributed.keras_jax); on another
        backend Keras has no engine: natively that is the observation (a finding), under mpx a skip."""
        backend = keras.backend.backend()
        if backend == "jax":
            from conformance import distributed

            return distributed.observed(self.name, p, mode)
        why = no_engine(backend)
        if mode == "native":
            return {"consistent": False, "no_engine": why, "engine": None}
        raise Skip(f"mpx_keras adds no engine of its own, so there is nothing to run under mpx: {why}")


    def run_models(self, p: dict, mode: str) -> dict:
        """keras-hub backbones from tiny constructor arguments, Keras's policies against mpx's
        (:mod:`mpx_tools.models.keras`)."""
        from mpx_tools.models import keras as models

        return models.observe(p, mode, self)


def no_engine(backend: str) -> str:
    """Why Keras 3 on ``backend`` (not jax) has no engine for the distributed cases, read from the install:
    which backends ``keras.distribution`` has an implementation for."""
    import importlib.util

    have = [b for b in ("jax", "tensorflow", "torch")
            if importlib.util.find_spec(f"keras.src.backend.{b}.distribution_lib") is not None]  # fmt: skip
    return (f"Keras {keras.__version__} on {backend} has no replica or sharding engine: keras.distribution is "
            f"implemented for {', '.join(have) or 'no backend'} only (keras/src/backend/*/distribution_lib.py)")  # fmt: skip


def export(adapter: KerasAdapter, namespace: dict) -> None:
    """Bind ``adapter``'s ``info``, ``save_state`` and ``run_*`` methods into ``namespace`` (a module's globals)."""
    for attr in dir(adapter):
        if attr.startswith("run_") or attr in ("info", "save_state"):
            namespace[attr] = getattr(adapter, attr)
    namespace["ADAPTER"] = adapter
