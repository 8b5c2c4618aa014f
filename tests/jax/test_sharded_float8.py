"""mpx_jax FP8 on 4 devices (a subprocess): under shard_map the amaxes are MAX-reduced over the data axis,
and under jax.jit with NamedSharding (a 2x2 data x model mesh, the NNX kernel annotated with
nnx.with_partitioning, the linen kernel placed with device_put) the global amaxes are what XLA reduces;
either way the scales every device commits are bit-identical to each other and to the core's chain
(mpx.float8.float8_update with numpy over the global batch's amaxes), a skipped step commits nothing, and
autocast's current-scaling FP8 product under sharding is the unsharded one bit for bit."""

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


#: jit with NamedSharding: NNX Float8Linear, linen Float8Dense (one layer each: the gradient amax is
#: max|c| * loss scale, exact), autocast.
NAMED = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import mpx
    import mpx.float8 as core
    from mpx_jax import autocast, get_loss_scale, with_loss_scaling
    from mpx_jax.float8_flax import FLOAT8_GRADS, Float8Linear, float8_step
    from mpx_jax.float8_linen import Float8Dense, commit_float8, step_outcome

    assert jax.device_count() == 4
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    REP, ROWS = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    RECIPE = mpx.Float8Recipe(amax_history_len=4)
    CFG = mpx.ScalerConfig(init_scale=2.0**4, growth_interval=2)
    ROLES = {"input": "input", "weight": "weight", "grad": "grad"}
    B, K, N = 8, 8, 16

    def data(step):
        rng = np.random.default_rng(step)
        x = rng.standard_normal((B, K)).astype(np.float32)
        x[(2 * step + 5) % B, step % K] = 30.0 + step  # the largest |x| on one data shard
        c = rng.standard_normal((B, N)).astype(np.float32)
        return x, c

    FLAGS = [True, True, False, True, True]

    def reference(kernels, scales, flags, xs, cs):
        ref = core.float8_init(RECIPE, ROLES)
        out = []
        for w, s, ok, x, c in zip(kernels, scales, flags, xs, cs, strict=True):
            am = {"input": np.float32(np.abs(x).max()), "weight": np.float32(np.abs(w).max()),
                  "grad": np.float32(np.abs(c).max() * s)}
            ref = core.float8_update(RECIPE, ref, am, skipped=not ok)
            out.append((np.asarray([ref.tensors[r].scale for r in ("input", "weight", "grad")], np.float32),
                        np.asarray([ref.tensors[r].amax_history for r in ("input", "weight", "grad")], np.float32)))
        return out

    def check(name, arr, want):
        assert arr.sharding.is_fully_replicated, (name, arr.sharding)
        shards = [np.asarray(s.data) for s in arr.addressable_shards]
        assert len(shards) == 4
        for s in shards:
            assert s.dtype == np.float32 and s.tobytes() == want.tobytes(), (name, s, want)

    # -- NNX: nnx.with_partitioning on the kernel, nnx.shard-style creation under the mesh
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l = Float8Linear(K, N, recipe=RECIPE, rngs=rngs,
                                  kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")))

    @nnx.jit
    def create():
        model = Net(nnx.Rngs(0))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        model = create()
    assert model.l.kernel[...].sharding.spec == P(None, "model")
    opt = nnx.Optimizer(model, with_loss_scaling(optax.sgd(1e-3), CFG), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, opt, x, c):
        sc = get_loss_scale(opt)
        grads = nnx.grad(lambda m: sc.scale(jnp.sum(m.l(x) * c)), argnums=FLOAT8_GRADS)(model)
        float8_step(opt, model, grads)

    kernels, lscales, xs, cs = [], [], [], []
    got = []
    for i, ok in enumerate(FLAGS):
        x, c = data(i)
        if not ok:
            c[B - 1, 0] = np.inf  # the last data shard's cotangent
        kernels.append(np.asarray(model.l.kernel[...]))
        lscales.append(float(get_loss_scale(opt).loss_scale))
        xs.append(x)
        cs.append(c)
        with jax.set_mesh(mesh):
            nnx_step(model, opt, jax.device_put(x, ROWS), jax.device_put(c, ROWS))
        got.append((model.l.fp8_scale[...], model.l.fp8_history[...]))
    assert model.l.kernel[...].sharding.spec == P(None, "model")  # the step kept the layout
    for (gs, gh), (ws, wh) in zip(got, reference(kernels, lscales, FLAGS, xs, cs), strict=True):
        check("nnx scale", gs, ws)
        check("nnx history", gh, wh)
    assert lscales == [16.0, 16.0, 32.0, 16.0, 16.0], lscales  # grew, skipped (backed off), grew back

    # -- linen: the kernel placed with a NamedSharding, the fp8 collections replicated
    layer = Float8Dense(N, RECIPE, use_bias=False)
    v = layer.init(jax.random.key(0), jnp.ones((2, K)))
    params = jax.device_put(v["params"], {"kernel": NamedSharding(mesh, P(None, "model"))})
    fp8, sinks = jax.device_put(v["fp8"], REP), jax.device_put(v["fp8_amax"], REP)
    tx = with_loss_scaling(optax.sgd(1e-3), CFG)
    opt_state = jax.device_put(tx.init(params), REP)

    @jax.jit
    def linen_step(params, fp8, sinks, opt_state, x, c):
        sc = get_loss_scale(opt_state)
        loss = lambda p, s: sc.scale(jnp.sum(layer.apply({"params": p, "fp8": fp8, "fp8_amax": s}, x) * c))
        gp, ga = jax.grad(loss, argnums=(0, 1))(params, sinks)
        updates, new_opt = tx.update(gp, opt_state, params)
        boundary, applied = step_outcome(opt_state, new_opt)
        return optax.apply_updates(params, updates), commit_float8(RECIPE, fp8, ga, boundary=boundary, applied=applied), new_opt

    kernels, lscales, got = [], [], []
    for x, c in zip(xs, cs, strict=True):
        kernels.append(np.asarray(params["kernel"]))
        lscales.append(float(get_loss_scale(opt_state).loss_scale))
        params, fp8, opt_state = linen_step(params, fp8, sinks, opt_state, jax.device_put(x, ROWS), jax.device_put(c, ROWS))
        got.append((fp8["scale"], fp8["history"]))
    for (gs, gh), (ws, wh) in zip(got, reference(kernels, lscales, FLAGS, xs, cs), strict=True):
        check("linen scale", gs, ws)
        check("linen history", gh, wh)
    assert params["kernel"].sharding.spec == P(None, "model")

    # -- autocast (current scaling): the sharded product is the unsharded one, bit for bit
    f = jax.jit(autocast(lambda x, w: x @ w, "float32,fp8=hybrid,fp8_scaling=current"))
    x, _ = data(7)
    w = np.random.default_rng(9).standard_normal((K, N)).astype(np.float32)
    w[1, 13] = -9.0  # the largest |w| on one model shard
    one = np.asarray(f(x, w))
    y = f(jax.device_put(x, ROWS), jax.device_put(w, NamedSharding(mesh, P(None, "model"))))
    assert np.asarray(y).tobytes() == one.tobytes()
    sx = core.compute_scale(mpx.Float8Recipe(scaling="current"), float(np.abs(x).max()), "e4m3")
    sw = core.compute_scale(mpx.Float8Recipe(scaling="current"), float(np.abs(w).max()), "e4m3")
    ref = core.fp8_dot(x, w, sx, sw)
    qa, qb = (np.abs(core.quantize(a, s, "e4m3").astype(np.float32)) for a, s in ((x, sx), (w, sw)))
    bound = (4 * K + 4) * 2.0**-23 * (qa @ qb) * core.scale_inv(sx) * core.scale_inv(sw)  # docs/fp8.md
    assert np.all(np.abs(np.asarray(y) - ref) <= bound)
    print("OK")
    """
)


def _run(script: str) -> None:
    """Run ``script`` in a Python of its own with 4 JAX host devices; it prints OK when every assert held."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-4000:]


def test_shard_map_scales_equal_on_every_device_and_the_core():
    _run(SCRIPT)


def test_named_sharding_nnx_linen_and_autocast_scales_equal_on_every_device_and_the_core():
    _run(NAMED)
