"""The JAX side of ``mpx compare``: Flax linen models, optax Adam under ``mpx_jax.with_loss_scaling``."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpx
import mpx_jax
from mpx.blocks import BlockRecipe
from mpx.update_policy import needs_policy_optimizer
from mpx_compare.workers.common import Settings, batches, record, run_all
from mpx_jax.blocks_flax import STEP_COLLECTION, BlockDense
from mpx_jax.flax import policy_apply
from mpx_jax.float8_linen import Float8Dense, commit_float8, step_outcome
from mpx_jax.optim import policy_optimizer

__all__ = ["build", "compare", "info"]


def info(device: str) -> dict[str, Any]:
    import flax

    return {"framework": "jax", "versions": {"jax": jax.__version__, "flax": flax.__version__,
                                             "optax": optax.__version__}, "device": jax.default_backend()}  # fmt: skip


def _dense(features: int, name: str, policy: Any, seed: int = 0, index: int = 0) -> nn.Module:
    """``nn.Dense``, or where ``policy`` gives module ``name`` FP8 a :class:`mpx_jax.float8_linen.Float8Dense`
    (per-tensor recipe) or :class:`mpx_jax.blocks_flax.BlockDense` (block recipe; ``seed`` and ``index``
    key a seeded one's gradients, as torch's ``blocks.convert(model, policy, seed=seed)``)."""
    recipe = None if policy is None else policy.for_module(name).fp8
    if recipe is None:
        return nn.Dense(features, name=name)
    if isinstance(recipe, BlockRecipe):
        return BlockDense(features, recipe, seed=seed, index=index, name=name)
    return Float8Dense(features, recipe=recipe, name=name)


class _MLP(nn.Module):
    classes: int
    policy: Any = None  # an mpx.Policy with fp8=: its Dense layers run FP8 GEMMs
    seed: int = 0  # the run's seed: a seeded block recipe's key

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(_dense(128, "hidden", self.policy, self.seed, 0)(x.reshape(x.shape[0], -1)))
        return _dense(self.classes, "head", self.policy, self.seed, 1)(x)


class _CNN(nn.Module):
    classes: int
    policy: Any = None
    seed: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x[..., None]))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        return _dense(self.classes, "head", self.policy, self.seed, 0)(x.mean(axis=(1, 2)))


class _Transformer(nn.Module):
    classes: int
    policy: Any = None
    seed: int = 0
    d: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = _dense(self.d, "embed", self.policy, self.seed, 0)(x)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.gelu(_dense(2 * self.d, "mlp_in", self.policy, self.seed, 1)(nn.LayerNorm()(x)))
        h = _dense(self.d, "mlp_out", self.policy, self.seed, 2)(h)
        x = nn.LayerNorm()(x + h)
        return _dense(self.classes, "head", self.policy, self.seed, 3)(x.mean(axis=1))


def build(model: str, classes: int) -> Callable[..., tuple[nn.Module, Any]]:
    """``make_model(seed, policy=None) -> (linen module, variables)`` for a built-in model on ``(n, 8, 8)``
    inputs; under a policy with ``fp8=`` its ``Dense`` layers are :class:`mpx_jax.float8_linen.Float8Dense`,
    or :class:`mpx_jax.blocks_flax.BlockDense` under a block recipe (``fp8=mxfp8``, ``fp4=nvfp4``...; the
    attention's projections stay ``DenseGeneral``, as torch's ``MultiheadAttention`` keeps its own)."""

    def make(seed: int, policy: Any = None) -> tuple[nn.Module, Any]:
        fp8 = policy if policy is not None and _uses_fp8(policy) else None
        module = {"mlp": _MLP, "cnn": _CNN, "transformer": _Transformer}[model](classes, fp8, seed)
        # jitted: an eager init of block layers would quantize op by op (a minute on a loaded CPU)
        return module, jax.jit(module.init)(jax.random.key(seed), jnp.zeros((1, 8, 8), jnp.float32))

    return make


def _uses_fp8(policy: mpx.Policy) -> bool:
    return policy.fp8 is not None or any(rule.policy.fp8 is not None for rule in policy.overrides)


def _recipe(module: nn.Module, variables: Any, sample: jax.Array) -> mpx.Float8Recipe | None:
    """The one FP8 recipe of the model's Float8Dense layers (None: no FP8 layer), read from a shape-only call."""
    if "fp8" not in variables:
        return None
    recipes: set[mpx.Float8Recipe] = set()

    def spy(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if isinstance(context.module, Float8Dense):
            recipes.add(context.module.recipe)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        jax.eval_shape(lambda v: module.apply(v, sample), variables)
    if len(recipes) != 1:
        raise mpx.MPXError(
            f"policy: the model's FP8 layers use {len(recipes)} different recipes; mpx compare's JAX worker "
            "commits one recipe (give every FP8 layer the same fp8_* keys)"
        )
    return recipes.pop()


def _block_layers(module: nn.Module, variables: Any, sample: jax.Array) -> int:
    """How many :class:`mpx_jax.blocks_flax.BlockDense` layers the model calls (a shape-only call)."""
    names: set[tuple[str, ...]] = set()

    def spy(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        if isinstance(context.module, BlockDense):
            names.add(context.module.path)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        jax.eval_shape(lambda v: module.apply(v, sample), variables)
    return len(names)


def _make(
    make_model: Callable[..., tuple[nn.Module, Any]], seed: int, policy: mpx.Policy
) -> tuple[nn.Module, Any]:
    """``make_model(seed, policy)`` under an FP8 policy when it takes a second argument, else ``make_model(seed)``."""
    if _uses_fp8(policy):
        params = inspect.signature(make_model).parameters.values()
        if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2 or any(
            p.kind is p.VAR_POSITIONAL for p in params
        ):
            return make_model(seed, policy)
    return make_model(seed)


def _train(make_model: Callable[..., tuple[nn.Module, Any]], data: Sequence[np.ndarray], policy: str,
           seed: int, settings: Settings) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    p = mpx.get_policy(policy)
    module, variables = _make(make_model, seed, p)
    recipe = _recipe(module, variables, jnp.asarray(data[0][:1])) if _uses_fp8(p) else None
    blocks = _block_layers(module, variables, jnp.asarray(data[0][:1])) if _uses_fp8(p) else 0
    apply = policy_apply(module, p) if p.lowers_precision or recipe is not None or blocks else module.apply
    # a seeded block recipe's step counters: advanced by every training apply, skipped steps too (torch's)
    steps = [STEP_COLLECTION] if STEP_COLLECTION in variables else []
    inner = optax.adam(settings.lr)
    if needs_policy_optimizer(p):  # master/update/opt_state keys: the policy optimizer steps Adam
        inner = policy_optimizer(inner, p, seed=seed)
    tx = mpx_jax.with_loss_scaling(inner, mpx.ScalerConfig.for_policy(p))
    # the optimizer trains the params; the fp8 collection moves by commit_float8, fp8_amax is its sink
    params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    if needs_policy_optimizer(
        p
    ):  # the policy optimizer writes the params in the param dtype (bfloat16 masters)
        params = mpx_jax.cast_to_param(p, params)
    opt_state = tx.init(params)
    opt_state = mpx_jax.set_loss_scale(opt_state, mpx_jax.get_loss_scale(opt_state).record_history())

    def loss_fn(w: Any, amax: Any, rest: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, Any]:
        v = {**rest, "params": w, **({"fp8_amax": amax} if amax is not None else {})}
        out, moved = apply(v, x, mutable=steps) if steps else (apply(v, x), {})
        logits = out.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), moved

    @jax.jit
    def step(w: Any, rest: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, ...]:
        ls = mpx_jax.get_loss_scale(s)
        amax = rest.get("fp8_amax")

        def scaled(w: Any, a: Any) -> tuple[jax.Array, Any]:
            loss, moved = loss_fn(w, a, rest, x, y)
            return ls.scale(loss), moved

        (loss, moved), (grads, amax_grads) = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(w, amax)
        rest = {**rest, **moved}
        updates, new_s = tx.update(grads, s, w)
        if recipe is not None:
            boundary, applied = step_outcome(s, new_s)
            fp8 = commit_float8(recipe, rest["fp8"], amax_grads, boundary=boundary, applied=applied)
            rest = {**rest, "fp8": fp8}
        return (
            optax.apply_updates(w, updates),
            rest,
            new_s,
            loss / ls.loss_scale,
            mpx_jax.get_loss_scale(new_s).loss_scale,
        )

    xt, yt, xv, yv = (jnp.asarray(a) for a in data)
    losses, scales = [], []
    for idx in batches(len(xt), settings, seed):
        params, rest, opt_state, loss, scale = step(params, rest, opt_state, xt[idx], yt[idx])
        losses.append(float(loss))
        scales.append(float(scale))
    logits = jax.jit(apply)({**rest, "params": params}, xv).astype(jnp.float32)
    val_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, yv).mean())
    acc = float((logits.argmax(axis=1) == yv).mean())
    skipped = mpx_jax.get_loss_scale(opt_state).state.skipped_steps
    history = mpx_jax.get_loss_scale(opt_state).history() if losses else None
    fp8_layers = blocks + len(jax.tree_util.tree_leaves(rest.get("fp8", {}))) // 3  # scale, history, pending
    return record("jax", policy, seed, losses, scales, skipped, val_loss, acc, time.perf_counter() - t0,
                  history=history, fp8_layers=fp8_layers)  # fmt: skip


