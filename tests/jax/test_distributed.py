"""Replicas agree: jit + NamedSharding and shard_map over 4 host devices, in one subprocess.

The subprocess (XLA_FLAGS=--xla_force_host_platform_device_count=4) runs every
scenario and prints one JSON dict; the tests below read it.  An inf is injected
on one shard only, (a) in the loss and (b) in the gradients (under shard_map
after the pmean), and each run returns the parameters and the loss scale of
every shard after every step.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import mpx

SCRIPT = textwrap.dedent(
    r'''
    import json, re
    import jax, jax.numpy as jnp, numpy as np, optax, mpx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mpx_jax import all_finite, all_reduce_gradients, get_loss_scale, select_tree, with_loss_scaling
    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("dp",))
    CFG = mpx.ScalerConfig(init_scale=2.0**10, growth_interval=1)
    STEPS, BAD = 4, 1            # the inf appears at step 1 (micro-batch 1), on shard 1 only
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
    W0 = {"w": jnp.asarray(rng.standard_normal((3,)), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    out = {}

    def loss_fn(p, x, poison):
        # sqrt(|x . w|) of a zero row x is a finite 0 with a non-finite gradient
        return jnp.mean(jnp.sqrt(jnp.abs(x @ p["w"])) * poison) + p["b"] ** 2

    def bits(x):
        return np.asarray(x).view(np.uint32).tolist()

    # -- jit + NamedSharding: the global array decides ----------------------------------------------
    xs = jax.device_put(X, NamedSharding(mesh, P("dp")))
    rep = NamedSharding(mesh, P())
    for case in ("loss", "grad"):
        tx = with_loss_scaling(optax.sgd(0.1), CFG)
        p = jax.device_put(W0, rep)
        s = jax.device_put(tx.init(W0), rep)

        @jax.jit
        def step(p, s, x, poison):
            ls = get_loss_scale(s)
            g = jax.grad(lambda p: ls.scale(loss_fn(p, x, poison)))(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        trace, shards = [], []
        for t in range(STEPS):
            x, poison = xs, 1.0
            if t == BAD and case == "loss":   # rows 2-3 live on device 1
                x = jax.device_put(X.at[2, 0].set(jnp.inf), NamedSharding(mesh, P("dp")))
            if t == BAD and case == "grad":   # a zero row on device 1: finite loss, non-finite gradient
                x = jax.device_put(X.at[2].set(0.0), NamedSharding(mesh, P("dp")))
            p, s = step(p, s, x, poison)
            trace.append(float(get_loss_scale(s).loss_scale))
            shards.append(sorted({str(bits(sh.data)) for sh in p["w"].addressable_shards}))
        out[f"jit/{case}"] = {"trace": trace, "distinct_param_shards": max(len(x) for x in shards)}

    # -- shard_map: per-shard code ---------------------------------------------------------------------
    def shard_step(kind, case, axis_name=None, policy=None):
        tx = {"mpx": lambda: with_loss_scaling(optax.sgd(0.1), CFG, axis_name=axis_name),
              "apply_if_finite": lambda: optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5),
              "jmp": lambda: optax.sgd(0.1)}[kind]()

        def body(p, s, ls_native, x, bad):
            me = jax.lax.axis_index("dp")
            poison = jnp.where(jnp.logical_and(bad, me == 1), jnp.inf, 1.0) if case == "loss" else 1.0
            scale = get_loss_scale(s).loss_scale if kind == "mpx" else ls_native
            g = jax.grad(lambda p: loss_fn(p, x, poison) * scale)(p)
            g = all_reduce_gradients(g, "dp", policy)
            if case == "grad":    # after the reduction, on shard 1 only
                g = jax.tree.map(lambda v: jnp.where(jnp.logical_and(bad, me == 1), jnp.inf, v), g)
            if kind == "mpx":
                u, s = tx.update(g, s, p)
                new_ls = get_loss_scale(s).loss_scale
            elif kind == "apply_if_finite":
                u, s = tx.update(jax.tree.map(lambda v: v / scale, g), s, p)
                new_ls = scale
            else:                 # jmp-style: all_finite of this shard's gradients, select, adjust
                fin = all_finite(g)
                u, s2 = tx.update(jax.tree.map(lambda v: v / scale, g), s, p)
                u = select_tree(fin, u, jax.tree.map(jnp.zeros_like, u))
                new_ls = jnp.where(fin, scale * 2, scale / 2)
            p = optax.apply_updates(p, u)
            stack = lambda t: jax.tree.map(lambda v: v[None], t)
            return stack(p), stack(s), new_ls[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P("dp"), P()),
                                  out_specs=(P("dp"), P("dp"), P("dp"))))
        p, s, ls = W0, tx.init(W0), jnp.float32(CFG.init_scale)
        traces, distinct = [], 0
        for t in range(STEPS):
            ps, ss, lss = f(p, s, ls, xs, jnp.asarray(t == BAD))
            traces.append([float(v) for v in lss])
            rows = {str(bits(r)) for r in np.asarray(ps["w"])}
            distinct = max(distinct, len(rows))
            p, s, ls = (jax.tree.map(lambda v: jnp.asarray(np.asarray(v)[0]), t_) for t_ in (ps, ss, lss))  # continue from shard 0
        return {"traces": traces, "distinct_param_shards": distinct}

    for case in ("loss", "grad"):
        out[f"shard_map/{case}/mpx"] = shard_step("mpx", case)
        out[f"shard_map/{case}/mpx_axis_name"] = shard_step("mpx", case, axis_name="dp")
        out[f"shard_map/{case}/apply_if_finite"] = shard_step("apply_if_finite", case)
        out[f"shard_map/{case}/jmp"] = shard_step("jmp", case)

    # -- shard_map with accumulate=2: one bad micro-batch on one shard skips the window everywhere ----
    K, FLAGS = 2, [True, True, True, False, True, True]
    tx = with_loss_scaling(optax.sgd(0.1), CFG, accumulate=K)

    def acc_body(p, s, x, bad):
        me = jax.lax.axis_index("dp")
        g = jax.grad(lambda p: get_loss_scale(s).scale(loss_fn(p, x, 1.0)))(p)
        g = all_reduce_gradients(g, "dp")
        g = jax.tree.map(lambda v: jnp.where(jnp.logical_and(bad, me == 1), jnp.inf, v), g)
        u, s = tx.update(g, s, p)
        stack = lambda t: jax.tree.map(lambda v: v[None], t)
        return stack(optax.apply_updates(p, u)), stack(s)

    f = jax.jit(jax.shard_map(acc_body, mesh=mesh, in_specs=(P(), P(), P("dp"), P()), out_specs=(P("dp"), P("dp"))))
    p, s = W0, tx.init(W0)
    windows, distinct = [], 0
    for i, fin in enumerate(FLAGS):
        before = np.asarray(p["w"]).tobytes()
        ps, ss = f(p, s, xs, jnp.asarray(not fin))
        distinct = max(distinct, len({r.tobytes() for r in np.asarray(ps["w"])}))
        p, s = (jax.tree.map(lambda v: jnp.asarray(np.asarray(v)[0]), t_) for t_ in (ps, ss))
        if i % K == K - 1:
            scales = sorted({float(v) for v in np.asarray(get_loss_scale(ss).loss_scale)})
            windows.append({"applied": np.asarray(p["w"]).tobytes() != before_window, "scales": scales})
        if i % K == 0:
            before_window = before
    out["shard_map/accumulate"] = {"windows": windows, "distinct_param_shards": distinct, "flags": FLAGS, "k": K}

    # -- pmap without an axis name, and shard_map manual over one axis of two --------------------------
    tx = with_loss_scaling(optax.sgd(1.0), CFG)
    p1, s1 = {"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)})
    four = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 4), t)
    g = {"w": jnp.array([[1.0, 1.0], [jnp.inf, 1.0], [1.0, 1.0], [1.0, 1.0]]) * 2.0**10}
    _, st = jax.pmap(tx.update)(g, four(s1), four(p1))
    out["pmap_unnamed"] = [float(v) for v in get_loss_scale(st).loss_scale]
    mesh2 = jax.make_mesh((2, 2), ("a", "b"))

    def part(g, s, p):
        g = jax.tree.map(lambda v: jnp.where(jax.lax.axis_index("a") == 1, jnp.inf, v)[0], g)
        _, s = tx.update(g, s, p)
        return get_loss_scale(s).loss_scale[None]

    g2 = {"w": jax.device_put(jnp.ones((2, 2)), NamedSharding(mesh2, P("a")))}
    f = jax.jit(jax.shard_map(part, mesh=mesh2, in_specs=(P("a"), P(), P()), out_specs=P("a"), axis_names={"a"}))
    out["shard_map_partial"] = [float(v) for v in f(g2, s1, p1)]

    # -- the reduce dtype: the all-reduce's element type in the compiled HLO ---------------------------
    def ar_types(fn, *args):  # element types of the all-reduces XLA compiled
        txt = jax.jit(fn).lower(*args).compile().as_text()
        return sorted(set(re.findall(r"= (\w+)\[[^\]]*\]\S* all-reduce\(", txt)))

    def ar_types_lowered(fn, *args):  # element types of the all-reduces JAX emitted (StableHLO)
        txt = jax.jit(fn).lower(*args).as_text()
        return sorted(set(re.findall(r"stablehlo.all_reduce.*?\}\) : \(tensor<(?:\d+x)*(\w+)>\)", txt, re.S)))

    def reduced(policy):
        def body(x):
            g = {"w": x[0]}
            r = all_reduce_gradients(g, None, policy)
            return r["w"][None]
        return jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))

    xg = jax.device_put(jnp.asarray(rng.standard_normal((4, 5)), jnp.float32) * 3, NamedSharding(mesh, P("dp")))
    bf = "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"
    r16 = np.asarray(jax.jit(reduced(bf))(xg))
    mean = np.asarray(xg).mean(0)
    out["reduce"] = {
        "shard_map_f32": ar_types(reduced(None), xg),
        "shard_map_bf16": ar_types(reduced(bf), xg),
        "shard_map_f32_lowered": ar_types_lowered(reduced(None), xg),
        "shard_map_bf16_lowered": ar_types_lowered(reduced(bf), xg),
        "bf16_result_dtype": str(r16.dtype),
        "bf16_rows_equal": bool(all(np.array_equal(r, r16[0]) for r in r16)),
        "bf16_is_rounded": bool(np.array_equal(r16[0].astype(jnp.bfloat16).astype(np.float32), r16[0])),
        "bf16_close": bool(np.allclose(r16[0], mean, rtol=2**-6, atol=2**-6)),
        "f32_exact_mean_close": bool(np.allclose(np.asarray(jax.jit(reduced(None))(xg))[0], mean, rtol=1e-6)),
    }
    w = jax.device_put(jnp.ones((3, 2)), rep)
    with jax.set_mesh(mesh):
        for cdt in ("float32", "bfloat16"):
            lf = lambda w, x: jnp.mean((x.astype(cdt) @ w.astype(cdt)).astype(jnp.float32) ** 2)
            out[f"reduce"][f"jit_{cdt}_compute"] = ar_types(jax.grad(lf), w, xs)
            out[f"reduce"][f"jit_{cdt}_compute_grads_cast_bf16"] = ar_types(
                lambda w, x: jax.grad(lf)(w, x).astype(jnp.bfloat16), w, xs)
    print("RESULT " + json.dumps(out))
    '''
)


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    # the timeout only catches a hang: about 10 s on a quiet machine, never near this on a loaded one
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def expected_trace(bad_step=1, steps=4):
    scaler = mpx.LossScaler(mpx.ScalerConfig(init_scale=2.0**10, growth_interval=1))
    trace = []
    for t in range(steps):
        scaler.update(t != bad_step)
        trace.append(scaler.get_scale())
    return trace


@pytest.mark.parametrize("case", ["loss", "grad"])
def test_jit_named_sharding_every_shard_agrees(result, case):
    r = result[f"jit/{case}"]
    assert r["trace"] == expected_trace()
    assert r["distinct_param_shards"] == 1


@pytest.mark.parametrize("spelling", ["mpx", "mpx_axis_name"])
@pytest.mark.parametrize("case", ["loss", "grad"])
def test_shard_map_every_shard_skips_with_or_without_axis_name(result, case, spelling):
    r = result[f"shard_map/{case}/{spelling}"]
    assert r["traces"] == [[s] * 4 for s in expected_trace()]
    assert r["distinct_param_shards"] == 1  # bitwise identical on every shard, every step


def test_native_inf_in_the_loss_reaches_every_shard_through_the_pmean(result):
    # recorded native behaviour: the pmean spreads the inf, so per-shard checks agree
    for kind in ("apply_if_finite", "jmp"):
        assert result[f"shard_map/loss/{kind}"]["distinct_param_shards"] == 1


def test_native_inf_after_the_pmean_makes_shards_diverge(result):
    # recorded native behaviour: optax.apply_if_finite and a jmp-style check decide per shard
    for kind in ("apply_if_finite", "jmp"):
        assert result[f"shard_map/grad/{kind}"]["distinct_param_shards"] == 2
    jmp = result["shard_map/grad/jmp"]["traces"]
    assert jmp[1] == [2.0**12, 2.0**10, 2.0**12, 2.0**12]  # shard 1 backs off alone


def test_pmap_without_a_name_and_partial_shard_map_agree(result):
    assert result["pmap_unnamed"] == [2.0**9] * 4  # the mapped axis is found even unnamed
    assert result["shard_map_partial"] == [2.0**9] * 2  # manual over "a" only: reduced over "a"


def test_shard_map_accumulation_skips_the_window_on_every_shard(result):
    r = result["shard_map/accumulate"]
    ref = mpx.accumulation_trace(mpx.ScalerConfig(init_scale=2.0**10, growth_interval=1), r["flags"], r["k"])
    assert [{"applied": w["applied"], "scale": w["scales"][0]} for w in r["windows"]] == ref
    assert all(len(w["scales"]) == 1 for w in r["windows"])
    assert r["distinct_param_shards"] == 1


def test_reduce_dtype_sets_the_shard_map_all_reduce(result):
    r = result["reduce"]
    # JAX emits the all-reduce in the reduce dtype; XLA:CPU promotes a bf16 all-reduce to f32
    # (region "_promoted", values rounded to bf16 before and after), accelerators keep it
    assert r["shard_map_f32_lowered"] == ["f32"] and r["shard_map_bf16_lowered"] == ["bf16"]
    assert r["shard_map_f32"] == ["f32"] and r["shard_map_bf16"] == ["f32"]
    assert r["bf16_result_dtype"] == "float32" and r["bf16_rows_equal"]
    assert r["bf16_is_rounded"] and r["bf16_close"] and r["f32_exact_mean_close"]


def test_jit_sharding_all_reduce_dtype_is_xlas(result):
    # recorded native behaviour (XLA:CPU): the implicit all-reduce is float32 whatever is cast around it
    r = result["reduce"]
    for key in ("jit_float32_compute", "jit_bfloat16_compute", "jit_float32_compute_grads_cast_bf16"):
        assert r[key] == ["f32"], (key, r[key])
