"""tf.distribute: two logical CPU replicas decide skip and scale together (run in a fresh process)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mpx

#: What every script below starts with: Keras on TF with 2 logical CPUs (set before TF starts), a
#: MirroredStrategy over them, and every replica's copy of every variable as bytes.
MIRRORED_PRELUDE = r"""
import hashlib, json, math, os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import mpx, mpx_tf

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def replica_bytes(variables):
    return [[np.asarray(c.numpy()).tobytes() for c in v.value.values] for v in variables]
"""

SCRIPT = (
    MIRRORED_PRELUDE
    + r"""
config = mpx.ScalerConfig(growth_interval=2, init_scale=2.0**10)
out = {"replicas": strategy.num_replicas_in_sync}


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
)


def test_mirrored_strategy_replicas_skip_together(run_python, tmp_path):
    out = _run_script(run_python, SCRIPT, tmp_path)
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


SCRIPT_ACCUMULATION_AND_REDUCE = (
    MIRRORED_PRELUDE
    + r"""
out = {}


def loop(make_optimizer, events, where):
    # events: the replica whose loss (where="loss") or gradients (where="grads") is poisoned, -1 for none
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
            poisoned = ctx.replica_id_in_sync_group == bad_replica
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y)) / ctx.num_replicas_in_sync
                if where == "loss":
                    loss = loss * tf.where(poisoned, math.inf, 1.0)
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            if where == "grads":
                grads = [grads[0] + tf.where(poisoned, math.inf, 0.0), *grads[1:]]
            opt.apply(grads, model.trainable_variables)

        strategy.run(replica_fn, args=(x, y))

    x = tf.constant(np.random.RandomState(0).rand(8, 4), tf.float32)
    y = tf.constant(np.random.RandomState(1).rand(8, 3), tf.float32)
    rows = []
    for bad in events:
        used = float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale") else 1.0
        before = replica_bytes(model.variables) + replica_bytes(inner.variables)
        step(x, y, tf.constant(bad))
        after = replica_bytes(model.variables) + replica_bytes(inner.variables)
        rows.append({
            "used": used,
            "scale": float(opt.dynamic_scale.numpy()) if hasattr(opt, "dynamic_scale") else 1.0,
            "unchanged": after == before,
            "agree": all(len(set(v)) == 1 for v in after),
            "finite": all(np.isfinite(c.numpy()).all() for v in model.variables for c in v.value.values),
            "iterations": int(inner._iterations.numpy()),
            "before": hashlib.sha256(repr(before).encode()).hexdigest(),
            "after": hashlib.sha256(repr(after).encode()).hexdigest(),
        })
    return rows, opt


config = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)
# 1. one replica poisoned, in its loss and in its gradients (replica-local, before Keras's aggregation)
for where in ("loss", "grads"):
    out["mpx_" + where], _ = loop(lambda: mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01), config),
                                  [-1, 1, -1, 0, -1], where)
    for bad in (0, 1):
        out[f"keras_{where}_{bad}"], _ = loop(
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=8.0,
                                                        dynamic_growth_steps=1), [bad], where)

# 2. accumulation under the strategy (k = 2), micro-batch events (the poisoned replica, -1 for none).
# Natively, Keras's inner accumulation puts a merge_call (its update step) inside a replica-context
# cond, which MirroredStrategy refuses on CPU: recorded.
rows, opt = loop(lambda: mpx_tf.LossScaleOptimizer(
    keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), config), [-1, -1, -1, 1, 0, -1, -1, -1], "grads")
out["acc"] = rows
out["acc_state"] = opt.state_dict()
with strategy.scope():  # model.fit: 4 micro-batches of 8 rows (global batch 8), k = 2
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), config)
    model.compile(optimizer=opt, loss="mse")
data = np.random.RandomState(2).rand(32, 4).astype("float32")
data[8, 0] = np.inf  # the second micro-batch: the first window is skipped
model.fit(data, data[:, :3], batch_size=8, epochs=1, shuffle=False, verbose=0)
out["fit_acc_state"] = opt.state_dict()
out["fit_acc_iterations"] = int(opt.iterations.numpy())
out["fit_acc_agree"] = all(len(set(c)) == 1 for c in replica_bytes(model.variables))
try:
    loop(lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), [-1, -1], "grads")
    out["acc_native_error"] = None
except RuntimeError as err:
    out["acc_native_error"] = str(err)[-1500:]

# 3. reduce dtype: SGD(1) on one variable, replica r's gradient g[r]
g = np.array([[1.0 + 2.0**-9, 3.0 + 2.0**-7, 1e-3, 2.0**20 + 3.0], [2.0**-10, 5.0 + 2.0**-8, 2e-3, 7.0]], np.float32)
for name, reduce in (("none", None), ("bf16", "bfloat16"), ("fp16", "float16")):
    with strategy.scope():
        w = keras.Variable(np.zeros(4, np.float32))
        opt = mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(1.0), mpx.ScalerConfig(kind="none"), reduce_dtype=reduce)
        opt.build([w])

    @tf.function
    def apply_step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply([tf.gather(tf.constant(g), r)], [w])
        strategy.run(replica_fn)

    apply_step()
    out["reduce_" + name] = [np.asarray(c.numpy()).tolist() for c in w.value.values]
json.dump(out, open(sys.argv[1], "w"))
"""
)


