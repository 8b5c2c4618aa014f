"""The ``fp8`` group on Keras 3 on any backend (the ``tf``, ``keras-jax`` and ``keras-torch`` columns): under
mpx ``mpx_keras.float8`` (quantize, Float8Dense through ``apply_policy``), natively Keras's own float8
(``keras.quantizers.quantize_and_dequantize``, a Dense with a ``QuantizedFloat8DTypePolicy``), with gradients
and optimizer steps taken as ``fit`` takes them (:class:`conformance.adapters.keras.KerasAdapter`'s ``apply``;
gradients jitted on jax and traced by ``tf.function`` on TensorFlow, as ``fit`` compiles them).

No mpx import at module level: the native paths import nothing of mpx (:mod:`conformance.fp8` is mpx-free).
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np

from conformance.adapters.keras import KerasAdapter
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

ops = keras.ops
KERAS_FP8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
VAR = {"input": "inputs", "weight": "kernel", "grad": "outputs_grad"}
_STEPS = KerasAdapter()  # value_and_grad and apply, per Keras backend


def _float8():
    from mpx_keras import float8

    return float8


def _numpy(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


def run_fp8_quantize(p: dict, mode: str) -> dict:
    """The quantized bytes (mpx: ``mpx_keras.float8.quantize``; native: ``quantize_and_dequantize`` with the
    inverse scale in the input's dtype, the bytes read back as ``fp8(dequantized / inverse)``)."""
    x = ops.cast(ops.convert_to_tensor(quantize_inputs(p["kind"], p["seed"], p["n"], p["dtype"])), p["dtype"])
    if mode == "mpx":
        raw = _numpy(ops.cast(_float8().quantize(x, p["scale"], p["fmt"]), "float32"))
        return {"bytes": encode_fp8(raw.astype(FP8_DTYPES[p["fmt"]]), p["fmt"])}
    inverse = np.float32(1.0) / np.float32(p["scale"])
    deq = keras.quantizers.quantize_and_dequantize(
        x, ops.convert_to_tensor(inverse), KERAS_FP8[p["fmt"]], p["dtype"]
    )
    used = np.float32(ml_dtypes.bfloat16(inverse)) if p["dtype"] == "bfloat16" else inverse
    with np.errstate(over="ignore", invalid="ignore"):
        raw = (_numpy(ops.cast(deq, "float32")) / used).astype(FP8_DTYPES[p["fmt"]])
    return {"bytes": encode_fp8(raw, p["fmt"])}


def _native_dense(units: int, in_dim: int, history: int) -> keras.layers.Dense:
    policy = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=history)
    layer = keras.layers.Dense(units, use_bias=False, dtype=policy)
    layer.build((None, in_dim))
    return layer


def _mpx_dense(units: int, in_dim: int, spec: str) -> keras.layers.Layer:
    import mpx_keras

    _float8()
    model = keras.Sequential([keras.Input((in_dim,)), keras.layers.Dense(units, use_bias=False, name="fc")])
    return mpx_keras.apply_policy(model, spec).layers[0]


def _gradients(layer: keras.layers.Layer, variables: list):
    """``(x, g) -> gradients of sum(layer(x) * g)`` for ``variables``, compiled as ``fit`` compiles a step: jitted
    (a stateless call) on jax, a ``tf.function`` on TensorFlow (Keras's float8 Dense cannot take an eager
    tape's gradient there), else the adapter's eager ``value_and_grad``."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def tf_gradients(x, g) -> list:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True) * g)
            return tape.gradient(loss, variables)

        return tf_gradients
    if backend != "jax":
        return lambda x, g: _STEPS.value_and_grad(lambda: ops.sum(layer(x, training=True) * g), variables)[1]
    import jax

    def loss(values: list, x, g):
        with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
            return ops.sum(layer(x, training=True) * g)

    grad = jax.jit(jax.grad(loss))
    return lambda x, g: grad([v.value for v in variables], x, g)


def run_fp8_trace(p: dict, mode: str) -> dict:
    """The scale each step leaves for the next, the FP8 variables written by an optimizer step (as ``fit``
    takes it) on every step the loss scaler does not skip (mpx: a Float8Dense's state, ``float8_state_dict``;
    native: Keras's float8 Dense's stored inverse ``<role>_scale``, as ``1 / stored``)."""
    recipe = p["recipe"]
    if mode == "mpx":
        layer = _mpx_dense(4, 4, p["policy"])
        variables = [v for _, _, v in layer.fp8_variables()]
        float8 = _float8()

        def scale() -> np.float32:  # the state float8_update gives, read through the public state dict
            tensors = float8.float8_state_dict(layer)["tensors"].values()
            return np.float32(next(t["scale"] for t in tensors if t["role"] == p["role"]))
    else:
        require_native_recipe(recipe, "Keras's float8 Dense")
        layer = _native_dense(4, 4, recipe["amax_history_len"])
        variables = [v for v in layer.trainable_variables if "scale" in v.name or "amax_history" in v.name]
        var = getattr(layer, f"{VAR[p['role']]}_scale")

        def scale() -> np.float32:
            return np.float32(1.0) / np.float32(_numpy(var))

    gradients = _gradients(layer, variables)
    opt = keras.optimizers.SGD(learning_rate=0.0)
    opt.build(variables)
    ones = ops.ones((2, 4), "float32")
    grad_role = p["role"] == "grad"
    scales = []
    for bits, skipped in zip(p["amaxes"], p["skipped"], strict=True):
        amax = ops.convert_to_tensor(trace_input(float(bits_to_f32([bits])[0])))
        x, g = (ones, amax) if grad_role else (amax, ones)
        grads = gradients(x, g)
        if not skipped:  # a skipped step writes no variable (the loss scaler's skip)
            _STEPS.apply(opt, grads, variables)
        scales.append(scale())
    return {"scales": f32_to_bits(scales)}


def run_fp8_matmul(p: dict, mode: str) -> dict:
    """``a @ b`` in FP8 (mpx: a Float8Dense under the case's current-scaling policy; native: Keras's float8
    Dense with its stored inverse scales set to ``1 / scale`` of the case, as a loaded checkpoint's)."""
    a, b = matmul_inputs(p["seed"], p["m"], p["k"], p["n"], p["bad"])
    if mode == "mpx":
        layer = _mpx_dense(p["n"], p["k"], p["policy"])
        layer.kernel.assign(b)
    else:
        layer = _native_dense(p["n"], p["k"], 16)
        layer._kernel.assign(b)
        layer.inputs_scale.assign(np.float32(1.0) / np.float32(p["scales"][0]))
        layer.kernel_scale.assign(np.float32(1.0) / np.float32(p["scales"][1]))
    out = layer(ops.convert_to_tensor(a), training=False)
    return within_bound(_numpy(ops.cast(out, "float32")), p["reference"], p["bound"])
