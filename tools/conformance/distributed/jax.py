"""JAX replicas over 4 host devices: ``shard_map`` with a ``pmean`` and ``jit`` with NamedSharding.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m conformance.distributed.jax IN OUT

Natively a jmp-style dynamic loss scale (checked per shard, no axis name: what jmp and
``optax.apply_if_finite`` do inside a mapped function); under mpx ``mpx_jax.with_loss_scaling``
with no ``axis_name``.  Under ``shard_map`` every shard carries its own copy of the parameters and
optimizer state (stacked along the mesh axis), so a shard that decides alone shows up as a
divergence instead of being hidden by an ``out_specs=P()`` that returns shard 0's copy.

The ``fp8_amax`` scenario trains a delayed-scaling FP8 Dense under ``jit`` with the batch sharded over the
4 devices: natively Flax's ``Fp8DirectDotGeneralOp`` (its amax histories a collection overwritten with
its gradient), under mpx ``mpx_jax.float8_flax.Float8Linear`` with ``float8_step``, checked against
``mpx.float8.float8_update`` over the global batch's amaxes.

The script runs the modes ``MPX_CONFORMANCE_MODES`` names (both by default); without ``mpx`` it
blocks mpx's imports (:mod:`conformance.isolation`).  Scaler configs are
``mpx.ScalerConfig.to_dict()`` dicts: read by key natively, handed to mpx_jax under mpx.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conformance import isolation

N = 4
AXIS = "d"
LR = 0.1
DEBUG = os.environ.get("MPX_CONFORMANCE_DEBUG", "") not in ("", "0")
ENGINE_NAMES = {
    "per_replica": "shard_map over 4 host devices, gradients pmean-ed, no axis_name given",
    "sharded": "jit with NamedSharding over 4 host devices (batch sharded, parameters replicated)",
}


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) / 2, "b1": jnp.zeros(8, jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32) / 3, "b2": jnp.zeros(4, jnp.float32)}  # fmt: skip


def _data() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((2 * N, 4)), jnp.float32),
            jnp.asarray(rng.standard_normal((2 * N, 4)), jnp.float32))  # fmt: skip


def _forward(q: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]


# -- native: a jmp-style DynamicLossScale (written out: jmp is not a dependency) -------------------


def jmp_init(cfg: dict) -> dict:
    """A jmp-style loss-scale state from a config dict (``mpx.ScalerConfig.to_dict()``)."""
    return {"scale": jnp.float32(cfg["init_scale"]), "counter": jnp.int32(0)}


def jmp_adjust(cfg: dict, s: dict, finite: jax.Array) -> dict:
    """jmp.DynamicLossScale.adjust: grow on the period-th finite step, halve (floor 1) otherwise."""
    period = cfg["growth_interval"]
    grown = jnp.where(s["counter"] == period - 1, s["scale"] * cfg["growth_factor"], s["scale"])
    scale = jnp.where(finite, grown, jnp.maximum(jnp.float32(1.0), s["scale"] * cfg["backoff_factor"]))
    counter = ((s["counter"] + 1) % period) * finite.astype(jnp.int32)
    return {"scale": scale.astype(jnp.float32), "counter": counter}


def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]))


class _Step:
    """One training step (native or mpx) on unstacked params, with the inf injected where asked."""

    def __init__(self, mode: str, cfg: dict, scenario: str) -> None:
        self.mode, self.cfg, self.scenario = mode, cfg, scenario
        self.sgd = optax.sgd(LR)
        if mode == "mpx":
            import mpx_jax

            self.mj = mpx_jax
            self.tx = mpx_jax.with_loss_scaling(optax.sgd(LR), cfg)

    def init(self, params: dict) -> Any:
        if self.mode == "native":
            return {"inner": self.sgd.init(params), "ls": jmp_init(self.cfg)}
        return self.tx.init(params)

    def scale_of(self, state: Any) -> jax.Array:
        return state["ls"]["scale"] if self.mode == "native" else self.mj.get_loss_scale(state).loss_scale

    def __call__(self, params, state, x, y, loss_mult, grad_bump, reduce):
        def loss_fn(q):
            loss = jnp.mean(loss_mult[:, None] * (_forward(q, x) - y) ** 2)
            if self.mode == "native":
                return loss * state["ls"]["scale"]
            return self.mj.get_loss_scale(state).scale(loss)

        grads = reduce(jax.grad(loss_fn)(params))
        grads = {**grads, "w1": grads["w1"] + grad_bump}  # +inf on the bad replica's part after the reduction
        if self.mode == "native":
            unscaled = jax.tree.map(lambda g: g / state["ls"]["scale"], grads)
            finite = _all_finite(unscaled)  # per shard under shard_map: no axis name
            updates, inner = self.sgd.update(unscaled, state["inner"], params)
            new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), optax.apply_updates(params, updates), params)
            inner = jax.tree.map(lambda a, b: jnp.where(finite, a, b), inner, state["inner"])
            return new, {"inner": inner, "ls": jmp_adjust(self.cfg, state["ls"], finite)}
        updates, state = self.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state


def _inputs(p: dict, finite: bool) -> tuple[np.ndarray, np.ndarray]:
    """(per-example loss multiplier, gradient bump of w1): inf on the last device's part when not finite."""
    mult, bump = np.ones(2 * N, np.float32), np.zeros((4, 8), np.float32)
    if not finite and p["scenario"] == "loss":
        mult[-2:] = np.inf  # the last device's examples
    if not finite and p["scenario"] == "grads_after_reduce":
        bump[-1] = np.inf  # the last device's row of w1 (its shard, rows sharded over the 4 devices)
    return mult, bump