def _env():
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _run_script(run_python, script, tmp_path):
    """Run ``script`` in a fresh process (conftest's hang detector: no wall-clock limit); its JSON result."""
    result = tmp_path / "result.json"
    [(code, _, err)] = run_python([[sys.executable, "-c", script, str(result)]], env=_env())
    assert code == 0, err[-4000:]
    return json.loads(result.read_text())


def test_mirrored_one_replica_poisoned_accumulation_and_reduce_dtype(run_python, tmp_path):
    import ml_dtypes
    import numpy as np

    out = _run_script(run_python, SCRIPT_ACCUMULATION_AND_REDUCE, tmp_path)
    config = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)

    # 1. mpx: one poisoned replica (loss or gradients) makes every replica skip; one scale trace.
    for where in ("loss", "grads"):
        rows = out["mpx_" + where]
        flags = [True, False, True, False, True]
        expected = mpx.accumulation_trace(config, flags, 1)
        assert [r["scale"] for r in rows] == [w["scale"] for w in expected], where
        assert [r["unchanged"] for r in rows] == [not f for f in flags], where
        assert all(r["agree"] and r["finite"] for r in rows), where
    # Keras's own LSO under MirroredStrategy decides on the first replica's flag: a poisoned replica 0
    # skips everywhere (and backs off), a poisoned replica 1 is applied, and Keras's aggregation sums
    # its inf into every replica's weights (they agree, but are no longer finite; the scale grows).
    native = {
        (where, bad): {
            k: out[f"keras_{where}_{bad}"][0][k] for k in ("scale", "unchanged", "agree", "finite")
        }
        for where in ("loss", "grads")
        for bad in (0, 1)
    }
    skipped = {"scale": 4.0, "unchanged": True, "agree": True, "finite": True}
    applied = {"scale": 16.0, "unchanged": False, "agree": True, "finite": False}
    assert native == {
        ("loss", 0): skipped,
        ("loss", 1): applied,
        ("grads", 0): skipped,
        ("grads", 1): applied,
    }, native

    # 2. accumulation under the strategy: the reference per window, bad windows skipped whole on both replicas
    micro = [True, True, True, False, False, True, True, True]
    expected = mpx.accumulation_trace(config, micro, 2)
    rows = out["acc"]
    reference = [config.first_scale] + [w["scale"] for w in expected]
    assert [r["used"] for r in rows] == [reference[i // 2] for i in range(len(rows))]  # constant in a window
    assert [rows[i]["scale"] for i in range(1, len(rows), 2)] == [w["scale"] for w in expected]
    assert all(r["finite"] for r in rows)
    # at each window's end every variable (model, moments, accumulators, iterations) is bitwise identical on
    # both replicas; inside a window the accumulators are replica-local, as Keras's
    assert [r["agree"] for r in rows[1::2]] == [True] * 4
    assert [rows[i]["iterations"] for i in range(1, len(rows), 2)] == [
        2,
        2,
        2,
        4,
    ]  # _iterations: micro-batches
    assert (
        rows[2]["unchanged"] is False and rows[4]["unchanged"] is False
    )  # the first micro-batch accumulated ...
    for i in (
        3,
        5,
    ):  # ... and a skipped window ends bit-identical to where it began (every variable, replica)
        assert rows[i]["after"] == rows[i - 1]["before"], i
    assert rows[7]["after"] != rows[6]["before"]  # an applied window
    assert out["acc_state"]["steps"] == len(expected)
    assert out["acc_state"]["skipped_steps"] == sum(not w["applied"] for w in expected)
    fit = mpx.accumulation_trace(config, [True, False, True, True], 2)
    assert out["fit_acc_state"]["scale"] == fit[-1]["scale"] and out["fit_acc_state"]["steps"] == 2
    assert (
        out["fit_acc_state"]["skipped_steps"] == 1 and out["fit_acc_iterations"] == 1 and out["fit_acc_agree"]
    )
    # Keras's own gradient_accumulation_steps does not run under MirroredStrategy on CPU
    assert out["acc_native_error"] is not None and "merge_call" in out["acc_native_error"], out[
        "acc_native_error"
    ]

    # 3. the reduce dtype: each replica casts to it, the strategy sums in it, the sum comes back in float32
    g = np.array(
        [[1.0 + 2.0**-9, 3.0 + 2.0**-7, 1e-3, 2.0**20 + 3.0], [2.0**-10, 5.0 + 2.0**-8, 2e-3, 7.0]],
        np.float32,
    )
    for name, dtype in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)):
        low = g.astype(dtype)
        total = (low[0].astype(np.float32) + low[1].astype(np.float32)).astype(dtype).astype(np.float32)
        for replica in out["reduce_" + name]:
            assert np.array_equal(np.array(replica, np.float32), -total), (name, replica, -total)
    exact = -(g[0] + g[1])
    for replica in out["reduce_none"]:
        assert np.array_equal(np.array(replica, np.float32), exact)
    assert out["reduce_bf16"] != out["reduce_none"]


