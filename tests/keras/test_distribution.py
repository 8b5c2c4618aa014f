"""mpx_keras with keras.distribution on JAX (4 host devices, in a subprocess): DataParallel fit trains, and a
non-finite gradient on one shard only makes every replica skip alike, every replica's state bit-identical;
ModelParallel with both Dense kernels sharded over the model axis reduces the FP8 amaxes across the batch
shards and skips a step with an inf in one batch shard, only the scaler's state moving; accumulation and
save/load keep their single-device semantics."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.config.backend() != "jax",
    reason="keras.distribution is JAX-only in Keras 3 (no TF or torch engine)",
)


def _run(script: str) -> None:
    """Run ``script`` in a Python of its own, Keras on JAX over 4 host devices; it prints OK when every
    assert held."""
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]

SCRIPT = textwrap.dedent(
    """
    import functools
    import jax
    import keras
    import numpy as np
    import mpx
    import mpx_keras

    assert len(jax.devices()) == 4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    config = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2, hysteresis=2)
    flags = [True, False, True, True]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * len(flags), 3)).astype("float32")
    y = rng.normal(size=(8 * len(flags), 1)).astype("float32")
    for i, finite in enumerate(flags):
        if not finite:
            x[i * 8] = np.inf  # row 0 of the batch: the first device's shard only
    with mpx_keras.policy_scope("mixed_float16"):
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    before = [np.array(v.value) for v in m.trainable_variables]
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), config)
    m.compile(optimizer=opt, loss="mse")
    m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    ref = functools.reduce(lambda s, f: mpx.scaler_update(config, s, f), flags, mpx.scaler_init(config))
    assert opt.state == ref, (opt.state, ref)
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == flags.count(True)
    assert any(not np.array_equal(b, np.array(v.value)) for b, v in zip(before, m.trainable_variables))
    for v in list(m.variables) + list(opt.variables):
        shards = [np.asarray(s.data) for s in v.value.addressable_shards]
        assert len(shards) == 4, v.path
        for s in shards[1:]:
            assert s.tobytes() == shards[0].tobytes(), v.path
    print("OK")
    """
)


def test_data_parallel_skips_alike_on_every_replica():
    _run(SCRIPT)


MODEL_PARALLEL = textwrap.dedent(
    """
    import jax
    import keras
    import numpy as np
    import mpx_keras
    from mpx_keras import float8 as kf8

    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*fc.*kernel"] = (None, "model")  # LayoutMap keys are full matches of the variable's path
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    spec = "mixed_bfloat16,fp8=hybrid,fp8_history=4"
    with mpx_keras.policy_scope(spec):
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc1"), keras.layers.Dense(4, name="fc2")])
    m = mpx_keras.apply_policy(m, spec)
    for layer in m.layers:
        assert layer.kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model"), layer.name
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-2), config={"kind": "dynamic", "init_scale": 256.0})
    m.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    x[8] *= 50.0  # the last batch: its largest amax sits in its first batch shard only
    y = rng.normal(size=(16, 4)).astype("float32")
    m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert opt.state.steps == 2 and opt.state.skipped_steps == 0
    fp8 = [var for _, layer in kf8.float8_layers(m) for _, _, var in layer.fp8_variables()]
    assert fp8
    for var in fp8:
        shards = [np.asarray(s.data) for s in var.value.addressable_shards]
        assert len(shards) == 4
        for s in shards[1:]:
            assert s.tobytes() == shards[0].tobytes()
    hist = kf8.float8_state_dict(m)["tensors"]["fc1.input"]
    a_in = float(np.abs(x[8:].astype(jax.numpy.bfloat16).astype(np.float32)).max())
    assert float(np.asarray(hist["amax_history"]).reshape(-1)[0]) == np.float32(a_in), hist
    # a skipped step: an inf in one batch shard's rows; weights, optimizer and FP8 state stay bit-identical
    every = list(m.variables) + list(opt.variables)
    state = [np.asarray(v.value).tobytes() for v in every]
    bad = x[:8].copy()
    bad[5] = np.inf  # the second batch shard's rows only
    m.fit(bad, y[:8], batch_size=8, shuffle=False, verbose=0)
    assert opt.state.steps == 3 and opt.state.skipped_steps == 1, opt.state
    moved = [v.path for v, b in zip(every, state) if np.asarray(v.value).tobytes() != b]
    assert moved and all(p.startswith("loss_scale_optimizer/") for p in moved), moved  # the scaler's state only
    for layer in m.layers:
        assert layer.kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model"), layer.name
    print("OK")
    """
)


def test_model_parallel_fp8_amaxes_are_reduced_across_the_batch_shards_and_a_skip_moves_only_the_scaler():
    _run(MODEL_PARALLEL)


ACCUMULATION = textwrap.dedent(
    """
    import jax
    import keras
    import numpy as np
    import mpx
    import mpx_keras

    config = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=2, hysteresis=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    x[8] = np.inf  # one shard of micro-batch 2
    y = x[:, :3] * 0.5

    def run(distribution):
        keras.utils.set_random_seed(0)
        with distribution.scope() if distribution else __import__("contextlib").nullcontext():
            m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            opt = mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), config)
            m.compile(optimizer=opt, loss="mse")
            m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return m, opt

    m1, o1 = run(None)
    m4, o4 = run(keras.distribution.DataParallel(devices=jax.devices()))
    assert o4.state == o1.state and o1.state.skipped_steps >= 1, (o4.state, o1.state)
    assert int(keras.ops.convert_to_numpy(o4.iterations)) == int(keras.ops.convert_to_numpy(o1.iterations))
    for a, b in zip(m1.variables, m4.variables):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), rtol=1e-6, atol=1e-7)
    for v in list(m4.variables) + list(o4.variables):
        shards = [np.asarray(s.data) for s in v.value.addressable_shards]
        assert all(s.tobytes() == shards[0].tobytes() for s in shards), v.path
    print("OK")
    """
)


def test_gradient_accumulation_keeps_the_single_device_semantics():
    _run(ACCUMULATION)


SAVE_LOAD = textwrap.dedent(
    """
    import os, sys, tempfile
    import jax
    import keras
    import numpy as np
    import mpx
    import mpx_keras

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = x[:, :3] * 0.5
    with mpx_keras.policy_scope("mixed_float16"):
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), mpx.ScalerConfig(init_scale=2.0**10, growth_interval=1))
    m.compile(optimizer=opt, loss="mse")
    m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    d = tempfile.mkdtemp()
    m.save(os.path.join(d, "m.keras"))
    m.save_weights(os.path.join(d, "m.weights.h5"))
    r = keras.models.load_model(os.path.join(d, "m.keras"))
    assert r.optimizer.state == opt.state, (r.optimizer.state, opt.state)
    for a, b in zip(m.variables, r.variables):
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes()
    m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    r.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert r.optimizer.state == opt.state
    for a, b in zip(m.variables, r.variables):
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes()
    r.load_weights(os.path.join(d, "m.weights.h5"))
    print("OK")
    """
)


def test_save_and_load_resume_under_data_parallel():
    _run(SAVE_LOAD)
