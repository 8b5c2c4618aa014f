"""A model saved on one Keras backend loads on every other, with its mpx policies and its optimizer's state."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

BACKEND = keras.config.backend()
OTHERS = [b for b in ("tensorflow", "jax", "torch") if b != BACKEND]

LOAD = r"""
import json, sys, numpy as np, keras, mpx_keras
model = keras.models.load_model(sys.argv[1] if len(sys.argv) > 1 else {path!r})
opt = model.optimizer
x = np.asarray(json.loads({x!r}), np.float32)
out = model(x)
print(json.dumps({{
    "dtypes": {{l.name: [l.compute_dtype, l.variable_dtype] for l in model.layers}},
    "policies": {{l.name: l.dtype_policy.name for l in model.layers}},
    "out_dtype": keras.backend.standardize_dtype(out.dtype),
    "out": keras.ops.convert_to_numpy(keras.ops.cast(out, "float32")).tolist(),
    "optimizer": type(opt).__module__ + "." + type(opt).__name__,
    "state": opt.state_dict(),
}}))
"""


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_save_here_load_on_every_backend(policy, tmp_path, python_on):
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
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    model.fit(x, np.ones((4, 2), np.float32), verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    here = {
        "dtypes": {layer.name: [layer.compute_dtype, layer.variable_dtype] for layer in model.layers},
        "out": keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32")),
        "state": opt.state_dict(),
    }
    assert here["state"]["scale"] == 512.0
    code = LOAD.format(path=str(path), x=json.dumps(x.tolist()))
    for backend in [BACKEND, *OTHERS]:
        proc = python_on(code, backend)
        assert proc.returncode == 0, (backend, proc.stderr[-3000:])
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["dtypes"] == here["dtypes"], backend
        assert all(name.startswith("mpx:") for name in got["policies"].values()), got["policies"]
        assert got["out_dtype"] == "float32", backend
        assert got["optimizer"] == "mpx_keras.loss_scale_optimizer.LossScaleOptimizer", backend
        assert got["state"] == here["state"], backend
        np.testing.assert_allclose(np.asarray(got["out"]), here["out"], rtol=2e-2, atol=2e-2)
