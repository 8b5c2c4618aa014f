"""tf.distribute replicas: MirroredStrategy on 2 logical CPUs, natively and under mpx.

    python -m conformance.distributed.tf IN.json OUT.json

A process of its own, because the logical devices must be configured before TensorFlow starts.
Natively ``keras.optimizers.LossScaleOptimizer``; under mpx ``mpx_tf.LossScaleOptimizer``.  Keras
all-reduces the gradients inside ``optimizer.apply`` (in ``_backend_update_step``), after the
scaler's check, so "after the reduction" is, for Keras, the last point user code reaches: the
replica's gradients right before ``apply``.

The script runs the modes ``MPX_CONFORMANCE_MODES`` names (both by default); without ``mpx`` it
blocks mpx's imports (:mod:`conformance.isolation`).  Scaler configs are
``mpx.ScalerConfig.to_dict()`` dicts: read by key natively, handed to mpx_tf under mpx.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from conformance import isolation

N = 2
ENGINE_NAMES = {
    "per_replica": "MirroredStrategy, 2 logical CPUs",
    "sharded": None,
}
NO_SHARDED_ENGINE = ("Keras 3 on TensorFlow has no sharded-parameter engine: keras.distribution's TensorFlow "
                     "backend is a DTensor prototype marked 'DO NOT USE'; MirroredStrategy is the per_replica case")  # fmt: skip


def _configure() -> list[str]:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * N)
    return [d.name for d in tf.config.list_logical_devices("CPU")][:N]


def _run(p: dict, mode: str, devices: list[str]) -> dict:
    import keras

    cfg = p["config"]
    strategy = tf.distribute.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((4, 8)) / 2, np.zeros(8), rng.standard_normal((8, 4)) / 3, np.zeros(4)]
    data = np.random.default_rng(1)
    x_all = tf.constant(data.standard_normal((N, 4, 4)), tf.float32)  # per replica: 4 examples
    y_all = tf.constant(data.standard_normal((N, 4, 4)), tf.float32)
    with strategy.scope():
        variables = [keras.Variable(a.astype(np.float32)) for a in init]
        inner = keras.optimizers.SGD(0.1)
        if mode == "native":
            opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=cfg["init_scale"],
                                                      dynamic_growth_steps=cfg["growth_interval"])  # fmt: skip
        else:
            import mpx_tf

            opt = mpx_tf.LossScaleOptimizer(inner, cfg)
        opt.build(variables)

    def replica_step(bad):
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        hit = tf.logical_and(bad, tf.equal(rid, N - 1))
        x, y = tf.gather(x_all, rid), tf.gather(y_all, rid)
        with tf.GradientTape() as tape:
            w1, b1, w2, b2 = (v.value for v in variables)
            out = tf.tanh(x @ w1 + b1) @ w2 + b2
            loss = tf.reduce_mean((out - y) ** 2) / N  # Keras sums replicas' gradients
            if p["scenario"] == "loss":
                loss = loss * tf.where(hit, np.float32(np.inf), np.float32(1.0))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        if p["scenario"] == "grads_after_reduce":
            grads[0] = grads[0] + tf.where(hit, np.float32(np.inf), np.float32(0.0))
        opt.apply(grads, variables)

    @tf.function
    def step(bad):
        strategy.run(replica_step, args=(bad,))

    def per_replica() -> tuple[list[bytes], list[float]]:
        parts = [b"".join(np.asarray(t).tobytes() for t in vs)
                 for vs in zip(*[strategy.experimental_local_results(v.value) for v in variables], strict=True)]  # fmt: skip
        scales = [float(np.asarray(t)) for t in strategy.experimental_local_results(opt.dynamic_scale.value)]
        return parts, scales

    scales, applied, same = [], [], True
    before, _ = per_replica()
    for finite in p["flags"]:
        step(tf.constant(not finite))
        after, s = per_replica()
        scales.append(s)
        applied.append([a != b for a, b in zip(after, before, strict=True)])
        same = same and len(set(after)) == 1 and len(set(s)) == 1 and len(set(applied[-1])) == 1
        before = after
    return {"consistent": bool(same), "scales": [s[0] for s in scales], "applied": [a[0] for a in applied],
            "scales_per_replica": [list(r) for r in zip(*scales, strict=True)],
            "params_finite": bool(all(np.isfinite(np.asarray(v.value)).all() for v in variables)),
            "engine": ENGINE_NAMES["per_replica"]}  # fmt: skip


def main(argv: list[str]) -> int:
    src, dst = argv
    modes = isolation.modes_from_env()  # natively: the blocker, before anything runs
    specs = json.loads(Path(src).read_text())
    devices = _configure()
    out: dict[str, dict] = {}
    for cid, p in specs.items():
        out[cid] = {}
        for mode in modes:
            if p["engine"] == "sharded":  # natively a finding (Keras has no engine), under mpx nothing to run
                out[cid][mode] = ({"consistent": False, "no_engine": NO_SHARDED_ENGINE, "engine": None}
                                  if mode == "native" else {"skip": f"mpx_tf adds no engine: {NO_SHARDED_ENGINE}"})  # fmt: skip
                continue
            try:
                out[cid][mode] = _run(p, mode, devices)
            except Exception as err:
                out[cid][mode] = {"raised": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
                if os.environ.get("MPX_CONFORMANCE_DEBUG"):
                    traceback.print_exc()
    out["_isolation"] = isolation.report()
    Path(dst).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