WORKER = r"""
import json, math, os, sys
index, ports, result = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
os.environ["TF_CONFIG"] = json.dumps(
    {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": index}}
)
os.environ["KERAS_BACKEND"] = "tensorflow"
import numpy as np
import tensorflow as tf

tf.get_logger().setLevel("ERROR")
import keras
import mpx, mpx_tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam(0.01), mpx.ScalerConfig(init_scale=8.0, growth_interval=1))
    opt.build(model.trainable_variables)
x = tf.constant(np.random.RandomState(index).rand(8, 4), tf.float32)
y = tf.constant(np.random.RandomState(1).rand(8, 3), tf.float32)


@tf.function
def step(bad_worker):
    def replica_fn():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_mean(tf.square(model(x) - y)) / 2)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply([grads[0] + tf.where(bad_worker == index, math.inf, 0.0), *grads[1:]], model.trainable_variables)

    strategy.run(replica_fn)


rows = []
for bad in [-1, 1, -1, 0, -1]:
    step(tf.constant(bad))
    rows.append({"scale": float(opt.dynamic_scale.numpy()),
                 "weights": [np.asarray(v.numpy()).tobytes().hex() for v in model.variables]})
json.dump(rows, open(result, "w"))
"""


def test_multi_worker_mirrored_two_workers_agree(run_python, tmp_path):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1: one worker's inf skips both, weights bitwise equal.

    Keras's own LossScaleOptimizer is not run here: with one worker poisoned the workers take different
    branches and the collective hangs (measured: no progress in 80 s).
    """
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    # Both workers at once; a hang (a collective waiting forever) is caught by conftest's detector
    # (no output and no CPU time for minutes), not by a wall-clock limit a loaded machine could pass.
    ran = run_python(
        [
            [sys.executable, "-c", WORKER, str(i), ",".join(ports), str(tmp_path / f"w{i}.json")]
            for i in range(2)
        ],
        env=_env(),
    )
    assert [code for code, _, _ in ran] == [0, 0], [err[-2000:] for _, _, err in ran]
    w0, w1 = (json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2))
    config = mpx.ScalerConfig(init_scale=8.0, growth_interval=1)
    expected = mpx.accumulation_trace(config, [True, False, True, False, True], 1)
    assert [r["scale"] for r in w0] == [r["scale"] for r in w1] == [w["scale"] for w in expected]
    assert [r["weights"] for r in w0] == [r["weights"] for r in w1]  # bitwise, every step
    assert w0[1]["weights"] == w0[0]["weights"] and w0[3]["weights"] == w0[2]["weights"]  # skipped steps
    assert w0[2]["weights"] != w0[1]["weights"]


def test_the_hang_detector_stops_an_idle_child_and_lets_a_working_one_run(run_python):
    """conftest's detector: a child with no output and no CPU time is a hang; one that keeps writing is not."""
    import pytest

    with pytest.raises(pytest.fail.Exception, match="no output and no CPU time for 2 s"):
        run_python([[sys.executable, "-c", "import time; time.sleep(600)"]], stall_s=2)
    slow = "import time\nfor i in range(10):\n    print(i, flush=True)\n    time.sleep(0.3)"
    [(code, out, _)] = run_python([[sys.executable, "-c", slow]], stall_s=5)  # 3 s in all, never 5 s silent
    assert code == 0 and out.split() == [str(i) for i in range(10)]
