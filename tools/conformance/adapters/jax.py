"""The JAX adapter: natively plain JAX, jmp-style casts and Flax's DynamicScale; under mpx mpx_jax.

Native paths import nothing of mpx (a native worker blocks it, conformance/isolation.py): they read
the case's precomputed params (``policy_dtypes``, the ``config`` dict).  mpx paths import mpx and
mpx_jax inside the function (:func:`_mpx`, :func:`_mpx_jax`).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conformance.adapters._common import (
    dtype_name,
    flag_gradient,
    max_rel_error,
    mlp_data,
    mlp_reference,
    op_input,
    rel_error,
)
from mpx_tools.skip import Skip

JNP = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "float64": jnp.float64}


def info() -> dict:
    import flax

    return {"version": f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}",
            "device": str(jax.devices()[0].platform)}  # fmt: skip


def _mpx():
    import mpx

    return mpx


def _mpx_jax():
    import mpx_jax

    return mpx_jax


def _x(shape, dtype, seed=0, positive=False):
    return jnp.asarray(op_input(shape, seed, positive), dtype=JNP[dtype])


def _op(op: str, dtype: str, other: str | None):
    """(function, args) for one canonical op."""
    x, y = _x((4, 8), dtype), _x((4, 8), other or dtype, 1)
    w = _x((8, 6), dtype, 2)
    img = _x((1, 6, 6, 2), dtype)
    labels = jnp.array([0, 1, 2, 3])
    nn = jax.nn

    def conv(a, k):
        return jax.lax.conv_general_dilated(a, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def conv_t(a, k):
        return jax.lax.conv_transpose(a, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def batch_norm(a):
        m = a.mean(0)
        return (a - m) * jax.lax.rsqrt(((a - m) ** 2).mean(0) + 1e-5)

    def group_norm(a):
        g = a.reshape(1, 6, 6, 2, 1)
        m = g.mean((1, 2, 4), keepdims=True)
        return ((g - m) * jax.lax.rsqrt(((g - m) ** 2).mean((1, 2, 4), keepdims=True) + 1e-5)).reshape(
            a.shape
        )

    def rms_norm(a):
        return a * jax.lax.rsqrt((a**2).mean(-1, keepdims=True) + 1e-6)

    table = {
        "matmul": (jnp.matmul, (x, w)),
        "linear": (lambda a, b: a @ b, (x, w)),
        "conv": (conv, (img, _x((3, 3, 2, 3), dtype, 4))),
        "conv_transpose": (conv_t, (img, _x((3, 3, 2, 3), dtype, 4))),
        "bmm": (jnp.matmul, (_x((2, 4, 8), dtype), _x((2, 8, 3), dtype, 5))),
        "einsum": (lambda a, b: jnp.einsum("ij,jk->ik", a, b), (x, w)),
        "attention": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v), tuple(_x((1, 4, 2, 8), dtype, s) for s in (6, 7, 8))),
        "softmax": (lambda a: nn.softmax(a, -1), (x,)),
        "log_softmax": (lambda a: nn.log_softmax(a, -1), (x,)),
        "layer_norm": (lambda a: nn.standardize(a, -1, epsilon=1e-5), (x,)),
        "batch_norm": (batch_norm, (x,)),
        "group_norm": (group_norm, (img,)),
        "rms_norm": (rms_norm, (x,)),
        "cross_entropy": (lambda a: optax.softmax_cross_entropy_with_integer_labels(a, labels).mean(), (x,)),
        "nll_loss": (lambda a: -jnp.take_along_axis(a, labels[:, None], 1).mean(), (x,)),
        "mse_loss": (lambda a, b: jnp.mean((a - b) ** 2), (x, y)),
        "bce_with_logits": (lambda a, b: optax.sigmoid_binary_cross_entropy(a, b).mean(), (x, nn.sigmoid(y))),
        "exp": (jnp.exp, (x,)),
        "log": (jnp.log, (_x((4, 8), dtype, positive=True),)),
        # lax.pow; an integer power (a**2) is integer_pow, which autocast treats as elementwise
        # because jax inlines it into composites such as gelu
        "pow": (lambda a: jnp.power(a, 2.5), (jnp.abs(x),)),
        "sum": (jnp.sum, (x,)),
        "mean": (jnp.mean, (x,)),
        "cumsum": (lambda a: jnp.cumsum(a, 0), (x,)),
        "prod": (jnp.prod, (x,)),
        "logsumexp": (lambda a: jax.nn.logsumexp(a, -1), (x,)),
        "vector_norm": (jnp.linalg.norm, (x,)),
        "add": (jnp.add, (x, y)),
        "mul": (jnp.multiply, (x, y)),
        "cat": (lambda a, b: jnp.concatenate([a, b]), (x, y)),
        "stack": (lambda a, b: jnp.stack([a, b]), (x, y)),
        "where": (lambda a, b: jnp.where(a > 0, a, b), (x, y)),
        "relu": (nn.relu, (x,)),
        "gelu": (nn.gelu, (x,)),
        "max_pool": (lambda a: jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"), (img,)),
        "reshape": (lambda a: a.reshape(8, 4), (x,)),
        "transpose": (lambda a: a.T, (x,)),
        "dropout": (lambda a: jnp.where(jax.random.bernoulli(jax.random.key(0), 0.5, a.shape), a / 0.5, 0), (x,)),
        "embedding": (lambda table: jnp.take(table, jnp.array([0, 2, 1]), axis=0), (w,)),
    }  # fmt: skip
    return table[op]


#: ops with no JAX function of their own: written out of primitives, they have no name autocast could
#: classify by category, so their reductions (float32 ops) decide their dtype under every keep_fp32
COMPOSITES = frozenset(
    {"batch_norm", "group_norm", "rms_norm", "cross_entropy", "nll_loss", "mse_loss", "bce_with_logits"}
)


def run_op(p: dict, mode: str) -> dict:
    op = p["op"]
    if mode == "mpx" and op in COMPOSITES and _mpx().classify(op, p["policy"]) is not _mpx().OpClass.FLOAT32:
        raise Skip(
            f"JAX has no {op} function: one written out of primitives has no name for autocast to "
            "classify by its category, so keep_fp32 cannot lower it (Flax's modules follow keep_fp32 "
            "through mpx_jax.flax)"
        )
    fn, args = _op(op, p["dtype"], p.get("other"))
    if mode == "mpx":
        fn = _mpx_jax().autocast(fn, p["policy"])
    return {"dtype": dtype_name(jax.jit(fn)(*args).dtype)}


def run_op_value(p: dict, mode: str) -> dict:
    fn, args = _op(p["op"], p["dtype"], None)
    run = _mpx_jax().autocast(fn, p["policy"]) if mode == "mpx" else fn
    out = jax.jit(run)(*args)
    upcast = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    ref = jax.jit(fn)(*upcast)
    return {"max_rel_error": rel_error(np.asarray(out, np.float64), np.asarray(ref, np.float64))}


def run_policy(p: dict, mode: str) -> dict:
    if mode == "native":
        raise Skip("JAX and Flax have no named policies; modules take dtype/param_dtype arguments")
    from flax import nnx

    from mpx_jax import flax as mpx_flax

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.dense = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    model = mpx_flax.apply_policy(Model(nnx.Rngs(0)), p["spec"])
    x = jnp.ones((2, 4), jnp.float32)
    # NNX modules have no output hook: the documented pattern casts the model's outputs.
    out = _mpx_jax().cast_to_output(p["spec"], model(x))
    return {
        "params": dtype_name(model.dense.kernel.value.dtype),
        "compute": dtype_name(model.dense(x).dtype),
        "output": dtype_name(out.dtype),
    }


def _native_scaler(cfg: dict):
    """Flax's DynamicScale from a config dict (``mpx.ScalerConfig.to_dict()``)."""
    from flax.training.dynamic_scale import DynamicScale

    if cfg["kind"] != "dynamic":
        raise Skip(f"Flax DynamicScale has no {cfg['kind']!r} mode")
    return DynamicScale(
        growth_factor=cfg["growth_factor"], backoff_factor=cfg["backoff_factor"],
        growth_interval=cfg["growth_interval"], scale=cfg["init_scale"],
    )  # fmt: skip


