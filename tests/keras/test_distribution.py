"""mpx_keras with keras.distribution on JAX (4 host devices, in a subprocess): DataParallel fit trains, and a
non-finite gradient on one shard only makes every replica skip alike, every replica's state bit-identical."""

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
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]