def _shard_map(p: dict, mode: str, mesh) -> dict:
    step = _Step(mode, p["config"], p["scenario"])
    params0 = _params()
    stack = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (N, *jnp.shape(a))), t)  # noqa: E731
    params, state = stack(params0), stack(step.init(params0))
    x, y = _data()

    def body(prm, st, x, y, mult, bump):
        prm, st = jax.tree.map(lambda a: a[0], (prm, st))
        mine = jnp.where(jax.lax.axis_index(AXIS) == N - 1, bump[None], 0.0)[0]
        new, st = step(prm, st, x, y, mult, mine, lambda g: jax.lax.pmean(g, AXIS))
        return jax.tree.map(lambda a: a[None], (new, st))

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P()),
                                out_specs=P(AXIS)))  # fmt: skip
    scales, applied, same = [], [], True
    for finite in p["flags"]:
        mult, bump = _inputs(p, finite)
        new, state = run(params, state, x, y, jnp.asarray(mult), jnp.asarray(bump))
        per = [np.concatenate([np.asarray(a[i]).ravel().view(np.uint32) for a in jax.tree.leaves(new)]) for i in range(N)]
        old = [np.concatenate([np.asarray(a[i]).ravel().view(np.uint32) for a in jax.tree.leaves(params)]) for i in range(N)]
        s = [float(v) for v in np.asarray(step.scale_of(state))]
        scales.append(s)
        applied.append([not np.array_equal(a, b) for a, b in zip(per, old, strict=True)])
        same = same and all(np.array_equal(per[0], q) for q in per) and len(set(s)) == 1
        params = new
    return _observe("per_replica", same, scales, applied)


def _observe(engine: str, same: bool, scales: list[list[float]], applied: list[list[bool]]) -> dict:
    same = same and all(len(set(a)) == 1 for a in applied)
    return {"consistent": bool(same), "scales": [s[0] for s in scales], "applied": [a[0] for a in applied],
            "scales_per_replica": [list(r) for r in zip(*scales, strict=True)], "engine": ENGINE_NAMES[engine]}  # fmt: skip


def _jit(p: dict, mode: str, mesh) -> dict:
    step = _Step(mode, p["config"], p["scenario"])
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    params = jax.device_put(_params(), rep)
    state = jax.device_put(step.init(_params()), rep)
    x, y = (jax.device_put(a, rows) for a in _data())
    run = jax.jit(lambda prm, st, x, y, m, b: step(prm, st, x, y, m, b, lambda g: g),
                  out_shardings=(rep, rep))  # fmt: skip
    scales, applied, same = [], [], True
    for finite in p["flags"]:
        mult, bump = _inputs(p, finite)
        new, state = run(params, state, x, y, jax.device_put(mult, rows), jax.device_put(bump, rows))

        def per_device(tree):
            leaves = jax.tree.leaves(tree)
            return [np.concatenate([np.asarray(a.addressable_shards[i].data).ravel().view(np.uint32) for a in leaves])
                    for i in range(N)]  # fmt: skip

        per, old = per_device(new), per_device(params)
        sc = step.scale_of(state)
        s = [float(np.asarray(sh.data)) for sh in sc.addressable_shards]
        scales.append(s)
        applied.append([not np.array_equal(a, b) for a, b in zip(per, old, strict=True)])
        same = same and all(np.array_equal(per[0], q) for q in per) and len(set(s)) == 1
        params = new
    return _observe("sharded", same, scales, applied)


# -- FP8 under jit + NamedSharding: the amaxes of a batch sharded over the 4 devices ---------------------


def _fp8_batches(p: dict) -> list[np.ndarray]:
    """One (2N, 4) batch per step; step i's largest |x| sits in device (i % N)'s rows only."""
    rng = np.random.default_rng(2)
    out = []
    for i in range(len(p["flags"])):
        x = rng.standard_normal((2 * N, 4)).astype(np.float32)
        x[2 * (i % N), i % 4] = np.float32(16.0 + i)
        out.append(x)
    return out