def _train_flags(mode: str, scaler: Any, flags: list[bool]) -> tuple[Any, list[float], int]:
    params = jnp.ones(3, jnp.float32)
    scales, skipped = [], 0
    for finite in flags:
        mult = flag_gradient(finite)
        if mode == "native":  # Flax's documented pattern: value_and_grad, then select on is_fin
            scaler, is_fin, _, grads = scaler.value_and_grad(lambda w, m=mult: jnp.sum(w * m))(params)
            new = jnp.where(is_fin, params - 0.1 * grads, params)
            scales.append(float(scaler.scale))
        else:
            mj = _mpx_jax()
            grads = jax.grad(lambda w, m=mult, s=scaler: s.scale(jnp.sum(w * m)))(params)
            grads = scaler.unscale(grads)
            ok = mj.all_finite(grads)
            new = mj.select_tree(ok, params - 0.1 * grads, params)
            scaler = scaler.update(ok)
            scales.append(float(scaler.loss_scale))
        skipped += bool(np.array_equal(np.asarray(new), np.asarray(params)))
        params = new
    return scaler, scales, skipped


def _scaler(mode: str, cfg: dict):
    """The scaler of ``mode`` for the config dict ``cfg`` (mpx_jax's LossScale takes the dict itself)."""
    return _native_scaler(cfg) if mode == "native" else _mpx_jax().LossScale.create(cfg)


