"""A 2-block Keras transformer trains under block recipes (#31) on torch, TensorFlow and JAX (how many layers: see below): apply_policy with mxfp8 and
nvfp4 turns its attention projections and MLPs into block layers, fit lowers the loss, and a step the mpx
LossScaleOptimizer skips (an inf sample weight) leaves weights and optimizer variables bit-identical (the
block layers' block_step counters advance: they count training calls, as torch's BlockLinear does)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx_keras
from mpx_keras import blocks

BACKEND = keras.config.backend()
VOCAB, SEQ, DIM = 16, 8, 16
#: Keras's torch trainer runs eagerly and quickly: the whole model's 12 Dense/EinsumDense layers run
#: block-scaled for 4 epochs.  TensorFlow runs the test eagerly (its graph of the kernels for 12 layers
#: took 106 s (mxfp8) and 212 s (nvfp4) to build and run here, eagerly 21 s and 44 s) with the second
#: block's 6 layers block-scaled for 3 epochs.  JAX's fit is jit-compiled, with the second block's MLP
#: (2 layers) block-scaled: 14 s per recipe here (XLA:CPU compiled the second block's 6 layers for 37 s,
#: mxfp8; eagerly the model ran 44-50 s with 2 layers).
OUT = {"torch": "", "tensorflow": ",@b0_*={fp8=none}", "jax": ",@b0_*={fp8=none},@b1_attn*={fp8=none}"}[BACKEND]
LAYERS = {"torch": 12, "tensorflow": 6, "jax": 2}[BACKEND]
EPOCHS = 4 if BACKEND == "torch" else 3


def _host(x):
    return np.array(keras.ops.convert_to_numpy(keras.ops.stop_gradient(x)))


def _transformer():
    inp = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, name="embed")(inp)
    for i in range(2):
        a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
        a = keras.layers.MultiHeadAttention(2, DIM // 2, name=f"b{i}_attn")(a, a, use_causal_mask=True)
        h = keras.layers.Add()([h, a])
        m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
        m = keras.layers.Dense(2 * DIM, activation="gelu", name=f"b{i}_mlp_in")(m)
        m = keras.layers.Dense(DIM, name=f"b{i}_mlp_out")(m)
        h = keras.layers.Add()([h, m])
    h = keras.layers.LayerNormalization(name="ln_f")(h)
    return keras.Model(inp, keras.layers.Dense(VOCAB, name="head")(h))


def _data():
    start = np.random.default_rng(0).integers(0, VOCAB, (16, 1))
    seqs = (start + np.arange(SEQ + 1)) % VOCAB  # next token = token + 1
    return seqs[:, :-1].astype("int32"), seqs[:, 1:].astype("int32")


@pytest.mark.parametrize("spec", ["mixed_bfloat16,fp8=mxfp8", "mixed_bfloat16,fp4=nvfp4"])
def test_a_two_block_transformer_trains_and_a_skipped_step_commits_nothing(spec):
    keras.utils.set_random_seed(0)
    spec = f"{spec},@head={{fp8=none}}" + OUT
    with mpx_keras.policy_scope(spec):
        model = _transformer()
    mpx_keras.apply_policy(model, spec)
    found = dict(blocks.block_layers(model))
    assert len(found) == LAYERS and "head" not in found  # q, k, v, o, mlp_in, mlp_out (x 2 on torch; the MLP only on JAX)
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-2), config={"kind": "dynamic"})
    model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=BACKEND != "jax")
    x, y = _data()
    losses = model.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False).history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < 0.95 * losses[0], losses
    assert opt.state.skipped_steps == 0
    weights = [_host(v.value) for v in model.trainable_variables]
    inner = [_host(v.value) for v in opt.inner_optimizer.variables]
    steps = [int(_host(layer.block_step.value)) for layer in found.values()]
    assert steps == [EPOCHS] * LAYERS
    bad = np.ones((16, SEQ), np.float32)
    bad[3, 2] = np.inf  # the loss, and every gradient, is not finite: the step is skipped
    model.fit(x, y, sample_weight=bad, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert opt.state.skipped_steps == 1
    for a, b in zip(weights, [_host(v.value) for v in model.trainable_variables], strict=True):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(inner, [_host(v.value) for v in opt.inner_optimizer.variables], strict=True):
        assert a.tobytes() == b.tobytes()
    assert [int(_host(layer.block_step.value)) for layer in found.values()] == [EPOCHS + 1] * LAYERS
