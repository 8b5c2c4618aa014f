"""Benchmark (not a test): the cost of ``mpx_jax.with_loss_scaling`` over an unscaled float16 step.

The model is the issue's: a float16 MLP 1024-4096-1024 (gelu), batch 256, mean
squared error, AdamW on float32 master weights, every step one ``jax.jit``;
``--model mpx`` (default) runs it under ``mpx_jax.autocast`` as ``mpx bench``
does, ``--model jmp`` with jmp's plain float16 casts, ``--model bench-mlp``
(``bench-transformer``, ``bench-cnn``) is ``mpx bench``'s JAX native
configuration (its model, jmp-style casts) with mpx's scaler in place of the
native select.
Each round times ``--steps`` steps of every variant, in a rotating order, so
drift (thermal, other processes) hits them alike; the figure is, per variant,
the median over rounds of ``time(variant) / time(unscaled)`` with its min and
max, in wall time and in this process's CPU time (all threads; on a machine
others load, the CPU time is the steadier of the two).

Variants: ``unscaled`` (the baseline: no scaling, no finiteness check) and
``mpx`` (``with_loss_scaling``, default dynamic config); with ``--check``,
``check`` (the finiteness check and the scale update alone, no skip: the floor
of any skip that reads every gradient); with ``--select``, ``select`` (the
previous implementation: the inner update's outputs selected); with
``--cond``, ``cond`` (the one before: the inner update inside ``lax.cond``).
``--donate`` donates the parameters and the optimizer state to every step, as
training loops that update in place do.

Besides the times it prints, per variant, what XLA's compiled step reads and
writes (``cost_analysis()['bytes accessed']``), its buffer copies (``copy``
instructions of the entry computation) and its temporaries
(``memory_analysis()``): a deterministic profile of where the extra time goes.

Run from the repository root::

    python tests/jax/bench_loss_scaling.py --rounds 30 --steps 3 [--model jmp] [--donate] [--select]
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

#: ``mpx bench``'s JAX models in its native configuration (jmp-style casts), run by ``--model bench-NAME``.
BENCH_MODELS = ("bench-mlp", "bench-transformer", "bench-cnn")
MODELS = ("mpx", "jmp", *BENCH_MODELS)


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

    elif model in BENCH_MODELS:
        # mpx bench's JAX native configuration: its model, float32 params cast jmp-style in the loss
        from mpx_bench.workers import jax as worker

        params, f, loss_fn, (x, y) = worker.build(model.removeprefix("bench-"), "default")
        native = worker._jmp_loss(f, loss_fn, mpx.get_policy("mixed_float16"))

        def loss(p: Any, x: Any, y: Any) -> Any:
            return native(p, x, y)

    else:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}.")
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


def select_loss_scaling(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """The previous ``with_loss_scaling``: the inner update as is, then its outputs selected (for comparison only)."""
    from mpx_jax.loss_scale import all_finite, select_tree

    def init(params: Any) -> Any:
        return mpx_jax.LossScalingState(tx.init(params), mpx_jax.LossScale.create())

    def update(g: Any, state: Any, params: Any = None) -> Any:
        ls = state.loss_scale
        finite = all_finite(ls.unscale(g))
        u, inner = tx.update(ls.unscale(g), state.inner_state, params)
        u = jax.tree_util.tree_map(lambda a: jnp.where(finite, a, jnp.asarray(-0.0, a.dtype)), u)
        return u, mpx_jax.LossScalingState(select_tree(finite, inner, state.inner_state), ls.update(finite))

    return optax.GradientTransformation(init, update)


def check_only(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """The finiteness check and the scale's update, but no skip (for comparison only: it applies inf steps)."""
    from mpx_jax.loss_scale import all_finite

    def init(params: Any) -> Any:
        return mpx_jax.LossScalingState(tx.init(params), mpx_jax.LossScale.create())

    def update(g: Any, state: Any, params: Any = None) -> Any:
        ls = state.loss_scale
        finite = all_finite(g)  # as with_loss_scaling tests it for a scale that stays >= 1
        u, inner = tx.update(ls.unscale(g), state.inner_state, params)
        return u, mpx_jax.LossScalingState(inner, ls.update(finite))

    return optax.GradientTransformation(init, update)