def run_scaler_trace(p: dict, mode: str) -> dict:
    cfg = p["config"]
    if mode == "native" and p.get("native_defaults"):
        from flax.training.dynamic_scale import DynamicScale

        scaler = DynamicScale()
    else:
        scaler = _scaler(mode, cfg)
    _, scales, skipped = _train_flags(mode, scaler, p["flags"])
    return {"scales": scales, "skipped": skipped}


def run_stuck(p: dict, mode: str) -> dict:
    """Issue 18's stuck detection, in a jitted step: the step that raises and the cause it names."""
    if mode == "native":
        raise Skip("jmp / optax have no stuck detection")
    from conformance.cases import stuck_cause

    mpx, mj = _mpx(), _mpx_jax()
    tx = mj.with_loss_scaling(optax.sgd(0.1), p["config"])
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    branches = [lambda q: jnp.sum(q["w"]), lambda q: jnp.sum(jnp.sqrt(q["w"] - jax.lax.stop_gradient(q["w"]))),
                lambda q: jnp.sum(q["w"] * jnp.inf)]  # fmt: skip

    @jax.jit
    def step(prm, s, kind):
        ls = mj.get_loss_scale(s)
        scaled, g = jax.value_and_grad(lambda q: ls.scale(jax.lax.switch(kind, branches, q)))(prm)
        u, s = tx.update(g, s, prm, loss=scaled)
        return optax.apply_updates(prm, u), s

    for i, kind in enumerate(p["steps"], 1):
        try:
            params, state = step(params, state, jnp.int32({"ok": 0, "grad": 1, "loss": 2}[kind]))
            jax.block_until_ready(state)
            jax.effects_barrier()
        except (mpx.ScalerStuckError, jax.errors.JaxRuntimeError) as e:  # jit re-raises it as JaxRuntimeError
            if "ScalerStuckError" not in str(e) and not isinstance(e, mpx.ScalerStuckError):
                raise
            return {"raised_at": i, "cause": stuck_cause(str(e))}
    return {"raised_at": None, "cause": None}


