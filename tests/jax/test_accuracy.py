"""float32, mixed_bfloat16 and mixed_float16 reach the same test accuracy on scikit-learn's digits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
import mpx_jax

datasets = pytest.importorskip("sklearn.datasets")


def data():
    x, y = datasets.load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n = int(len(x) * 0.7)
    return (jnp.asarray(x[:n]), jnp.asarray(y[:n])), (jnp.asarray(x[n:]), jnp.asarray(y[n:]))


def train(policy_name, steps=400):
    policy = mpx.get_policy(policy_name)
    (xtr, ytr), (xte, yte) = data()
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(k1, (64, 64)) * 0.125, "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 10)) * 0.125, "b2": jnp.zeros(10),
    }  # fmt: skip
    params = mpx_jax.cast_to_param(policy, params)

    def forward(p, x):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return h @ p["w2"] + p["b2"]

    net = mpx_jax.autocast(forward, policy)

    def loss_fn(p, x, y):
        logits = net(p, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = mpx_jax.with_loss_scaling(optax.adam(3e-3), mpx.ScalerConfig.for_policy(policy))
    state = tx.init(params)

    @jax.jit
    def step(p, s, x, y):
        grads = jax.grad(lambda q: mpx_jax.get_loss_scale(s).scale(loss_fn(q, x, y)))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    batches = np.array_split(np.arange(len(xtr)), 8)
    for i in range(steps):
        idx = batches[i % len(batches)]
        params, state = step(params, state, xtr[idx], ytr[idx])
    acc = float(jnp.mean(jnp.argmax(jax.jit(net)(params, xte), -1) == yte))
    return acc, mpx_jax.get_loss_scale(state)


def test_same_accuracy_within_one_point():
    acc32, _ = train("float32")
    acc_bf16, _ = train("mixed_bfloat16")
    acc16, ls16 = train("mixed_float16")
    assert acc32 > 0.9
    assert abs(acc_bf16 - acc32) <= 0.01, (acc32, acc_bf16)
    assert abs(acc16 - acc32) <= 0.01, (acc32, acc16)
    assert ls16.config.kind == "dynamic" and int(ls16.steps) == 400
