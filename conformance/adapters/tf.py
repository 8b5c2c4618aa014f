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
    if op not in LAYERS:
        raise Skip(f"no Keras layer computes {op!r}: Keras chooses dtypes per layer, not per op")
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


def run_op(p: dict, mode: str) -> dict:
    return {"dtype": dtype_name(_run_layer(p, mode).dtype)}


def run_op_value(p: dict, mode: str) -> dict:
    out = _run_layer(p, mode)
    ref = _run_layer(p, mode, upcast=True)
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
    if hasattr(opt, "state_dict"):
        return float(opt.state_dict()["scale"])
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