def run_skip(p: dict, mode: str) -> dict:
    inner = optax.adam(1e-2) if p["optimizer"] == "adam" else optax.sgd(1e-2, momentum=0.9)
    params = {"w": jnp.asarray(op_input((4, 2), 3)), "b": jnp.zeros(2)}
    x = jnp.asarray(op_input((8, 4)))
    tx = inner if mode == "native" else _mpx_jax().with_loss_scaling(inner, p["config"])
    opt_state = tx.init(params)

    def snapshot(params, opt_state):
        inner_state = opt_state if mode == "native" else _inner_state(opt_state)
        return [np.asarray(v).tobytes() for v in jax.tree.leaves((params, inner_state))]

    changed, scales = [], []
    for step in p["steps"]:
        mult = flag_gradient(step == "ok", step)
        before = snapshot(params, opt_state)
        if mode == "native":
            grads = jax.grad(lambda q, m=mult: jnp.sum(x @ q["w"] + q["b"]) * m)(params)
            scales.append(1.0)
        else:
            ls = _mpx_jax().get_loss_scale(opt_state)
            scales.append(float(ls.loss_scale))
            grads = jax.grad(lambda q, m=mult, ls=ls: ls.scale(jnp.sum(x @ q["w"] + q["b"]) * m))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        changed.append(snapshot(params, opt_state) != before)
    if mode == "mpx":
        scales.append(float(_mpx_jax().get_loss_scale(opt_state).loss_scale))
        return {"changed": changed, "scale_halved": scales[2] == scales[1] / 2}
    return {"changed": changed, "scale_halved": False}


def _inner_state(opt_state: Any) -> Any:
    """The wrapped optimizer's state inside with_loss_scaling's state."""
    fields = getattr(opt_state, "_fields", ())
    for name in ("inner_state", "inner", "inner_opt_state"):
        if name in fields:
            return getattr(opt_state, name)
    raise RuntimeError(f"cannot find the inner optimizer state in {type(opt_state).__name__}{fields}")


def run_numerics(p: dict, mode: str) -> dict:
    d = mlp_data(p["seed"])
    params = {k: jnp.asarray(d[k]) for k in ("w1", "b1", "w2", "b2")}
    x, y = jnp.asarray(d["x"]), jnp.asarray(d["y"])

    def forward(q, x):
        return jnp.tanh(x @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]

    if mode == "native":  # jmp-style: cast params and inputs to the compute dtype, outputs back
        compute = JNP[p["policy_dtypes"]["compute_dtype"]]

        def loss_fn(q):
            q = jax.tree.map(lambda a: a.astype(compute), q)
            out = forward(q, x.astype(compute)).astype(jnp.float32)
            return jnp.mean((out - y) ** 2)
    else:
        fwd = _mpx_jax().autocast(forward, p["policy"])

        def loss_fn(q):
            out = fwd(q, x).astype(jnp.float32)
            return jnp.mean((out - y) ** 2)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    got = {"loss": np.asarray(loss), **{k: np.asarray(v, np.float64) for k, v in grads.items()}}
    return {"max_rel_error": max_rel_error(got, mlp_reference(d)), "loss_dtype": dtype_name(loss.dtype)}


def save_state(config: dict, flags: list[bool]) -> dict:
    """The state mpx_jax's LossScale saves after ``flags`` (``config``: ScalerConfig fields; mpx only)."""
    scaler, _, _ = _train_flags("mpx", _mpx_jax().LossScale.create(_mpx().ScalerConfig(**config)), flags)
    return scaler.state_dict()


def run_portability_save(p: dict, mode: str) -> dict:
    scaler, _, _ = _train_flags(mode, _scaler(mode, p["config"]), p["flags"])
    if mode == "native":
        return {"state_dict": {"scale": float(scaler.scale), "fin_steps": int(scaler.fin_steps)}}
    return {"state_dict": scaler.state_dict()}


