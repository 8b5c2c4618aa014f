"""The Keras 3 / TensorFlow bench worker: Keras mixed_* policies + LossScaleOptimizer natively, mpx_tf under mpx."""

from __future__ import annotations

import os
import platform
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import mpx
import mpx_tf
from mpx_bench import models
from mpx_bench.harness import Config
from mpx_bench.workers.common import CPU_PROBE_N, plan, timed_probe


def _device(device: str) -> str:
    return "/GPU:0" if device.startswith(("cuda", "gpu")) else "/CPU:0"


def info(device: str) -> dict[str, Any]:
    gpus = tf.config.list_physical_devices("GPU")
    name = platform.processor() or platform.machine()
    if device.startswith(("cuda", "gpu")) and gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
    return {"framework": "tf", "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "device": _device(device), "device_name": name,
            "gpus": [g.name for g in gpus],
            "threads": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                        "inter_op": tf.config.threading.get_inter_op_parallelism_threads()}}  # fmt: skip


def compute_dtype(policy: str) -> str:
    return mpx.get_policy(policy).compute_dtype


def probe(dtypes: list[str], budget_s: float, device: str, n: int | None = None) -> dict[str, Any]:
    n = n or (4096 if device.startswith(("cuda", "gpu")) else CPU_PROBE_N)
    with tf.device(_device(device)):
        mm = tf.function(lambda a, b: tf.reduce_sum(tf.matmul(a, b)))
        runs = {}
        for name in dtypes:
            a = tf.cast(tf.random.normal((n, n), seed=0), name)
            b = tf.cast(tf.random.normal((n, n), seed=1), name)
            runs[name] = lambda a=a, b=b: mm(a, b).numpy()
        results = timed_probe(runs, 2.0 * n**3, budget_s)
    return {name: {"n": n, **r} for name, r in results.items()}


def _network(model: str, size: str, native_output: bool) -> keras.Model:
    """The model under the current global dtype policy (a float32 output layer for Keras's own recipe)."""
    d = models.dims(model, size)
    keras.utils.set_random_seed(0)
    if model == "mlp":
        inp = keras.Input((d["d"],))
        out = keras.layers.Dense(d["d"])(keras.layers.Dense(d["h"], activation="gelu")(inp))
    elif model == "transformer":
        inp = keras.Input((d["seq"], d["d"]))
        x = inp
        for _ in range(d["layers"]):
            h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
            h = keras.layers.MultiHeadAttention(d["heads"], d["d"] // d["heads"])(h, h)
            x = keras.layers.Add()([x, h])
            h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
            h = keras.layers.Dense(d["d"])(keras.layers.Dense(d["ff"], activation="gelu")(h))
            x = keras.layers.Add()([x, h])
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(epsilon=1e-5)(x))
        out = keras.layers.Dense(d["d"])(x)
    else:
        c1, c2, c3 = d["channels"]
        inp = keras.Input((d["hw"], d["hw"], d["cin"]))
        x = keras.layers.Conv2D(c1, 3, padding="same", activation="relu")(inp)
        x = keras.layers.Conv2D(c2, 3, strides=2, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(c3, 3, strides=2, padding="same", activation="relu")(x)
        out = keras.layers.Dense(d["classes"])(keras.layers.GlobalAveragePooling2D()(x))
    if native_output:
        out = keras.layers.Activation("linear", dtype="float32")(out)
    return keras.Model(inp, out)


class Runner:
    def __init__(
        self, net: keras.Model, opt: Any, scaled: bool, model: str, data: tuple[Any, Any], device: str
    ) -> None:
        self.net, self.opt, self.device = net, opt, device
        self.x, self.y = data
        opt.build(net.trainable_variables)
        classify = model == "cnn"

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                out = tf.cast(net(x, training=True), tf.float32)
                if classify:
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))
                else:
                    loss = tf.reduce_mean(tf.square(out - y))
                scaled_loss = opt.scale_loss(loss) if scaled else loss
            grads = tape.gradient(scaled_loss, net.trainable_variables)
            opt.apply(grads, net.trainable_variables)

        self._step = step
        self.steps = 0

    def step(self) -> None:
        with tf.device(self.device):
            self._step(self.x, self.y)
        # a Keras variable read forces the step to finish (TF runs ops asynchronously only on GPU)
        self.opt.iterations.numpy()
        self.steps += 1

    def measure(self) -> dict[str, Any]:
        before, steps = self._step.experimental_get_tracing_count(), self.steps
        self.step()
        self.step()
        return {
            "traces_total": self._step.experimental_get_tracing_count(),
            "traces_per_step": (self._step.experimental_get_tracing_count() - before) / (self.steps - steps),
            "activation_bytes": None,
            "activation_note": "not measured: TensorFlow has no deterministic count of the tensors a tape keeps",
        }


def configs(model: str, size: str, policies: list[str], device: str, slow: dict[str, str]) -> list[Config]:
    x, y = models.data(model, size)
    dev = _device(device)
    with tf.device(dev):
        data = (tf.constant(x), tf.constant(y.astype(np.int32) if model == "cnn" else y))

    def make(mode: str, policy: mpx.Policy | None) -> Any:
        def build_runner() -> Runner:
            inner = keras.optimizers.AdamW(1e-4)
            if mode == "fp32" or policy is None:
                keras.mixed_precision.set_global_policy("float32")
                return Runner(_network(model, size, False), inner, False, model, data, dev)
            scaled = policy.compute_dtype == "float16" and mode in ("native", "mpx")
            if mode.startswith("native"):
                name = {
                    ("float32", "float16"): "mixed_float16",
                    ("float32", "bfloat16"): "mixed_bfloat16",
                }.get((policy.param_dtype, policy.compute_dtype), policy.compute_dtype)
                keras.mixed_precision.set_global_policy(name)
                try:
                    net = _network(model, size, True)
                finally:
                    keras.mixed_precision.set_global_policy("float32")
                opt = keras.optimizers.LossScaleOptimizer(inner) if scaled else inner
                return Runner(net, opt, scaled, model, data, dev)
            with mpx_tf.policy_scope(policy):
                net = mpx_tf.apply_policy(_network(model, size, False), policy)
            config = mpx.ScalerConfig.for_policy(policy)
            scaled = scaled and config.kind != "none"
            opt = mpx_tf.LossScaleOptimizer(inner, config) if scaled else inner
            return Runner(net, opt, scaled, model, data, dev)

        return build_runner

    return plan(policies, slow, make)
