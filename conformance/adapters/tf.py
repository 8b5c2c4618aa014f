"""The Keras 3 / TensorFlow adapter: natively Keras dtype policies + LossScaleOptimizer, under mpx mpx_tf."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import mpx
from conformance.adapters._common import (
    Skip,
    dtype_name,
    flag_gradient,
    max_rel_error,
    mlp_data,
    mlp_reference,
    op_input,
    rel_error,
)

L = keras.layers


def info() -> dict:
    return {"version": f"tensorflow {tf.__version__}, keras {keras.__version__}", "device": "cpu"}


def _mpx_tf():
    import mpx_tf

    return mpx_tf


def _x(shape, dtype, seed=0):
    return tf.constant(op_input(shape, seed), dtype=dtype)


# op -> (layer factory, input shape (without batch), number of inputs)
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


def _keras_policy(spec: str) -> str:
    """The Keras policy name a native run uses for an mpx spec (Keras has no keep_fp32 or overrides)."""
    policy = mpx.get_policy(spec)
    if policy.lowers_precision and policy.param_dtype == "float32":
        return f"mixed_{policy.compute_dtype}"
    return policy.compute_dtype


def _call(layer: Any, op: str, inputs: list) -> Any:
    if op == "attention":
        return layer(inputs[0], inputs[1])
    if len(inputs) == 2:
        return layer(inputs)
    if op in ("dropout", "batch_norm"):
        return layer(inputs[0], training=True)
    return layer(inputs[0])


def _run_layer(p: dict, mode: str, upcast: bool = False) -> Any:
    """The op's layer under ``p["policy"]`` (natively or through mpx) on inputs of ``p["dtype"]``; with
    ``upcast``, a float32 layer on those inputs cast to float32 (the reference of ``run_op_value``)."""
    op = p["op"]
    make, shape, n = LAYERS[op]
    dtypes = [p["dtype"], p.get("other") or p["dtype"]][:n]
    inputs = [_x((4, *shape), d, seed=i) for i, d in enumerate(dtypes)]
    layer = make()
    if upcast:
        layer.dtype_policy = keras.DTypePolicy("float32")
        inputs = [tf.cast(x, tf.float32) for x in inputs]
    elif mode == "native":
        layer.dtype_policy = keras.DTypePolicy(_keras_policy(p["policy"]))
    else:
        model = keras.Sequential([layer]) if n == 1 else None
        if model is None:
            ins = [keras.Input(shape) for _ in range(n)]
            model = keras.Model(ins, layer(*ins) if op == "attention" else layer(ins))
        _mpx_tf().apply_policy(model, p["policy"])
    return _call(layer, op, inputs)


def _group_norm(a: Any) -> Any:
    g = keras.ops.reshape(a, (1, 6, 6, 2, 1))
    mean, var = keras.ops.moments(g, axes=(1, 2, 4), keepdims=True)
    return keras.ops.reshape((g - mean) * keras.ops.rsqrt(var + 1e-5), keras.ops.shape(a))


def _nll(a: Any, target: Any) -> Any:
    return -keras.ops.mean(keras.ops.take_along_axis(a, target[:, None], axis=-1))


def _batch_norm(a: Any) -> Any:
    mean, var = keras.ops.moments(a, axes=(0,))
    return keras.ops.batch_normalization(a, mean, var, axis=-1, epsilon=1e-5)


#: ops TensorFlow and Keras have no function for, written by hand: under mpx they are declared with
#: mpx_tf.autocast_op (what a user does for such a function)
COMPOSITES = {"group_norm": _group_norm, "nll_loss": _nll}


def functions(op: str, dtype: str, other: str | None = None, upcast: bool = False, mode: str = "mpx"):
    """``(fn, args)``: the canonical op as a ``keras.ops`` / ``keras.losses`` / ``tf`` function call on
    inputs of ``dtype`` (``upcast``: those inputs cast to float32).  ``mode="mpx"`` declares the
    composites with :func:`mpx_tf.autocast_op`."""
    if mode == "mpx":
        _mpx_tf()  # (its op table dispatches keras.ops/tf functions looked up at call time, inside a scope)

    def t(shape, dt=dtype, seed=0, positive=False):
        x = _x(shape, dt, seed) if not positive else tf.constant(op_input(shape, seed, True), dtype=dt)
        return tf.cast(x, tf.float32) if upcast else x

    x, y, w = t((4, 8)), t((4, 8), other or dtype, seed=1), t((6, 8), seed=2)
    img = t((1, 6, 6, 2))
    labels = tf.constant([0, 1, 2, 3])
    target = tf.sigmoid(_x((4, 8), other or dtype, seed=1))  # probabilities, at the input dtype
    target = tf.cast(target, tf.float32) if upcast else target
    qkv = [t((1, 4, 2, 8), seed=s) for s in (6, 7, 8)]
    composite = COMPOSITES.get(op)
    if composite is not None and mode == "mpx":
        composite = _mpx_tf().autocast_op(op)(composite)
    table = {
        "matmul": (lambda a, b: keras.ops.matmul(a, b), (x, t((8, 3), seed=3))),
        "linear": (lambda a, b: tf.matmul(a, b, transpose_b=True), (x, w)),
        "conv": (lambda a, k: tf.nn.conv2d(a, k, 1, "VALID"), (img, t((3, 3, 2, 3), seed=4))),
        "conv_transpose": (lambda a, k: keras.ops.conv_transpose(a, k, 1, "valid"), (img, t((3, 3, 3, 2), seed=4))),
        "bmm": (lambda a, b: tf.linalg.matmul(a, b), (t((2, 4, 8)), t((2, 8, 3), seed=5))),
        "einsum": (lambda a, b: keras.ops.einsum("ij,kj->ik", a, b), (x, w)),
        "attention": (lambda q, k, v: keras.ops.dot_product_attention(q, k, v), tuple(qkv)),
        "softmax": (lambda a: keras.ops.softmax(a, axis=-1), (x,)),
        "log_softmax": (lambda a: tf.nn.log_softmax(a, axis=-1), (x,)),
        "layer_norm": (lambda a: keras.ops.layer_normalization(a, epsilon=1e-5), (x,)),
        "batch_norm": (_batch_norm, (x,)),
        "group_norm": (composite, (img,)),
        "rms_norm": (lambda a: keras.ops.rms_normalization(a, epsilon=1e-6), (x,)),
        "cross_entropy": (lambda a: keras.losses.sparse_categorical_crossentropy(labels, a, from_logits=True), (x,)),
        "nll_loss": (lambda a: composite(a, labels), (x,)),
        "mse_loss": (lambda a, b: keras.losses.mean_squared_error(b, a), (x, y)),
        "bce_with_logits": (lambda a, b: tf.nn.sigmoid_cross_entropy_with_logits(labels=b, logits=a), (x, target)),
        "exp": (lambda a: tf.exp(a), (x,)),
        "log": (lambda a: keras.ops.log(a), (t((4, 8), positive=True),)),
        "pow": (lambda a: tf.pow(a, 2.5), (tf.abs(x),)),
        "sum": (lambda a: tf.reduce_sum(a), (x,)),
        "mean": (lambda a: keras.ops.mean(a), (x,)),
        "cumsum": (lambda a: tf.cumsum(a, axis=0), (x,)),
        "prod": (lambda a: keras.ops.prod(a), (x,)),
        "logsumexp": (lambda a: tf.reduce_logsumexp(a, axis=-1), (x,)),
        "vector_norm": (lambda a: keras.ops.norm(a), (x,)),
        "add": (lambda a, b: tf.add(a, b), (x, y)),
        "mul": (lambda a, b: keras.ops.multiply(a, b), (x, y)),
        "cat": (lambda a, b: tf.concat([a, b], 0), (x, y)),
        "stack": (lambda a, b: keras.ops.stack([a, b]), (x, y)),
        "where": (lambda a, b: tf.where(a > 0, a, b), (x, y)),
        "relu": (tf.nn.relu, (x,)),
        "gelu": (keras.ops.gelu, (x,)),
        "max_pool": (lambda a: tf.nn.max_pool2d(a, 2, 2, "VALID"), (img,)),
        "reshape": (lambda a: tf.reshape(a, (8, 4)), (x,)),
        "transpose": (keras.ops.transpose, (x,)),
        "dropout": (lambda a: tf.nn.dropout(a, 0.5, seed=0), (x,)),
        "embedding": (lambda table: keras.ops.take(table, tf.constant([0, 2, 1]), axis=0), (w,)),
    }  # fmt: skip
    return table[op]


def _run_function(p: dict, mode: str, upcast: bool = False) -> Any:
    fn, args = functions(p["op"], p["dtype"], p.get("other"), upcast=upcast, mode=mode)
    if mode == "native" or upcast:
        return fn(*args)
    with _mpx_tf().autocast(p["policy"]):
        return fn(*args)


def _run(p: dict, mode: str, upcast: bool = False) -> Any:
    """Ops a Keras layer computes run as that layer (natively under Keras's policy, under mpx after
    ``apply_policy``); the others as ``keras.ops``/``tf`` functions (under mpx in ``mpx_tf.autocast``)."""
    if p["op"] in LAYERS:
        return _run_layer(p, mode, upcast)
    return _run_function(p, mode, upcast)


def run_op(p: dict, mode: str) -> dict:
    return {"dtype": dtype_name(_run(p, mode).dtype)}


def run_op_value(p: dict, mode: str) -> dict:
    out = _run(p, mode)
    ref = _run(p, mode, upcast=True)
    return {"max_rel_error": rel_error(np.asarray(out, np.float64), np.asarray(ref, np.float64))}


def _dense_model() -> keras.Model:
    inp = keras.Input((4,))
    return keras.Model(inp, L.Dense(3, name="dense")(inp))


def run_policy(p: dict, mode: str) -> dict:
    x = np.ones((2, 4), np.float32)
    if mode == "native":
        prior = keras.mixed_precision.dtype_policy()
        keras.mixed_precision.set_dtype_policy(p["spec"])  # Keras names only
        try:
            model = _dense_model()
        finally:
            keras.mixed_precision.set_dtype_policy(prior)
    else:
        with _mpx_tf().policy_scope(p["spec"]):
            model = _dense_model()
        _mpx_tf().apply_policy(model, p["spec"])
    dense = model.get_layer("dense")
    return {
        "params": dtype_name(dense.kernel.dtype),
        "compute": dtype_name(dense(x).dtype),
        "output": dtype_name(model(x).dtype),
    }


def _optimizer(mode: str, cfg: mpx.ScalerConfig, inner: keras.optimizers.Optimizer):
    if mode == "native":
        if cfg.kind != "dynamic":
            raise Skip(f"Keras LossScaleOptimizer has no {cfg.kind!r} mode")
        if cfg.growth_factor != 2.0 or cfg.backoff_factor != 0.5:
            raise Skip("Keras LossScaleOptimizer's factors are fixed at 2 and 0.5")
        return keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=cfg.init_scale, dynamic_growth_steps=cfg.growth_interval
        )
    return _mpx_tf().LossScaleOptimizer(inner, cfg)


def _current_scale(opt) -> float:
    if hasattr(opt, "get_scale"):  # mpx's scaler surface
        return opt.get_scale()
    return float(opt.dynamic_scale.numpy()) if opt.built else float(opt.initial_scale)


def _train_flags(opt, flags: list[bool]) -> tuple[list[float], int]:
    var = keras.Variable(np.ones(3, np.float32))
    scales, skipped = [], 0
    for finite in flags:
        before = var.numpy().copy()
        scale = _current_scale(opt)
        grad = tf.fill((3,), tf.constant(scale * flag_gradient(finite), tf.float32))
        opt.apply([grad], [var])
        scales.append(_current_scale(opt))
        skipped += bool(np.array_equal(before, var.numpy()))
    return scales, skipped


def run_scaler_trace(p: dict, mode: str) -> dict:
    cfg = mpx.ScalerConfig.from_dict(p["config"])
    if mode == "native" and p.get("native_defaults"):
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    else:
        opt = _optimizer(mode, cfg, keras.optimizers.SGD(0.1))
    scales, skipped = _train_flags(opt, p["flags"])
    return {"scales": scales, "skipped": skipped}


def run_stuck(p: dict, mode: str) -> dict:
    """Issue 18's stuck detection, in a traced step: the step that raises and the cause it names."""
    from conformance.cases import stuck_cause

    if mode == "native":
        raise Skip("keras.optimizers.LossScaleOptimizer has no stuck detection")
    w = keras.Variable(np.ones(3, np.float32), name="w")
    opt = _optimizer(mode, mpx.ScalerConfig.from_dict(p["config"]), keras.optimizers.SGD(0.1))
    opt.build([w])

    @tf.function
    def step(kind):
        with tf.GradientTape() as tape:
            plain = tf.reduce_sum(w * tf.where(kind == 2, np.float32(np.inf), np.float32(1.0)))
            loss = tf.cond(kind == 1, lambda: tf.reduce_sum(tf.sqrt(w - tf.stop_gradient(w))), lambda: plain)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, [w]), [w])

    for i, kind in enumerate(p["steps"], 1):
        try:
            step(tf.constant({"ok": 0, "grad": 1, "loss": 2}[kind]))
        except tf.errors.InvalidArgumentError as e:  # the ScalerStuckError, re-raised by TensorFlow
            if "ScalerStuckError" not in str(e):
                raise
            return {"raised_at": i, "cause": stuck_cause(str(e))}
    return {"raised_at": None, "cause": None}


