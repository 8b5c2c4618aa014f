"""FP8 checkpoints cross frameworks (#26): torch -> JAX -> Keras -> JAX -> torch, each in its own process.

Each process loads the previous one's ``mpx.float8/1`` JSON into its own FP8 model (torch
``Float8Linear`` modules, Flax NNX ``Float8Linear`` modules, Keras ``Float8Dense`` layers, all at paths
``fc1`` and ``fc2``), takes one step of its own FP8 update with the same amaxes (spikes, a zero, an inf),
and writes the state back.  Every file equals the core's :func:`mpx.float8.float8_update` chain, so a
scale saved in one framework resumes in every other bit for bit.  No framework is imported here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpx
from mpx import float8 as core

ROOT = Path(__file__).resolve().parents[2]
POLICY = "mixed_bfloat16,fp8=hybrid,fp8_history=4"
NAMES = [f"{layer}.{role}" for layer in ("fc1", "fc2") for role in core.ROLES]
#: per step, the amaxes every framework observes (float32 values; a zero and an inf among them)
STEPS = [
    dict(zip(NAMES, (2.0, 0.5, 1e4, 3.0, 0.25, 0.0), strict=True)),
    dict(zip(NAMES, (2.5, 0.5, float("inf"), 1e-3, 0.3, 2.0**-20), strict=True)),
    dict(zip(NAMES, (100.0, 0.4, 3e4, 2.0, 0.2, 5.0), strict=True)),
    dict(zip(NAMES, (1.0, 0.45, 7.0, 2.0, 0.1, 1e-30), strict=True)),
    dict(zip(NAMES, (0.0, 0.5, 9.0, 4.0, 0.1, 6.0), strict=True)),
]

PRELUDE = """
import json, math, sys
POLICY, IN, OUT, AMAXES = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
AMAXES = {k: float(v) for k, v in AMAXES.items()}
state_in = None if IN == "-" else json.load(open(IN))
"""

TORCH = (
    PRELUDE
    + """
import torch
from mpx_torch import float8
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
model = float8.convert(Net(), POLICY)
if state_in is not None:
    float8.load_float8_state_dict(model, state_in)
for path, module in float8.float8_layers(model):
    module.fp8_amax.copy_(torch.tensor([AMAXES[f"{path}.{r}"] for r in ("input", "weight", "grad")]))
float8.commit_float8(model)
json.dump(float8.float8_state_dict(model), open(OUT, "w"))
"""
)

JAX = (
    PRELUDE
    + """
from flax import nnx
import mpx
from mpx_jax import float8 as f8
from mpx_jax.float8_flax import Float8Linear, float8_state_dict, load_float8_state_dict
recipe = mpx.get_policy(POLICY).fp8
class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = Float8Linear(4, 6, recipe=recipe, rngs=rngs)
        self.fc2 = Float8Linear(6, 3, recipe=recipe, rngs=rngs)
model = Net(nnx.Rngs(0))
if state_in is not None:
    load_float8_state_dict(model, state_in)
import jax.numpy as jnp
r, host = mpx.float8.load_state_dict(float8_state_dict(model))
state = mpx.float8.Float8State({name: mpx.float8.TensorScale(ts.role, jnp.float32(ts.scale),
                                jnp.asarray(ts.amax_history, jnp.float32)) for name, ts in host.tensors.items()})
state = f8.float8_update(r, state, AMAXES)  # JAX arrays, the kernels with JAX's table
load_float8_state_dict(model, mpx.float8.state_dict(r, state))
json.dump(float8_state_dict(model), open(OUT, "w"))
"""
)

KERAS = (
    PRELUDE
    + """
import keras, mpx_keras
from mpx.kernels import float8 as kf
from mpx_keras import float8
from mpx_keras._array_ops import KERAS_ARRAY_OPS
with mpx_keras.policy_scope(POLICY):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, name="fc1"), keras.layers.Dense(3, name="fc2")])
mpx_keras.apply_policy(model, POLICY)
if state_in is not None:
    float8.load_float8_state_dict(model, state_in)
sd = float8.float8_state_dict(model)
for name, ts in sd["tensors"].items():  # one step of the update with the keras.ops table, per tensor
    recipe = model.layers[0].fp8_recipe
    history = keras.ops.convert_to_tensor(ts["amax_history"], "float32")
    s, h = kf.update_tensor(KERAS_ARRAY_OPS, recipe, ts["role"], ts["scale"], history, AMAXES[name])
    ts["scale"] = float(keras.ops.convert_to_numpy(s))
    ts["amax_history"] = [float(v) for v in keras.ops.convert_to_numpy(h)]
float8.load_float8_state_dict(model, sd)
json.dump(float8.float8_state_dict(model), open(OUT, "w"))
"""
)

SCRIPTS = {"torch": (TORCH, "torch"), "jax": (JAX, "flax"), "keras": (KERAS, "keras")}


def _run(framework: str, state_in: Path | None, out: Path, amaxes: dict[str, float]) -> dict:
    code, module = SCRIPTS[framework]
    if importlib.util.find_spec(module) is None:  # pragma: no cover
        pytest.skip(f"{module} is not installed")
    env = {
        **os.environ,
        "KERAS_BACKEND": "tensorflow",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "MPX_NO_SLOW_WARNING": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            POLICY,
            str(state_in) if state_in else "-",
            str(out),
            json.dumps(amaxes),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang detector only
    )
    assert done.returncode == 0, f"{framework}:\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_float8_checkpoint_torch_jax_keras_and_back(tmp_path):
    recipe = mpx.get_policy(POLICY).fp8
    reference = core.float8_init(recipe, {name: name.rsplit(".", 1)[1] for name in NAMES})
    previous = None
    for i, (framework, amaxes) in enumerate(
        zip(("torch", "jax", "keras", "jax", "torch"), STEPS, strict=True)
    ):
        out = tmp_path / f"{i}_{framework}.json"
        got = _run(framework, previous, out, amaxes)
        reference = core.float8_update(recipe, reference, amaxes)
        assert got == core.state_dict(recipe, reference), f"step {i} ({framework})"
        previous = out
    final = json.loads(previous.read_text())
    assert final["tensors"]["fc1.grad"]["amax_history"] == [9.0, 7.0, 3e4, 1e4]  # step 2's inf not recorded
    assert core.load_state_dict(final)[1] == reference
