"""The ``fp8`` group on Keras 3 / TensorFlow: under mpx ``mpx_keras.float8`` (quantize, Float8Dense through
``apply_policy``), natively Keras's own float8 (``keras.quantizers.quantize_and_dequantize``, a Dense in
``quantize("float8")`` mode with a ``QuantizedFloat8DTypePolicy``).

Keras keeps the *inverse* scale (``x / scale``) and quantizes in the compute dtype: a native run is given
``float32(1 / scale)`` and reports ``float32(1 / stored)``.  Its FP8 variables are
``overwrite_with_gradient`` variables the optimizer writes; a step the loss scaler skips writes none
(what Keras's LossScaleOptimizer does on a non-finite step), for mpx's Float8Dense as for Keras's Dense.

No mpx import at module level: the native paths import nothing of mpx (:mod:`conformance.fp8` is mpx-free).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

from conformance.adapters._common import Skip
from conformance.fp8 import (
    FP8_DTYPES,
    bits_to_f32,
    encode_fp8,
    f32_to_bits,
    matmul_inputs,
    quantize_inputs,
    require_native_recipe,
    trace_input,
    within_bound,
)

KERAS_FP8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
VAR = {"input": "inputs", "weight": "kernel", "grad": "outputs_grad"}


def _float8():
    try:
        from mpx_keras import float8
    except ModuleNotFoundError as err:
        if err.name != "mpx_keras.float8":
            raise
        raise Skip("mpx_keras.float8 is not there yet (issue 26's Keras part)") from None
    return float8


def run_fp8_quantize(p: dict, mode: str) -> dict:
    """The quantized bytes (mpx: ``mpx_keras.float8.quantize``; native: Keras's ``quantize_and_dequantize``
    with the inverse scale in the input's dtype, the bytes read back as ``fp8(dequantized / inverse)``,
    exact while the dequantized value is a normal number)."""
    x_np = quantize_inputs(p["kind"], p["seed"], p["n"], p["dtype"])
    x = tf.constant(x_np, dtype=p["dtype"])
    if mode == "mpx":
        q = _float8().quantize(x, p["scale"], p["fmt"])
        raw = np.asarray(keras.ops.convert_to_numpy(q)).astype(FP8_DTYPES[p["fmt"]])
        return {"bytes": encode_fp8(raw, p["fmt"])}
    inverse = np.float32(1.0) / np.float32(p["scale"])
    deq = keras.quantizers.quantize_and_dequantize(x, tf.constant(inverse), KERAS_FP8[p["fmt"]], p["dtype"])
    used = (
        np.float32(ml_dtypes.bfloat16(inverse)) if p["dtype"] == "bfloat16" else inverse
    )  # the compute dtype's
    with np.errstate(over="ignore", invalid="ignore"):
        raw = (np.asarray(deq, np.float32) / used).astype(FP8_DTYPES[p["fmt"]])
    return {"bytes": encode_fp8(raw, p["fmt"])}


def _native_recipe_ok(recipe: dict) -> None:
    require_native_recipe(recipe, "Keras's float8 Dense")


def _keras_dense(units: int, in_dim: int, history: int) -> keras.layers.Dense:
    policy = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=history)
    layer = keras.layers.Dense(units, use_bias=False, dtype=policy)
    layer.build((None, in_dim))
    return layer


def _trace(p: dict, layer: keras.layers.Layer, variables: list, scale_of) -> list[int]:
    grad_role = p["role"] == "grad"
    opt = keras.optimizers.SGD(learning_rate=0.0)
    opt.build(variables)
    ones = tf.ones((2, 4), tf.float32)
    scales = []

    @tf.function  # as fit runs it (Keras's float8 Dense cannot take an eager tape's gradient on TF)
    def gradients(x: tf.Tensor, g: tf.Tensor) -> list:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, training=True) * g)
        return tape.gradient(loss, variables)

    for bits, skipped in zip(p["amaxes"], p["skipped"], strict=True):
        amax = tf.constant(trace_input(float(bits_to_f32([bits])[0])))
        grads = gradients(ones, amax) if grad_role else gradients(amax, ones)
        if not skipped:  # a skipped step writes no variable (the loss scaler's skip)
            opt.apply(grads, variables)
        scales.append(scale_of())
    return f32_to_bits(scales)


def run_fp8_trace(p: dict, mode: str) -> dict:
    """The scale each step leaves for the next (mpx: a Float8Dense's state, ``float8_state_dict``; native: Keras's
    float8 Dense's stored inverse ``<role>_scale``, as ``1 / stored``), the FP8 variables written by an
    optimizer on every step the loss scaler does not skip."""
    if mode == "mpx":
        import mpx_keras

        _float8()
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, use_bias=False, name="fc")])
        model = mpx_keras.apply_policy(model, p["policy"])
        layer = model.layers[0]
        variables = [v for _, _, v in layer.fp8_variables()]
        float8 = _float8()

        def scale() -> np.float32:  # the state float8_update gives, read through the public state dict
            tensors = float8.float8_state_dict(model)["tensors"].values()
            return np.float32(next(t["scale"] for t in tensors if t["role"] == p["role"]))

        return {"scales": _trace(p, layer, variables, scale)}
    _native_recipe_ok(p["recipe"])
    layer = _keras_dense(4, 4, p["recipe"]["amax_history_len"])
    variables = [v for v in layer.trainable_variables if "scale" in v.name or "amax_history" in v.name]
    var = getattr(layer, f"{VAR[p['role']]}_scale")
    return {"scales": _trace(p, layer, variables, lambda: np.float32(1.0) / np.float32(var.numpy()))}


def run_fp8_matmul(p: dict, mode: str) -> dict:
    """``a @ b`` in FP8 (mpx: a Float8Dense under the case's current-scaling policy; native: Keras's float8
    Dense with its stored inverse scales set to ``1 / scale`` of the case, as a loaded checkpoint's)."""
    a, b = matmul_inputs(p["seed"], p["m"], p["k"], p["n"], p["bad"])
    if mode == "mpx":
        import mpx_keras

        _float8()
        model = keras.Sequential(
            [keras.Input((p["k"],)), keras.layers.Dense(p["n"], use_bias=False, name="fc")]
        )
        model = mpx_keras.apply_policy(model, p["policy"])
        model.layers[0].kernel.assign(b)
        out = model(tf.constant(a), training=False)
    else:
        layer = _keras_dense(p["n"], p["k"], 16)
        layer._kernel.assign(b)
        layer.inputs_scale.assign(np.float32(1.0) / np.float32(p["scales"][0]))
        layer.kernel_scale.assign(np.float32(1.0) / np.float32(p["scales"][1]))
        out = layer(tf.constant(a), training=False)
    return within_bound(np.asarray(out, np.float32), p["reference"], p["bound"])
