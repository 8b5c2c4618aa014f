"""Block-scaled recipes in Keras (#31), every backend: apply_policy converts Dense and EinsumDense, the
bytes and scales are the core's, the model trains, and the stateless state dict is torch's."""

import json
import pathlib

import keras
import numpy as np

import mpx_keras
from mpx.blocks import PRESETS
from mpx.kernels import blocks as kb
from mpx.kernels.array_ops import NUMPY_OPS
from mpx_keras import blocks
from mpx_keras.float8 import float8_state_dict, load_float8_state_dict

STATE_DICTS = json.loads((pathlib.Path(__file__).parents[1] / "block_state_dicts.json").read_text())


def test_apply_policy_converts_and_the_bytes_are_the_cores():
    x = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    for name in ("mxfp8", "nvfp4"):
        for axis in (0, 1):
            got = blocks.quantize(x, PRESETS[name], "input", axis)
            want = kb.quantize(NUMPY_OPS, x, PRESETS[name], "input", axis)
            assert np.array_equal(keras.ops.convert_to_numpy(got.codes), want.codes)
            assert np.array_equal(keras.ops.convert_to_numpy(got.scales), want.scales)
    inp = keras.Input((3, 40))
    h = keras.layers.EinsumDense("abc,cde->abde", (3, 2, 8), bias_axes="de", name="q")(inp)
    h = keras.layers.EinsumDense("abcd,cde->abe", (3, 5), name="o")(h)
    model = keras.Model(inp, keras.layers.Dense(4, name="head")(h))
    mpx_keras.apply_policy(model, "mixed_bfloat16,fp4=nvfp4,@head={fp4=none}")
    kinds = [type(layer).__name__ for layer in model.layers[1:]]
    assert kinds == ["BlockEinsumDense", "BlockEinsumDense", "Dense"]
    model.compile(mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    xx = np.random.default_rng(1).standard_normal((16, 3, 40)).astype(np.float32)
    yy = np.random.default_rng(2).standard_normal((16, 3, 4)).astype(np.float32)
    losses = model.fit(xx, yy, batch_size=8, epochs=3, verbose=0).history["loss"]
    assert losses[-1] < losses[0], losses
    d = float8_state_dict(model)
    assert json.loads(json.dumps(d)) == STATE_DICTS["nvfp4"]  # the dict mpx_torch writes
    load_float8_state_dict(model, STATE_DICTS["nvfp4"])
    mpx_keras.apply_policy(model, "mixed_bfloat16")
    assert [type(layer).__name__ for layer in model.layers[1:]] == ["EinsumDense", "EinsumDense", "Dense"]