def _fp8(p: dict, mode: str, mesh) -> dict:
    """A Dense layer with delayed-scaling FP8 trained with jit over a batch sharded on 4 devices: per step
    every device's FP8 state (bytes), the input amax it recorded, and under mpx the core's chain."""
    rows, rep = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    length = p["recipe"]["amax_history_len"]
    kernel0 = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)) / 2, jnp.float32)
    c = jnp.asarray(np.random.default_rng(3).standard_normal((2 * N, 8)), jnp.float32)
    if mode == "native":  # Flax's FP8 op: its amax histories are a collection overwritten with its gradient
        from flax.linen import fp8_ops

        op = fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=length)
        dims = (((1,), (0,)), ((), ()))
        fp8 = jax.device_put(op.init(jax.random.PRNGKey(0), jnp.ones((2, 4)), kernel0, dims)["_overwrite_with_gradient"], rep)

        @jax.jit
        def step(kernel, fp8, x):
            def loss(k, v):
                return jnp.sum(op.apply({"_overwrite_with_gradient": v}, x, k, dims) * c)

            gk, new = jax.grad(loss, argnums=(0, 1))(kernel, fp8)
            return kernel - LR * gk, new

        def read(fp8):  # (every device's bytes of the collection, the input amax just recorded)
            return fp8, fp8["input_amax_history"]
    else:
        from flax import nnx

        import mpx
        import mpx.float8 as core
        import mpx_jax
        from mpx_jax.float8_flax import FLOAT8_GRADS, Float8Linear, float8_step

        recipe = mpx.Float8Recipe(**p["recipe"])
        layer = Float8Linear(4, 8, recipe=recipe, use_bias=False, rngs=nnx.Rngs(0))
        layer.kernel[...] = kernel0
        opt = nnx.Optimizer(layer, mpx_jax.with_loss_scaling(optax.sgd(LR), {"kind": "static", "init_scale": 1.0}),
                            wrt=nnx.Param)  # fmt: skip
        graph, state = nnx.split((layer, opt))
        state = jax.device_put(state, rep)

        @jax.jit
        def step(_kernel, state, x):
            layer, opt = nnx.merge(graph, state)
            grads = nnx.grad(lambda m: jnp.sum(m(x) * c), argnums=FLOAT8_GRADS)(layer)
            float8_step(opt, layer, grads)
            return None, nnx.state((layer, opt))

        def read(state):
            layer, _ = nnx.merge(graph, state)
            return {"scale": layer.fp8_scale[...], "history": layer.fp8_history[...]}, layer.fp8_history[...]
    kernel, carry = jax.device_put(kernel0, rep), (fp8 if mode == "native" else state)
    same, global_amax, core_chain = True, True, True
    if mode == "mpx":
        ref = core.float8_init(recipe, {"x": "input", "w": "weight", "g": "grad"})
        g_amax = np.float32(np.abs(np.asarray(c)).max())  # the loss is sum(y * c) at a static scale of 1
    for x in _fp8_batches(p):
        w_before = np.asarray(kernel if mode == "native" else nnx.merge(graph, carry)[0].kernel[...])
        kernel, carry = step(kernel, carry, jax.device_put(x, rows))
        tree, hist = read(carry)
        leaves = jax.tree.leaves(tree)
        per = [b"".join(np.asarray(sorted(a.addressable_shards, key=lambda s: s.device.id)[i].data).tobytes()
                        for a in leaves) for i in range(N)]  # fmt: skip
        same = same and len(set(per)) == 1 and all(a.sharding.is_fully_replicated for a in leaves)
        global_amax = global_amax and np.asarray(hist).reshape(-1)[0] == np.float32(np.abs(x).max())
        if mode == "mpx":
            ref = core.float8_update(recipe, ref, {"x": np.float32(np.abs(x).max()),
                                                   "w": np.float32(np.abs(w_before).max()), "g": g_amax})  # fmt: skip
            want = np.asarray([ref.tensors[k].scale for k in ("x", "w", "g")], np.float32)
            hist_want = np.asarray([ref.tensors[k].amax_history for k in ("x", "w", "g")], np.float32)
            core_chain = core_chain and np.asarray(tree["scale"]).tobytes() == want.tobytes()
            core_chain = core_chain and np.asarray(tree["history"]).tobytes() == hist_want.tobytes()
    return {"consistent": bool(same and core_chain), "global_amax": bool(global_amax),
            "core_chain": bool(core_chain) if mode == "mpx" else None,
            "engine": "jit with NamedSharding over 4 host devices (batch sharded, FP8 state replicated)"}  # fmt: skip


def main(argv: list[str]) -> int:
    src, dst = argv
    modes = isolation.modes_from_env()  # natively: the blocker, before anything runs
    if len(jax.devices()) < N:
        why = f"JAX sees {len(jax.devices())} device(s), not {N}: XLA_FLAGS={N} host devices was not honoured"
        Path(dst).write_text(json.dumps({cid: {"launch_failed": why} for cid in json.loads(Path(src).read_text())}))
        return 0
    mesh = jax.make_mesh((N,), (AXIS,), devices=jax.devices()[:N], axis_types=(jax.sharding.AxisType.Auto,))
    out: dict[str, dict] = {}
    for cid, p in json.loads(Path(src).read_text()).items():
        out[cid] = {}
        for mode in modes:
            try:
                run = _fp8 if p["scenario"] == "fp8_amax" else _shard_map if p["engine"] == "per_replica" else _jit
                out[cid][mode] = run(p, mode, mesh)
            except Exception as err:
                out[cid][mode] = {"raised": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
                if DEBUG:
                    traceback.print_exc()
    out["_isolation"] = isolation.report()
    Path(dst).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
