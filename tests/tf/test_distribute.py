"""tf.distribute: two logical CPU replicas decide skip and scale together (run in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mpx

SCRIPT = r"""
import json, math, os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import mpx, mpx_tf

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
config = mpx.ScalerConfig(growth_interval=2, init_scale=2.0**10)
out = {"replicas": strategy.num_replicas_in_sync}


def replica_bytes(variables):
    # every replica's copy of every variable
    return [[np.asarray(c.numpy()).tobytes() for c in v.value.values] for v in variables]


def custom_loop(make_optimizer, events):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = make_optimizer()
        opt.build(model.trainable_variables)
    inner = getattr(opt, "inner_optimizer", opt)

    @tf.function
    def step(x, y, bad_replica):
        def replica_fn(x, y):
            ctx = tf.distribute.get_replica_context()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y)) / ctx.num_replicas_in_sync
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            poison = tf.where(ctx.replica_id_in_sync_group == bad_replica, math.inf, 0.0)
            opt.apply([grads[0] + poison, *grads[1:]], model.trainable_variables)

        strategy.run(replica_fn, args=(x, y))

    x = tf.constant(np.random.RandomState(0).rand(8, 4), tf.float32)
    y = tf.constant(np.random.RandomState(1).rand(8, 3), tf.float32)
    rows = []
    for bad in events:
        before = replica_bytes(model.variables), replica_bytes(inner.variables)
        step(x, y, tf.constant(bad))
        after = replica_bytes(model.variables), replica_bytes(inner.variables)
        rows.append({
            "bad_replica": bad,
            "unchanged": after == before,
            "replicas_agree": all(len(set(v)) == 1 for v in after[0] + after[1]),
            "finite_weights": all(np.isfinite(c.numpy()).all() for v in model.variables for c in v.value.values),
            "state": mpx_tf.LossScaleOptimizer.state_dict(opt) if isinstance(opt, mpx_tf.LossScaleOptimizer) else None,
            "native_scale": float(opt.dynamic_scale.numpy()),
        })
    return rows, step.experimental_get_tracing_count()


events = [-1, 1, -1, 0, -1, -1]
out["mpx"], out["mpx_traces"] = custom_loop(
    lambda: mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01), config), events
)
# Keras's own LossScaleOptimizer, for the record (not asserted): it takes the first replica's flag.
out["keras"], _ = custom_loop(
    lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**10), [1]
)

# model.fit under the strategy
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01), config)
    model.compile(optimizer=opt, loss="mse")
data = np.random.RandomState(2).rand(32, 4).astype("float32")
model.fit(data, data[:, :3], batch_size=8, epochs=1, verbose=0)
out["fit_state"] = opt.state_dict()
out["fit_iterations"] = int(opt.iterations.numpy())
json.dump(out, open(sys.argv[1], "w"))
"""


def test_mirrored_strategy_replicas_skip_together(tmp_path):
    result = tmp_path / "result.json"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(result)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(result.read_text())
    assert out["replicas"] == 2

    config = mpx.ScalerConfig(growth_interval=2, init_scale=2.0**10)
    state = mpx.scaler_init(config)
    for row in out["mpx"]:
        finite = row["bad_replica"] == -1
        state = mpx.scaler_update(config, state, finite)
        assert row["state"] == mpx.state_dict(config, state), row
        assert row["replicas_agree"], row
        assert row["unchanged"] == (not finite), row  # a non-finite step on ONE replica skips on all
        assert row["finite_weights"], row
    assert [row["state"]["scale"] for row in out["mpx"]] == [1024.0, 512.0, 512.0, 256.0, 256.0, 512.0]
    assert out["mpx_traces"] == 1

    assert out["fit_state"]["steps"] == 4 and out["fit_iterations"] == 4
