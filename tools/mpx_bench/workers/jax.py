"""The JAX bench worker: jmp-style casts and select natively, mpx_jax.autocast + with_loss_scaling under mpx."""

from __future__ import annotations

import math
import platform
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
import mpx_jax
from mpx_bench import models
from mpx_bench.harness import Config
from mpx_bench.workers.common import CPU_PROBE_N, activation_profile, plan, timed_probe

_DT = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def _device(device: str) -> Any:
    kind = "gpu" if device.startswith(("cuda", "gpu")) else device.split(":")[0]
    return jax.devices(kind)[0]


def info(device: str) -> dict[str, Any]:
    import flax

    dev = _device(device)
    return {"framework": "jax",
            "versions": {"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
                         "optax": optax.__version__, "flax": flax.__version__},
            "device": str(dev), "device_name": getattr(dev, "device_kind", platform.machine()),
            "devices": [f"{d} ({getattr(d, 'device_kind', d.platform)})" for d in jax.devices()]}  # fmt: skip


def compute_dtype(policy: str) -> str:
    return mpx.get_policy(policy).compute_dtype


def probe(dtypes: list[str], budget_s: float, device: str, n: int | None = None) -> dict[str, Any]:
    dev = _device(device)
    n = n or (4096 if dev.platform == "gpu" else CPU_PROBE_N)
    mm = jax.jit(lambda a, b: (a @ b).sum())
    runs = {}
    for name in dtypes:
        a = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), _DT[name]), dev)
        b = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), _DT[name]), dev)
        runs[name] = lambda a=a, b=b: mm(a, b).block_until_ready()
    return {name: {"n": n, **r} for name, r in timed_probe(runs, 2.0 * n**3, budget_s).items()}


# -- models (pure functions of float32 params) -------------------------------------------
def _dense(key: Any, fan_in: int, fan_out: int) -> dict[str, Any]:
    bound = 1.0 / math.sqrt(fan_in)
    return {
        "w": jax.random.uniform(key, (fan_in, fan_out), jnp.float32, -bound, bound),
        "b": jnp.zeros(fan_out),
    }


def _apply_dense(p: dict[str, Any], x: Any) -> Any:
    return x @ p["w"] + p["b"]


