"""A model saved on one Keras backend loads on every other, with its mpx policies and its optimizer's state."""

from __future__ import annotations

import inspect
import json

import keras
import numpy as np

import mpx
import mpx_keras

BACKEND = keras.config.backend()
OTHERS = [b for b in ("tensorflow", "jax", "torch") if b != BACKEND]

#: loads each model in PATHS and prints what :func:`_seen` (its source is prepended, with X_JSON and PATHS)
#: sees of it, one JSON line per model
LOAD = r"""
x = np.asarray(json.loads(X_JSON), np.float32)
for path in PATHS:
    print(json.dumps(_seen(keras.models.load_model(path), x)))
"""
POLICIES = ["mixed_float16", "mixed_bfloat16"]


def _trained(policy: str, x: np.ndarray) -> keras.Model:
    with mpx_keras.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, name="d"), keras.layers.LayerNormalization(name="ln"),
             keras.layers.Dense(2, name="out")]
        )  # fmt: skip
    mpx_keras.apply_policy(model, policy)
    opt = mpx_keras.LossScaleOptimizer(
        keras.optimizers.Adam(), mpx.ScalerConfig(init_scale=256.0, growth_interval=1)
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, np.ones((4, 2), np.float32), verbose=0)
    return model


def _seen(model: keras.Model, x: np.ndarray) -> dict:
    """What the test compares of a model, here and in a fresh process on each other backend (plain JSON)."""
    out = model(x)
    return {
        "dtypes": {layer.name: [layer.compute_dtype, layer.variable_dtype] for layer in model.layers},
        "policies": {layer.name: layer.dtype_policy.name for layer in model.layers},
        "out_dtype": keras.backend.standardize_dtype(out.dtype),
        "out": keras.ops.convert_to_numpy(keras.ops.cast(out, "float32")).tolist(),
        "optimizer": type(model.optimizer).__module__ + "." + type(model.optimizer).__name__,
        "state": model.optimizer.state_dict(),
    }


def test_save_here_load_on_every_backend(tmp_path, python_on):
    """Each policy's model saved here loads here and, in one fresh process per other backend, there."""
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    paths, saved = [], []
    for policy in POLICIES:
        model = _trained(policy, x)
        paths.append(str(tmp_path / f"{policy}.keras"))
        model.save(paths[-1])
        here = _seen(model, x)
        assert here["state"]["scale"] == 512.0, policy
        saved.append(here)
    loaded = {BACKEND: [_seen(keras.models.load_model(path), x) for path in paths]}
    for backend in OTHERS:
        prelude = f"import json, keras, mpx_keras, numpy as np\nX_JSON = {json.dumps(x.tolist())!r}\nPATHS = {paths!r}\n"
        proc = python_on(prelude + inspect.getsource(_seen) + LOAD, backend)
        assert proc.returncode == 0, (backend, proc.stderr[-3000:])
        loaded[backend] = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(paths) :]]
    for backend, gots in loaded.items():
        for policy, here, got in zip(POLICIES, saved, gots, strict=True):
            where = (backend, policy)
            assert got["dtypes"] == here["dtypes"], where
            assert all(name.startswith("mpx:") for name in got["policies"].values()), (where, got["policies"])
            assert got["out_dtype"] == "float32", where
            assert got["optimizer"] == "mpx_keras.loss_scale_optimizer.LossScaleOptimizer", where
            assert got["state"] == here["state"], where
            np.testing.assert_allclose(
                np.asarray(got["out"]), np.asarray(here["out"]), rtol=2e-2, atol=2e-2, err_msg=str(where)
            )
