"""keras.distribution replicas: Keras 3 on JAX over 4 host devices, natively and under mpx.

    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python -m conformance.distributed.keras_jax IN OUT

``per_replica`` runs ``keras.distribution.DataParallel`` (batch over 4 devices, every variable
replicated); ``sharded`` runs ``ModelParallel`` on a 2x2 ``batch`` x ``model`` mesh whose
``LayoutMap`` shards both Dense kernels over ``model``.  Natively ``keras.optimizers.LossScaleOptimizer``;
under mpx ``mpx_keras.LossScaleOptimizer``.  The step is what Keras's JAX trainer runs: the model's
stateless call in a ``keras.StatelessScope``, ``jax.grad`` of the scaled loss, the optimizer's
``stateless_apply``, all in one ``jax.jit`` over the distributed variables; the inf enters the last
batch shard's examples (``loss``) or the last model shard's column of the first kernel after the
gradient (``grads_after_reduce``).  Each step reads every device's copy of every variable
(``addressable_shards``).

The script runs the modes ``MPX_CONFORMANCE_MODES`` names (both by default); without ``mpx`` it
blocks mpx's imports (:mod:`conformance.isolation`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"

import jax
import jax.numpy as jnp
import numpy as np

from conformance import isolation

N = 4
LR = 0.1
ENGINE_NAMES = {
    "per_replica": "keras.distribution.DataParallel over 4 host devices (variables replicated)",
    "sharded": "keras.distribution.ModelParallel on a 2x2 batch x model mesh (Dense kernels sharded over model)",
}


def _distribution(engine: str):
    import keras

    devices = jax.devices()[:N]
    if engine == "per_replica":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*/fc.*/kernel"] = (None, "model")  # LayoutMap keys are full matches of the variable's path
    return keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")


def _devices(variables) -> list[bytes]:
    """Per device (in id order), the bytes of its part of every variable (what an applied step changes)."""
    per = [b""] * N
    for v in variables:
        shards = sorted(v.value.addressable_shards, key=lambda s: s.device.id)
        assert len(shards) == N, v.path
        per = [p + np.asarray(s.data).tobytes() for p, s in zip(per, shards, strict=True)]
    return per


def _agree(variables) -> bool:
    """Whether every device holding a part of the variables holds the same bytes as every other holder of it."""
    parts = {}
    for v in variables:
        for s in v.value.addressable_shards:
            parts.setdefault((v.path, repr(s.index)), set()).add(np.asarray(s.data).tobytes())
    return all(len(b) == 1 for b in parts.values())


def _run(p: dict, mode: str) -> dict:
    import keras

    cfg, engine = p["config"], p["engine"]
    dist = _distribution(engine)
    rng = np.random.default_rng(0)
    init = [rng.standard_normal((4, 8)) / 2, np.zeros(8), rng.standard_normal((8, 4)) / 3, np.zeros(4)]
    data = np.random.default_rng(1)
    x, y = (data.standard_normal((2 * N, 4)).astype(np.float32) for _ in range(2))
    with dist.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh", name="fc1"),
                                  keras.layers.Dense(4, name="fc2")])  # fmt: skip
        model.set_weights([a.astype(np.float32) for a in init])
        if mode == "native":
            opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=cfg["init_scale"],
                                                      dynamic_growth_steps=cfg["growth_interval"])  # fmt: skip
        else:
            import mpx_keras

            opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(LR), cfg)
        opt.build(model.trainable_variables)
    tvars, ovars = list(model.trainable_variables), list(opt.variables)
    scale_var = next(v for v in ovars if v.path.endswith("dynamic_scale"))
    rows, vec = (dist.get_data_layout(shape).backend_layout for shape in ((2 * N, 4), (2 * N,)))

    def step(tv, ov, x, y, mult, bump):
        def loss_fn(tv):
            with keras.StatelessScope(state_mapping=list(zip(tvars, tv, strict=True)) + list(zip(ovars, ov, strict=True))):
                loss = jnp.mean(mult[:, None] * (model(x) - y) ** 2)
                return opt.scale_loss(loss)

        grads = jax.grad(loss_fn)(tv)
        grads = [grads[0] + bump, *grads[1:]]
        return opt.stateless_apply(ov, grads, tv)

    run = jax.jit(step)
    scales, applied, same = [], [], True
    before = _devices(tvars)
    for finite in p["flags"]:
        mult, bump = np.ones(2 * N, np.float32), np.zeros((4, 8), np.float32)
        if not finite and p["scenario"] == "loss":
            mult[-2:] = np.inf  # the last batch shard's examples
        if not finite and p["scenario"] == "grads_after_reduce":
            bump[-1, -1] = np.inf  # the last column of fc1's kernel: the last model shard's (ModelParallel)
        tv, ov = run([v.value for v in tvars], [v.value for v in ovars], jax.device_put(x, rows),
                     jax.device_put(y, rows), jax.device_put(mult, vec), jnp.asarray(bump))  # fmt: skip
        for var, value in zip(tvars + ovars, list(tv) + list(ov), strict=True):
            var.assign(value)
        after = _devices(tvars)
        s = [float(np.asarray(sh.data)) for sh in sorted(scale_var.value.addressable_shards, key=lambda s: s.device.id)]
        scales.append(s)
        applied.append([a != b for a, b in zip(after, before, strict=True)])
        same = same and _agree(tvars + ovars) and len(set(s)) == 1
        same = same and len(set(applied[-1])) == 1
        before = after
    return {"consistent": bool(same), "scales": [s[0] for s in scales], "applied": [a[0] for a in applied],
            "scales_per_replica": [list(r) for r in zip(*scales, strict=True)],
            "params_finite": bool(all(np.isfinite(np.asarray(v.value)).all() for v in tvars)),
            "kernel_layout": str(tvars[0].value.sharding.spec), "engine": ENGINE_NAMES[engine]}  # fmt: skip


def _fp8(p: dict, mode: str) -> dict:
    """ModelParallel (kernels sharded over ``model``), a Dense layer in FP8 with delayed scaling (natively
    ``layer.quantize("float8")``, under mpx ``mpx_keras.apply_policy`` with an ``fp8=`` policy) trained one
    batch at a time; each step's largest |x| in one batch shard's rows.  Per step: every holder of each
    part of the FP8 variables holds the same bytes, the input amax recorded is the whole batch's, and under
    mpx the state is ``mpx.float8.float8_update``'s chain (input and weight amaxes from the whole arrays,
    the gradient's as recorded: it is computed inside the step)."""
    import keras

    from conformance.distributed.jax import _fp8_batches

    dist = _distribution("sharded")
    length = p["recipe"]["amax_history_len"]
    spec = f"float32,fp8={p['recipe']['format']},fp8_history={length}"
    with dist.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc1", use_bias=False)])
        model.set_weights([(np.random.default_rng(0).standard_normal((4, 8)) / 2).astype(np.float32)])
        if mode == "native":
            model.quantize("float8")
            layer = model.layers[0]
            length = int(layer.inputs_amax_history.shape[0])  # Keras's own (1024), not the recipe's
            opt = keras.optimizers.SGD(LR)
            fp8_vars = [v for v in model.variables if "scale" in v.path or "amax_history" in v.path]

            def recorded() -> float:
                return float(np.asarray(layer.inputs_amax_history.value).reshape(-1)[0])
        else:
            import mpx_keras
            from mpx_keras import float8 as kf8

            model = mpx_keras.apply_policy(model, spec)
            opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(LR), {"kind": "static", "init_scale": 1.0})
            fp8_vars = [var for _, lay in kf8.float8_layers(model) for _, _, var in lay.fp8_variables()]

            def recorded() -> float:
                hist = kf8.float8_state_dict(model)["tensors"]["fc1.input"]["amax_history"]
                return float(np.asarray(hist, np.float32).reshape(-1)[0])

            import mpx.float8 as core

            recipe = core.load_state_dict(kf8.float8_state_dict(model))[0]
            ref = core.float8_init(recipe, {f"fc1.{r}": r for r in ("input", "weight", "grad")})
        model.compile(optimizer=opt, loss="mse")
    if not fp8_vars:
        raise RuntimeError("the model has no FP8 variables")
    c = np.random.default_rng(3).standard_normal((2 * N, 8)).astype(np.float32)
    same, global_amax, core_chain = True, True, True
    for x in _fp8_batches(p):
        w_before = np.asarray(model.layers[0].kernel.value)
        model.train_on_batch(x, c)
        same = same and _agree(fp8_vars)
        global_amax = global_amax and np.float32(recorded()) == np.float32(np.abs(x).max())
        if mode == "mpx":  # the core's chain over the global input and weight amaxes and the recorded gradient's
            got = kf8.float8_state_dict(model)["tensors"]
            grad = np.float32(np.asarray(got["fc1.grad"]["amax_history"], np.float32).reshape(-1)[0])
            ref = core.float8_update(recipe, ref, {"fc1.input": np.float32(np.abs(x).max()),
                                                   "fc1.weight": np.float32(np.abs(w_before).max()), "fc1.grad": grad})  # fmt: skip
            want = core.state_dict(recipe, ref)["tensors"]
            core_chain = core_chain and all(
                np.asarray(got[k][f], np.float32).tobytes() == np.asarray(want[k][f], np.float32).tobytes()
                for k in want for f in ("scale", "amax_history"))  # fmt: skip
    layout = str(model.layers[0].kernel.value.sharding.spec) if hasattr(model.layers[0], "kernel") else None
    return {"consistent": bool(same and core_chain), "global_amax": bool(global_amax), "kernel_layout": layout,
            "core_chain": bool(core_chain) if mode == "mpx" else None,
            "engine": ENGINE_NAMES["sharded"] + f", FP8 delayed scaling (history {length})"}  # fmt: skip


def main(argv: list[str]) -> int:
    src, dst = argv
    modes = isolation.modes_from_env()  # natively: the blocker, before anything runs
    specs = json.loads(Path(src).read_text())
    if len(jax.devices()) < N:
        why = f"JAX sees {len(jax.devices())} device(s), not {N}: XLA_FLAGS={N} host devices was not honoured"
        Path(dst).write_text(json.dumps({cid: {"launch_failed": why} for cid in specs}))
        return 0
    out: dict[str, dict] = {}
    for cid, p in specs.items():
        out[cid] = {}
        for mode in modes:
            try:
                out[cid][mode] = (_fp8 if p["scenario"] == "fp8_amax" else _run)(p, mode)
            except Exception as err:
                out[cid][mode] = {"raised": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
                if os.environ.get("MPX_CONFORMANCE_DEBUG"):
                    traceback.print_exc()
    out["_isolation"] = isolation.report()
    Path(dst).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
