"""mpx_jax FP8 on 4 devices (a subprocess): under shard_map the amaxes are MAX-reduced over the data axis
and the scales every device commits are bit-identical to each other and to the core's chain
(mpx.float8.float8_update over the global amaxes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import mpx
    import mpx.float8 as core
    import mpx_jax.float8 as f8

    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()), ("data",))
    recipe = mpx.get_policy("mixed_bfloat16,fp8=hybrid,fp8_history=4").fp8
    roles = {"x": "input"}
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(3)]
    for i, x in enumerate(steps):
        x[2 * i] *= 40.0  # the largest |x| of each step sits on one device's shard only

    def local(state, x):
        amaxes = f8.reduce_amaxes({"x": f8.amax(x)}, "data")
        return f8.float8_update(recipe, state, amaxes)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False))
    state = f8.float8_init(recipe, roles)
    ref = core.float8_init(recipe, roles)
    for x in steps:
        state = step(state, jax.device_put(x, NamedSharding(mesh, P("data"))))
        ref = core.float8_update(recipe, ref, {"x": np.float32(np.abs(x).max())})
    for field in ("scale", "amax_history"):
        got, want = getattr(state.tensors["x"], field), np.asarray(getattr(ref.tensors["x"], field), np.float32)
        assert float(np.asarray(getattr(ref.tensors["x"], field)).reshape(-1)[0]) == float(want.reshape(-1)[0])
        shards = [np.asarray(s.data) for s in got.addressable_shards]
        assert len(shards) == 4
        for s in shards:
            assert s.dtype == np.float32 and s.tobytes() == want.tobytes(), (field, s, want)
    print("OK")
    """
)


def test_shard_map_scales_equal_on_every_device_and_the_core():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]
