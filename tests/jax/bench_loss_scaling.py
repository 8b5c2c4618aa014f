"""Benchmark (not a test): the cost of ``mpx_jax.with_loss_scaling`` over an unscaled float16 step.

The model is the issue's: a float16 MLP 1024-4096-1024 (gelu), batch 256, mean
squared error, AdamW on float32 master weights, every step one ``jax.jit``;
``--model mpx`` (default) runs it under ``mpx_jax.autocast`` as ``mpx bench``
does, ``--model jmp`` with jmp's plain float16 casts.
Each round times ``--steps`` steps of every variant, in a rotating order, so
drift (thermal, other processes) hits them alike; the figure is, per variant,
the median over rounds of ``time(variant) / time(unscaled)`` with its min and max.

Variants: ``unscaled`` (the baseline: no scaling, no finiteness check),
``mpx`` (``with_loss_scaling``, default dynamic config), ``check`` (the
finiteness check and the scale update alone, with no skip: the floor of any
skip that reads every gradient) and, with ``--cond``, ``cond`` (the former
implementation: the inner update inside ``lax.cond``).  ``--donate`` donates
the parameters and the optimizer state to every step, as training loops that
update in place do.

Besides the times it prints, per variant, what XLA's compiled step reads and
writes (``cost_analysis()['bytes accessed']``) and how many buffer copies it
holds: a deterministic profile of where the extra time goes.

Run from the repository root::

    /root/venv/bin/python tests/jax/bench_loss_scaling.py --rounds 30 --steps 3 --cond [--model jmp] [--donate]
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
import mpx_jax


def build(model: str = "mpx", d: int = 1024, h: int = 4096, batch: int = 256) -> tuple[Any, Any, Any]:
    """float32 params, the float16 loss ``loss(params, x, y)`` and the data.

    ``model="mpx"``: the MLP under ``mpx_jax.autocast(f, "mixed_float16")`` with
    ``cast_to_compute``/``cast_to_output`` (what ``mpx bench`` times: float16
    matmuls accumulated in float32); ``model="jmp"``: jmp's recipe, params and
    inputs cast to float16 and the MLP run as written (float16 matmuls).
    """
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.uniform(k1, (d, h), jnp.float32, -1, 1) / math.sqrt(d),
        "b1": jnp.zeros(h),
        "w2": jax.random.uniform(k2, (h, d), jnp.float32, -1, 1) / math.sqrt(h),
        "b2": jnp.zeros(d),
    }
    x = jax.random.normal(k3, (batch, d), jnp.float32)
    y = jax.random.normal(k4, (batch, d), jnp.float32)

    def mlp(p: Any, x: Any) -> Any:
        return jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False) @ p["w2"] + p["b2"]

    if model == "mpx":
        policy = mpx.get_policy("mixed_float16")
        net = mpx_jax.autocast(mlp, policy)

        def loss(p: Any, x: Any, y: Any) -> Any:
            out = mpx_jax.cast_to_output(policy, net(*mpx_jax.cast_to_compute(policy, (p, x))))
            return jnp.mean(jnp.square(out - y))

    elif model == "jmp":

        def loss(p: Any, x: Any, y: Any) -> Any:
            p, x = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), (p, x))
            return jnp.mean(jnp.square(mlp(p, x).astype(jnp.float32) - y))

    else:
        raise ValueError(f"model: expected 'mpx' or 'jmp', got {model!r}.")
    return params, loss, (x, y)


def cond_loss_scaling(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """The former ``with_loss_scaling``: the inner update under ``lax.cond`` (for comparison only)."""
    from mpx_jax.loss_scale import all_finite

    def init(params: Any) -> Any:
        return mpx_jax.LossScalingState(tx.init(params), mpx_jax.LossScale.create())

    def update(g: Any, state: Any, params: Any = None) -> Any:
        ls = state.loss_scale
        finite = all_finite(ls.unscale(g))

        def step(ops: Any) -> Any:
            return tx.update(ls.unscale(ops[0]), ops[1], params)

        shapes = jax.eval_shape(step, (g, state.inner_state))

        def skip(ops: Any) -> Any:
            return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[0]), ops[1]

        u, inner = jax.lax.cond(finite, step, skip, (g, state.inner_state))
        return u, mpx_jax.LossScalingState(inner, ls.update(finite))

    return optax.GradientTransformation(init, update)


def check_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """The finiteness check and the scale's update, but no skip (for comparison only: it applies inf steps)."""
    from mpx_jax.loss_scale import all_finite

    def init(params: Any) -> Any:
        return mpx_jax.LossScalingState(tx.init(params), mpx_jax.LossScale.create())

    def update(g: Any, state: Any, params: Any = None) -> Any:
        ls = state.loss_scale
        finite = all_finite(ls.unscale(g))
        u, inner = tx.update(ls.unscale(g), state.inner_state, params)
        return u, mpx_jax.LossScalingState(inner, ls.update(finite))

    return optax.GradientTransformation(init, update)