def run_skip(p: dict, mode: str) -> dict:
    inner = (
        keras.optimizers.Adam(1e-2) if p["optimizer"] == "adam" else keras.optimizers.SGD(1e-2, momentum=0.9)
    )
    opt = _optimizer(mode, mpx.ScalerConfig(), inner)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(2)])
    x = tf.constant(op_input((8, 4)))
    changed, scales = [], []

    def snapshot():
        return [v.numpy().tobytes() for v in model.trainable_variables + list(inner.variables)]

    for step in p["steps"]:
        before = snapshot()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x)) * flag_gradient(step == "ok", step)
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        scales.append(_current_scale(opt))
        changed.append(snapshot() != before)
    return {"changed": changed, "scale_halved": scales[1] == scales[0] / 2}


def run_numerics(p: dict, mode: str) -> dict:
    d = mlp_data(p["seed"])
    spec = p["policy"]

    def build():
        inp = keras.Input((8,))
        h = L.Dense(32, activation="tanh", name="fc1")(inp)
        return keras.Model(inp, L.Dense(4, name="fc2")(h))

    if mode == "native":
        prior = keras.mixed_precision.dtype_policy()
        keras.mixed_precision.set_dtype_policy(spec)
        try:
            model = build()
        finally:
            keras.mixed_precision.set_dtype_policy(prior)
    else:
        with _mpx_tf().policy_scope(spec):
            model = build()
        _mpx_tf().apply_policy(model, spec)
    fc1, fc2 = model.get_layer("fc1"), model.get_layer("fc2")
    fc1.kernel.assign(d["w1"])
    fc1.bias.assign(d["b1"])
    fc2.kernel.assign(d["w2"])
    fc2.bias.assign(d["b2"])
    with tf.GradientTape() as tape:
        out = tf.cast(model(d["x"]), tf.float32)
        loss = tf.reduce_mean(tf.square(out - d["y"]))
    grads = tape.gradient(loss, [fc1.kernel, fc1.bias, fc2.kernel, fc2.bias])
    got = {
        "loss": loss.numpy(),
        **{k: g.numpy() for k, g in zip(("w1", "b1", "w2", "b2"), grads, strict=True)},
    }
    return {"max_rel_error": max_rel_error(got, mlp_reference(d)), "loss_dtype": dtype_name(loss.dtype)}