def run_portability(p: dict, mode: str) -> dict:
    if mode == "native":
        raise Skip("Flax's DynamicScale has no state-dict format of its own (a dataclass pytree)")
    scaler = _mpx_jax().LossScale.from_state_dict(p["state_dict"])
    _, scales, _ = _train_flags(mode, scaler, p["flags"])
    return {"scales": scales}


def run_distributed(p: dict, mode: str) -> dict:
    """shard_map and jit sharding over 4 host devices, in a process of its own started once."""
    from conformance import distributed

    return distributed.observed("jax", p, mode)


_ACCUMULATION_STEPS: dict[tuple, Any] = {}


def _accumulation_step(mode: str, cfg: dict, k: int, lr: float) -> tuple[Any, Any]:
    """(init, jitted micro-batch step ``(params, state, c) -> (params, state, scale used, scale after)``),
    compiled once per mode, config dict (``mpx.ScalerConfig.to_dict()``) and k."""
    key = (mode, json.dumps(cfg, sort_keys=True), k, lr)
    if key in _ACCUMULATION_STEPS:
        return _ACCUMULATION_STEPS[key]
    if mode == "native":
        from conformance.distributed.jax import jmp_adjust, jmp_init

        tx = optax.MultiSteps(optax.sgd(lr), k)

        def init(params):
            return tx.init(params), jmp_init(cfg)

        def step(params, state, c):
            inner, ls = state
            scale = ls["scale"]
            grads = jax.grad(lambda w: jnp.sum(w * c) * scale)(params) / scale
            ok = jnp.all(jnp.isfinite(grads))
            updates, new_inner = tx.update(grads, inner, params)  # the dropped micro-batch never reaches it
            new_params = jnp.where(ok, optax.apply_updates(params, updates), params)
            new_inner = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_inner, inner)
            ls = jmp_adjust(cfg, ls, ok)
            return new_params, (new_inner, ls), scale, ls["scale"]
    else:
        mj = _mpx_jax()
        tx = mj.with_loss_scaling(optax.sgd(lr), cfg, accumulate=k)
        init = tx.init

        def step(params, state, c):
            ls = mj.get_loss_scale(state)
            grads = jax.grad(lambda w: ls.scale(jnp.sum(w * c)))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, ls.loss_scale, mj.get_loss_scale(state).loss_scale

    _ACCUMULATION_STEPS[key] = (init, jax.jit(step))
    return _ACCUMULATION_STEPS[key]


def run_accumulation(p: dict, mode: str) -> dict:
    """Natively ``optax.MultiSteps`` around a jmp-style per-micro-batch loss scale (a non-finite micro-batch
    is dropped, the scale adjusted after every micro-batch); under mpx ``with_loss_scaling(tx, accumulate=k)``."""
    cfg, k = p["config"], p["steps"]
    init, step = _accumulation_step(mode, cfg, k, p["lr"])
    params = jnp.full(3, p["w0"], jnp.float32)
    state = init(params)
    applied, scales, micro = [], [], []
    start = np.asarray(params)
    for j, finite in enumerate(p["flags"]):
        c = jnp.float32((j % 4 + 1) * flag_gradient(finite))
        params, state, used, after = step(params, state, c)
        micro.append(float(used))
        if (j + 1) % k == 0:
            applied.append(not np.array_equal(np.asarray(params), start))
            scales.append(float(after))
            start = np.asarray(params)
    return {"applied": applied, "scales": scales, "micro_scales": micro, "param": float(params[0])}

# the fp8 group (issue 26): conformance/fp8/jax.py; the blocks group (issue 31): conformance/blocks/
from conformance.blocks.jax import run_block_quantize  # noqa: E402, F401
from conformance.fp8.jax import run_fp8_matmul, run_fp8_quantize, run_fp8_trace  # noqa: E402, F401


def run_models(p: dict, mode: str) -> dict:
    """A Flax NNX GPT and a linen ResNet, Flax's ``dtype`` against mpx_jax (mpx_tools.models.flax)."""
    from mpx_tools.models import flax as models

    return models.observe(p, mode)