def make_steps(
    model: str, with_cond: bool, donate: bool = False, with_select: bool = False, with_check: bool = False
) -> dict[str, Any]:
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
    if with_check:
        variants["check"] = scaled_step(check_only(tx))
    if with_select:
        variants["select"] = scaled_step(select_loss_scaling(tx))
    if with_cond:
        variants["cond"] = scaled_step(cond_loss_scaling(tx))
    # each variant its own copy of the parameters, so donating one variant's buffers leaves the others'
    return {name: [fn, (jax.tree_util.tree_map(jnp.copy, params), st)] for name, (fn, st) in variants.items()}


def compiled_profile(fn: Any, state: Any) -> dict[str, float]:
    """What XLA's compiled step reads and writes, and its copies (deterministic, from the compiled module).

    ``mb``: ``cost_analysis()['bytes accessed']`` in MB (1e6 bytes); ``copies``: ``copy`` instructions of
    the entry computation, each one a whole buffer copied (a donated moment copied before it is updated
    in place, a transposed gradient laid out again); ``copy_ops``: every ``copy`` instruction, those inside
    fusions (a transposed read, no buffer of its own) included; ``temp_mb``: ``memory_analysis()``'s
    temporary buffers in MB.
    """
    compiled = fn.lower(*state).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    return {
        "mb": cost.get("bytes accessed", float("nan")) / 1e6,
        "copies": len(re.findall(r"= \S+ copy\(", entry)),
        "copy_ops": len(re.findall(r"= \S+ copy\(", text)),
        "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each variant per round (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first (default 2)")
    ap.add_argument(
        "--model",
        choices=MODELS,
        default="mpx",
        help="the float16 recipe (default mpx); bench-NAME: mpx bench's NAME model, native casts",
    )
    ap.add_argument("--cond", action="store_true", help="also time the former lax.cond implementation")
    ap.add_argument("--check", action="store_true", help="also time the finiteness check alone, no skip")
    ap.add_argument(
        "--select", action="store_true", help="also time the previous select-the-outputs implementation"
    )
    ap.add_argument("--donate", action="store_true", help="donate params and optimizer state to each step")
    args = ap.parse_args(argv)

    variants = make_steps(args.model, args.cond, args.donate, args.select, args.check)
    names = list(variants)
    profile = {name: compiled_profile(fn, state) for name, (fn, state) in variants.items()}

    def run(name: str, n: int) -> tuple[float, float]:
        fn, state = variants[name]
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            state = fn(*state)
        jax.block_until_ready(state)
        variants[name][1] = state
        return time.perf_counter() - start, time.process_time() - cpu

    for name in names:
        run(name, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            wall, used = run(name, args.steps)
            times[name].append(wall / args.steps)
            cpu[name].append(used / args.steps)
    base = np.asarray(times["unscaled"])
    cpu_base = np.asarray(cpu["unscaled"])
    print(
        f"jax {jax.__version__} on {jax.default_backend()}; "
        f"{'float16 MLP 1024-4096-1024, batch 256' if args.model in ('mpx', 'jmp') else 'mpx bench model'} "
        f"({args.model} recipe), AdamW{', params and state donated' if args.donate else ''}; "
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
        # CPU time of this process (all its threads): what the step computes, less what others' load adds
        cratio = np.asarray(cpu[name]) / cpu_base
        print(
            f"{'':>5}   CPU time: median {np.median(cratio):.4f} (+{(np.median(cratio) - 1) * 100:.1f}%), "
            f"min {cratio.min():.4f}, max {cratio.max():.4f}; step median {np.median(cpu[name]) * 1e3:.1f} ms"
        )
    for name in names:
        prof, base_mb = profile[name], profile["unscaled"]["mb"]
        print(
            f"{name:>8} compiled step: {prof['mb']:.1f} MB accessed ({prof['mb'] / base_mb:.3f}x unscaled), "
            f"{prof['copies']} buffer copies ({prof['copy_ops']} copy ops with those in fusions), "
            f"{prof['temp_mb']:.1f} MB temporaries"
        )
    for name in names[1:]:
        state = mpx_jax.get_loss_scale(variants[name][1][1]).state
        print(f"{name}: {state.steps - state.skipped_steps} finite steps of {state.steps}")


if __name__ == "__main__":
    main()