def compare(make_model: Callable[[int], tuple[nn.Module, Any]], data: Sequence[np.ndarray], *,
            policies: Sequence[str], seeds: Sequence[int] = (0,), settings: Settings | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train a Flax linen model in float32 and under each policy; one run record per policy and seed.

    ``make_model(seed)`` returns ``(module, variables)`` (``module.init`` with
    ``jax.random.key(seed)``); ``data`` is ``(x_train, y_train, x_val, y_val)``
    with integer labels (cross-entropy).  Each run: ``mpx_jax.flax.policy_apply``
    for a lowering policy, ``optax.adam`` (on the ``params`` collection) inside
    ``mpx_jax.with_loss_scaling`` with ``ScalerConfig.for_policy``.  Under a policy
    with ``fp8=``, ``make_model(seed, policy)`` is called and its
    :class:`mpx_jax.float8_linen.Float8Dense` layers' ``fp8`` collection commits
    after each step (:func:`mpx_jax.float8_linen.commit_float8`, nothing on a
    skipped step); the layers must share one recipe.  Under a block recipe (``fp8=mxfp8``, ``fp4=nvfp4``...)
    they are :class:`mpx_jax.blocks_flax.BlockDense` (stateless; a seeded recipe's ``mpx_blocks`` step
    counters advance with every training apply) and ``fp8_layers`` counts them.  A ``make_model`` that takes
    only the seed is called as before: its ``nn.Dense`` layers stay out of FP8 and
    the run reports ``fp8_layers`` 0.
    """
    settings = settings or Settings()
    return run_all(
        lambda p, s: _train(make_model, data, p, s, settings), list(policies), list(seeds), progress
    )