def save_state(config: dict, flags: list[bool]) -> dict:
    opt = _mpx_tf().LossScaleOptimizer(keras.optimizers.SGD(0.1), mpx.ScalerConfig(**config))
    _train_flags(opt, flags)
    return opt.state_dict()


def _native_state(opt) -> dict:
    return {
        v.path: v.numpy().item()
        for v in opt.variables
        if v.path.split("/")[-1] in ("dynamic_scale", "step_counter")
    }


def run_portability_save(p: dict, mode: str) -> dict:
    cfg = mpx.ScalerConfig.from_dict(p["config"])
    opt = _optimizer(mode, cfg, keras.optimizers.SGD(0.1))
    _train_flags(opt, p["flags"])
    return {"state_dict": opt.state_dict() if mode == "mpx" else _native_state(opt)}


def run_portability(p: dict, mode: str) -> dict:
    if mode == "native":
        raise Skip("Keras's LossScaleOptimizer has no state-dict API; its scale lives in Keras variables")
    opt = _mpx_tf().LossScaleOptimizer(keras.optimizers.SGD(0.1), mpx.ScalerConfig())
    opt.load_state_dict(p["state_dict"])
    scales, _ = _train_flags(opt, p["flags"])
    return {"scales": scales}


def run_distributed(p: dict, mode: str) -> dict:
    """MirroredStrategy on 2 logical CPUs, in a process of its own started once (conformance.distributed)."""
    from conformance import distributed

    return distributed.observed("tf", p, mode)


def run_accumulation(p: dict, mode: str) -> dict:
    """The inner optimizer's ``gradient_accumulation_steps=k`` under the loss-scale optimizer, one
    ``apply`` per micro-batch (what ``model.fit`` does)."""
    cfg, k = mpx.ScalerConfig.from_dict(p["config"]), p["steps"]
    opt = _optimizer(mode, cfg, keras.optimizers.SGD(p["lr"], gradient_accumulation_steps=k))
    var = keras.Variable(np.full(3, p["w0"], np.float32))
    applied, scales, micro = [], [], []
    start = var.numpy().copy()
    for j, finite in enumerate(p["flags"]):
        scale = _current_scale(opt)
        micro.append(scale)
        grad = tf.fill((3,), tf.constant(scale * (j % 4 + 1) * flag_gradient(finite), tf.float32))
        opt.apply([grad], [var])
        if (j + 1) % k == 0:
            applied.append(not np.array_equal(var.numpy(), start))
            scales.append(_current_scale(opt))
            start = var.numpy().copy()
    return {"applied": applied, "scales": scales, "micro_scales": micro, "param": float(var.numpy()[0])}