def make_steps(model: str, with_cond: bool, donate: bool = False) -> dict[str, Any]:
    params, loss, (x, y) = build(model)
    tx = optax.adamw(1e-4)
    jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())

    @jit
    def unscaled(p: Any, st: Any) -> Any:
        g = jax.grad(loss)(p, x, y)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    def scaled_step(stx: Any) -> Any:
        @jit
        def step(p: Any, st: Any) -> Any:
            ls = mpx_jax.get_loss_scale(st)
            g = jax.grad(lambda q: ls.scale(loss(q, x, y)))(p)
            u, st = stx.update(g, st, p)
            return optax.apply_updates(p, u), st

        return step, stx.init(params)

    variants = {"unscaled": (unscaled, tx.init(params))}
    variants["mpx"] = scaled_step(mpx_jax.with_loss_scaling(tx, mpx.ScalerConfig()))
    variants["check"] = scaled_step(check_only(tx))
    if with_cond:
        variants["cond"] = scaled_step(cond_loss_scaling(tx))
    # each variant its own copy of the parameters, so donating one variant's buffers leaves the others'
    return {name: [fn, (jax.tree_util.tree_map(jnp.copy, params), st)] for name, (fn, st) in variants.items()}


def compiled_profile(fn: Any, state: Any) -> tuple[float, int]:
    """(megabytes the compiled step reads and writes, buffer copies in it), from XLA's compiled module."""
    compiled = fn.lower(*state).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    copies = len(re.findall(r"= \S+ copy\(", compiled.as_text()))
    return cost.get("bytes accessed", float("nan")) / 1e6, copies


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each variant per round (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first (default 2)")
    ap.add_argument("--model", choices=("mpx", "jmp"), default="mpx", help="the float16 recipe (default mpx)")
    ap.add_argument("--cond", action="store_true", help="also time the former lax.cond implementation")
    ap.add_argument("--donate", action="store_true", help="donate params and optimizer state to each step")
    args = ap.parse_args(argv)

    variants = make_steps(args.model, args.cond, args.donate)
    names = list(variants)
    profile = {name: compiled_profile(fn, state) for name, (fn, state) in variants.items()}

    def run(name: str, n: int) -> float:
        fn, state = variants[name]
        start = time.perf_counter()
        for _ in range(n):
            state = fn(*state)
        jax.block_until_ready(state)
        variants[name][1] = state
        return time.perf_counter() - start

    for name in names:
        run(name, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(run(name, args.steps) / args.steps)
    base = np.asarray(times["unscaled"])
    print(
        f"jax {jax.__version__} on {jax.default_backend()}; float16 MLP 1024-4096-1024 ({args.model} recipe), "
        f"batch 256, AdamW{', params and state donated' if args.donate else ''}; "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    print(f"unscaled step: median {statistics.median(base) * 1e3:.1f} ms, fastest {base.min() * 1e3:.1f} ms")
    for name in names[1:]:
        ratio = np.asarray(times[name]) / base
        print(
            f"{name:>5} / unscaled: median {np.median(ratio):.4f} (+{(np.median(ratio) - 1) * 100:.1f}%), "
            f"min {ratio.min():.4f}, max {ratio.max():.4f}; fastest step / fastest unscaled "
            f"{min(times[name]) / base.min():.4f}; step median {np.median(times[name]) * 1e3:.1f} ms"
        )
    for name in names:
        mb, copies = profile[name]
        print(f"{name:>8} compiled step: {mb:.0f} MB accessed ({mb / profile['unscaled'][0]:.3f}x unscaled), "
              f"{copies} buffer copies")
    for name in names[1:]:
        ls = mpx_jax.get_loss_scale(variants[name][1][1])
        print(f"{name}: {int(ls.steps) - int(ls.skipped_steps)} finite steps of {int(ls.steps)}")


if __name__ == "__main__":
    main()
