"""Fit-step overhead of mpx_tf (apply_policy + autocast + LossScaleOptimizer) against Keras's own policy.

Not a test (no timing assertions): ``python tests/tf/bench_autocast.py [--rounds 15] [--steps 20]``.
Interleaved rounds (Keras, mpx, Keras, mpx...), each round ``--steps`` ``train_on_batch`` calls; prints
the per-round ratio mpx/Keras (median and spread) and the deterministic counts: traces of the train
function and the ops of one traced forward pass, by type.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

import keras
import numpy as np
import tensorflow as tf

import mpx
import mpx_tf

L = keras.layers


@keras.saving.register_keras_serializable("mpx_bench")
class OpsBlock(L.Layer):
    """A residual block written with keras.ops: matmul, softmax-gated, a mean-square normaliser."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="glorot_uniform")

    def call(self, x):
        h = keras.ops.matmul(x, self.w)
        gate = keras.ops.softmax(h, axis=-1)
        scale = keras.ops.rsqrt(keras.ops.mean(keras.ops.square(h), axis=-1, keepdims=True) + 1e-6)
        # keras.ops.multiply promotes mixed dtypes; a Python `*` on TF tensors would refuse bfloat16 * float32
        return keras.ops.add(x, keras.ops.cast(keras.ops.multiply(keras.ops.multiply(h, gate), scale), x.dtype))


def build(kind: str, width: int, mode: str, spec: str):
    def layers():
        if kind == "mlp":
            return [keras.Input((width,)), L.Dense(4 * width, activation="gelu"), L.Dense(width), L.Dense(10)]
        return [keras.Input((width,)), L.Dense(width), OpsBlock(), L.LayerNormalization(), OpsBlock(), L.Dense(10)]

    keras.utils.set_random_seed(0)
    if mode == "keras":  # Keras's own policy and optimizer
        keras.config.set_dtype_policy(spec)
        model = keras.Sequential(layers())
        keras.config.set_dtype_policy("float32")
        optimizer = keras.optimizers.Adam(1e-3)
    else:
        policy = mpx.get_policy(spec)
        with mpx_tf.policy_scope(policy):
            model = keras.Sequential(layers())
        mpx_tf.apply_policy(model, policy)
        optimizer = keras.optimizers.Adam(1e-3)
        if mode == "mpx":  # mpx-ops: the policy and op table only, Keras's optimizer
            optimizer = mpx_tf.LossScaleOptimizer(optimizer, mpx.ScalerConfig.for_policy(policy))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def op_counts(model, width: int) -> collections.Counter:
    fn = tf.function(lambda x: model(x, training=True))
    graph = fn.get_concrete_function(tf.TensorSpec((None, width), tf.float32)).graph
    return collections.Counter(op.type for op in graph.get_operations())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("mlp", "ops"), default="mlp")
    ap.add_argument("--policy", default="mixed_bfloat16")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width)).astype("float32")
    y = rng.integers(0, 10, args.batch).astype("int32")
    modes = ("keras", "mpx", "mpx-ops")
    models = {m: build(args.kind, args.width, m, args.policy) for m in modes}

    def run(model):
        with mpx_tf.autocast(args.policy) if model is not models["keras"] else _null():
            for _ in range(args.steps):
                model.train_on_batch(x, y)

    for model in models.values():
        run(model)  # trace and warm up
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            start = time.perf_counter()
            run(models[mode])
            times[mode].append((time.perf_counter() - start) / args.steps)
    print(f"{args.kind} width={args.width} batch={args.batch} {args.policy}, {args.rounds} rounds x {args.steps} steps")
    for mode in modes:
        print(f"  {mode}: median {1e3 * statistics.median(times[mode]):.2f} ms/step")
    for mode in modes[1:]:
        ratios = sorted(m / k for m, k in zip(times[mode], times["keras"], strict=True))
        q = statistics.quantiles(ratios, n=4)
        print(f"  ratio {mode}/keras: median {statistics.median(ratios):.3f}, IQR {q[0]:.3f}-{q[2]:.3f}, "
              f"min {ratios[0]:.3f}, max {ratios[-1]:.3f}")
    spec = (tf.TensorSpec((args.batch, args.width), tf.float32), tf.TensorSpec((args.batch,), tf.int32))
    for mode, model in models.items():
        with mpx_tf.autocast(args.policy) if mode != "keras" else _null():
            step = tf.function(model.train_step)
            step.get_concrete_function(spec)
            step((tf.constant(x), tf.constant(y)))
            step((tf.constant(x), tf.constant(y)))
            graph = step.get_concrete_function(spec).graph
        counts = op_counts(model, args.width)
        ops = collections.Counter(op.type for op in graph.get_operations())
        print(f"  {mode}: train_step traces {step.experimental_get_tracing_count()}; step graph "
              f"{sum(ops.values())} ops (Cast {ops['Cast']}); forward graph {sum(counts.values())} ops "
              f"(Cast {counts['Cast']}, MatMul {counts['MatMul']})")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