def _layer_norm(p: dict[str, Any], x: Any) -> Any:
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def build(model: str, size: str) -> tuple[dict[str, Any], Any, Any, Any]:
    """float32 params, a model function ``f(params, x) -> output``, the loss ``loss(out, y)``, and the data."""
    d = models.dims(model, size)
    x, y = models.data(model, size)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    if model == "mlp":
        params = {"l1": _dense(next(keys), d["d"], d["h"]), "l2": _dense(next(keys), d["h"], d["d"])}

        def f(p: Any, x: Any) -> Any:
            return _apply_dense(p["l2"], jax.nn.gelu(_apply_dense(p["l1"], x), approximate=False))

        def loss(out: Any, y: Any) -> Any:
            return jnp.mean(jnp.square(out - y))

    elif model == "transformer":
        dm, heads = d["d"], d["heads"]
        norm = lambda: {"scale": jnp.ones(dm), "bias": jnp.zeros(dm)}  # noqa: E731
        params = {"blocks": [{"n1": norm(), "qkv": _dense(next(keys), dm, 3 * dm), "o": _dense(next(keys), dm, dm),
                              "n2": norm(), "f1": _dense(next(keys), dm, d["ff"]), "f2": _dense(next(keys), d["ff"], dm)}
                             for _ in range(d["layers"])],
                  "norm": norm(), "head": _dense(next(keys), dm, dm)}  # fmt: skip

        def attention(p: Any, x: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = jnp.moveaxis(_apply_dense(p["qkv"], x).reshape(b, s, 3, heads, dm // heads), 2, 0)
            att = jax.nn.softmax(
                jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(dm // heads)), axis=-1
            )
            return _apply_dense(p["o"], jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, dm))

        def f(p: Any, x: Any) -> Any:
            for blk in p["blocks"]:
                x = x + attention(blk, _layer_norm(blk["n1"], x))
                h = jax.nn.gelu(_apply_dense(blk["f1"], _layer_norm(blk["n2"], x)), approximate=False)
                x = x + _apply_dense(blk["f2"], h)
            return _apply_dense(p["head"], jnp.mean(_layer_norm(p["norm"], x), axis=1))

        def loss(out: Any, y: Any) -> Any:
            return jnp.mean(jnp.square(out - y))

    else:
        c1, c2, c3 = d["channels"]

        def conv(key: Any, cin: int, cout: int) -> dict[str, Any]:
            bound = 1.0 / math.sqrt(9 * cin)
            return {
                "w": jax.random.uniform(key, (3, 3, cin, cout), jnp.float32, -bound, bound),
                "b": jnp.zeros(cout),
            }

        params = {"c1": conv(next(keys), d["cin"], c1), "c2": conv(next(keys), c1, c2), "c3": conv(next(keys), c2, c3),
                  "head": _dense(next(keys), c3, d["classes"])}  # fmt: skip

        def apply_conv(p: Any, x: Any, stride: int) -> Any:
            out = jax.lax.conv_general_dilated(x, p["w"], (stride, stride), ((1, 1), (1, 1)),
                                               dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
            return jax.nn.relu(out + p["b"])

        def f(p: Any, x: Any) -> Any:
            x = apply_conv(p["c3"], apply_conv(p["c2"], apply_conv(p["c1"], x, 1), 2), 2)
            return _apply_dense(p["head"], jnp.mean(x, axis=(1, 2)))

        def loss(out: Any, y: Any) -> Any:
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], axis=1))

        y = y.astype(np.int32)
    return params, f, loss, (jnp.asarray(x), jnp.asarray(y))


# -- the configurations -------------------------------------------------------------------
def _jmp_loss(f: Any, loss: Any, policy: mpx.Policy | None) -> Any:
    """jmp's recipe: cast params and inputs to the compute dtype, the output to float32."""
    if policy is None:
        return lambda p, x, y: loss(f(p, x), y)
    compute = _DT[policy.compute_dtype]

    def fn(p: Any, x: Any, y: Any) -> Any:
        cast = jax.tree_util.tree_map(lambda a: a.astype(compute), (p, x))
        return loss(f(*cast).astype(jnp.float32), y)

    return fn


def _mpx_loss(f: Any, loss: Any, policy: mpx.Policy) -> Any:
    """mpx's recipe: params and inputs cast to the compute dtype, the model under ``mpx_jax.autocast``
    (the op table puts softmax, norms, reductions and the loss in float32), the output cast to output_dtype."""
    model = mpx_jax.autocast(f, policy)

    def fn(p: Any, x: Any, y: Any) -> Any:
        out = model(*mpx_jax.cast_to_compute(policy, (p, x)))
        return loss(mpx_jax.cast_to_output(policy, out), y)

    return fn


class Runner:
    """A jitted train step ``(params, opt_state, extra) -> same``; ``step()`` runs one and blocks."""

    def __init__(
        self, step_fn: Any, params: Any, opt_state: Any, extra: Any, data: Any, loss_fn: Any
    ) -> None:
        self.traces = 0

        def counted(*args: Any) -> Any:
            self.traces += 1
            return step_fn(*args)

        self.jitted = jax.jit(counted)
        # every input committed to the data's device, so the second call hits the first call's executable
        device = next(iter(jax.tree_util.tree_leaves(data)[0].devices()))
        self.state = jax.device_put((params, opt_state, extra), device)
        self.data = data
        self.loss_fn = loss_fn
        self.params0 = params
        self.steps = 0
        self.fp8 = False  # set for an FP8 policy under mpx: measure() counts its FP8 dots

    def step(self) -> None:
        self.state = self.jitted(*self.state, *self.data)
        jax.block_until_ready(self.state)
        self.steps += 1

    def measure(self) -> dict[str, Any]:
        from jax._src.ad_checkpoint import saved_residuals

        traces_before, steps_before = self.traces, self.steps
        with jax.transfer_guard("disallow"):
            try:
                self.step()
                transfers: Any = 0
                transfer_note = "jax.transfer_guard('disallow') passed one step"
            except Exception as err:
                transfers, transfer_note = None, f"transfer guard refused: {str(err).splitlines()[0][:200]}"
        self.step()
        retraces = self.traces - traces_before
        shapes = {tuple(a.shape) for a in jax.tree_util.tree_leaves(self.params0)}
        kept = []
        for aval, desc in saved_residuals(lambda p: self.loss_fn(p, *self.data), self.params0):
            if "from the argument" in desc or "from a literal" in desc:
                continue
            if "convert_element_type" in desc and tuple(aval.shape) in shapes:
                continue  # a cast copy of a parameter, not an activation
            made_by = desc.split(" from ")[0].removeprefix("output of ").strip() or "?"
            kept.append(
                (made_by, np.dtype(aval.dtype).name, math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)
            )
        activation = sum(k[2] for k in kept)
        compiled = self.jitted.lower(*self.state, *self.data).compile()
        mem = compiled.memory_analysis()
        return {
            "activation_bytes": activation,
            "activation_profile": activation_profile(kept),
            "activation_note": "residuals jax.vjp keeps (eager, before XLA fusion), casts of parameters excluded",
            "xla_temp_bytes": getattr(mem, "temp_size_in_bytes", None),
            "xla_argument_bytes": getattr(mem, "argument_size_in_bytes", None),
            "traces_total": self.traces,
            "traces_per_step": retraces / max(1, self.steps - steps_before),
            "host_transfers_per_step": transfers,
            "host_transfers_note": transfer_note,
            **(self._fp8_figures() if self.fp8 else {}),
        }

    def _fp8_figures(self) -> dict[str, Any]:
        """``fp8_layers`` (the FP8 dots autocast ran), ``fp8_gemm`` and ``fp8_note`` (``CPU emulation`` off a GPU)."""
        text = str(jax.make_jaxpr(self.loss_fn)(self.params0, *self.data))
        gpu = jax.default_backend() == "gpu"
        note = (
            "FP8 dot_general on the GPU (XLA)"
            if gpu
            else f"CPU emulation: XLA:{jax.default_backend().upper()} runs the float8 dot_general without FP8 "
            "hardware; the time is the emulation's, not an FP8 device's"
        )
        return {"fp8_layers": text.count("name=_fp8_dg"), "fp8_gemm": ["dot_general"], "fp8_note": note}


def configs(model: str, size: str, policies: list[str], device: str, slow: dict[str, str]) -> list[Config]:
    dev = _device(device)
    params, f, loss, data = build(model, size)
    params, data = jax.device_put((params, data), dev)
    tx = optax.adamw(1e-4)

    def make(mode: str, policy: mpx.Policy | None) -> Any:
        def build_runner() -> Runner:
            if mode == "fp32" or policy is None or mode.startswith("native"):
                lf = _jmp_loss(f, loss, None if mode == "fp32" else policy)
                p0 = params if policy is None else mpx_jax.cast_to_param(policy, params)
                scaled = mode == "native" and policy is not None and policy.compute_dtype == "float16"
                return Runner(_native_step(lf, tx, scaled), p0, tx.init(p0), jnp.float32(2.0**15), data, lf)
            lf = _mpx_loss(f, loss, policy)
            p0 = mpx_jax.cast_to_param(policy, params)
            config = mpx.ScalerConfig.for_policy(policy)
            if mode == "mpx-noscale" or config.kind == "none":
                return Runner(_native_step(lf, tx, False), p0, tx.init(p0), jnp.float32(1.0), data, lf)
            stx = mpx_jax.with_loss_scaling(tx, config)
            return Runner(_mpx_step(lf, stx), p0, stx.init(p0), jnp.float32(1.0), data, lf)

        def build_and_mark() -> Runner:
            runner = build_runner()
            runner.fp8 = mode.startswith("mpx") and policy is not None and policy.fp8 is not None
            return runner

        return build_and_mark

    return plan(policies, slow, make)


def _native_step(lf: Any, tx: Any, scaled: bool) -> Any:
    def step(p: Any, st: Any, s: Any, x: Any, y: Any) -> Any:
        if not scaled:
            g = jax.grad(lf)(p, x, y)
            u, st = tx.update(g, st, p)
            return optax.apply_updates(p, u), st, s
        # jmp's DynamicLossScale: scale, unscale, all-finite, then select old or new for every leaf
        g = jax.grad(lambda q: lf(q, x, y) * s)(p)
        g = jax.tree_util.tree_map(lambda a: a / s, g)
        fin = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree_util.tree_leaves(g)]))
        u, st2 = tx.update(g, st, p)
        p2 = optax.apply_updates(p, u)
        p = jax.tree_util.tree_map(lambda a, b: jnp.where(fin, a, b), p2, p)
        st = jax.tree_util.tree_map(lambda a, b: jnp.where(fin, a, b), st2, st)
        return p, st, jnp.where(fin, s, s / 2)

    return step


def _mpx_step(lf: Any, stx: Any) -> Any:
    def step(p: Any, st: Any, s: Any, x: Any, y: Any) -> Any:
        ls = mpx_jax.get_loss_scale(st)
        g = jax.grad(lambda q: ls.scale(lf(q, x, y)))(p)
        u, st = stx.update(g, st, p)
        return optax.apply_updates(p, u), st, s

    return step
