"""The JAX side of ``mpx compare``: Flax linen models, optax Adam under ``mpx_jax.with_loss_scaling``."""

from __future__ import annotations

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
from mpx_compare.workers.common import Settings, batches, record, run_all
from mpx_jax.flax import policy_apply

__all__ = ["build", "compare", "info"]


def info(device: str) -> dict[str, Any]:
    import flax

    return {"framework": "jax", "versions": {"jax": jax.__version__, "flax": flax.__version__,
                                             "optax": optax.__version__}, "device": jax.default_backend()}  # fmt: skip


class _MLP(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.classes)(x)


class _CNN(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x[..., None]))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


class _Transformer(nn.Module):
    classes: int
    d: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.d, name="embed")(x)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.LayerNorm()(x))))
        x = nn.LayerNorm()(x + h)
        return nn.Dense(self.classes, name="head")(x.mean(axis=1))


def build(model: str, classes: int) -> Callable[[int], tuple[nn.Module, Any]]:
    """``make_model(seed) -> (linen module, variables)`` for a built-in model on ``(n, 8, 8)`` inputs."""

    def make(seed: int) -> tuple[nn.Module, Any]:
        module = {"mlp": _MLP, "cnn": _CNN, "transformer": _Transformer}[model](classes)
        return module, module.init(jax.random.key(seed), jnp.zeros((1, 8, 8), jnp.float32))

    return make


def _train(make_model: Callable[[int], tuple[nn.Module, Any]], data: Sequence[np.ndarray], policy: str,
           seed: int, settings: Settings) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    p = mpx.get_policy(policy)
    module, variables = make_model(seed)
    apply = policy_apply(module, p) if p.lowers_precision else module.apply
    tx = mpx_jax.with_loss_scaling(optax.adam(settings.lr), mpx.ScalerConfig.for_policy(p))
    opt_state = tx.init(variables)

    def loss_fn(v: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = apply(v, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(v: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array]:
        ls = mpx_jax.get_loss_scale(s)
        loss, grads = jax.value_and_grad(lambda w: ls.scale(loss_fn(w, x, y)))(v)
        updates, s = tx.update(grads, s, v)
        return optax.apply_updates(v, updates), s, loss / ls.loss_scale, mpx_jax.get_loss_scale(s).loss_scale

    xt, yt, xv, yv = (jnp.asarray(a) for a in data)
    losses, scales = [], []
    recorder = mpx_jax.HistoryRecorder()
    for idx in batches(len(xt), settings, seed):
        variables, opt_state, loss, scale = step(variables, opt_state, xt[idx], yt[idx])
        recorder.record(opt_state)
        losses.append(float(loss))
        scales.append(float(scale))
    logits = jax.jit(apply)(variables, xv).astype(jnp.float32)
    val_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, yv).mean())
    acc = float((logits.argmax(axis=1) == yv).mean())
    skipped = mpx_jax.get_loss_scale(opt_state).state.skipped_steps
    history = recorder.history() if len(recorder) else None
    return record("jax", policy, seed, losses, scales, skipped, val_loss, acc, time.perf_counter() - t0,
                  history=history)  # fmt: skip


def compare(make_model: Callable[[int], tuple[nn.Module, Any]], data: Sequence[np.ndarray], *,
            policies: Sequence[str], seeds: Sequence[int] = (0,), settings: Settings | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Train a Flax linen model in float32 and under each policy; one run record per policy and seed.

    ``make_model(seed)`` returns ``(module, variables)`` (``module.init`` with
    ``jax.random.key(seed)``); ``data`` is ``(x_train, y_train, x_val, y_val)``
    with integer labels (cross-entropy).  Each run: ``mpx_jax.flax.policy_apply``
    for a lowering policy, ``optax.adam`` inside ``mpx_jax.with_loss_scaling``
    with ``ScalerConfig.for_policy``.
    """
    settings = settings or Settings()
    return run_all(lambda p, s: _train(make_model, data, p, s, settings), list(policies), list(seeds), progress)
