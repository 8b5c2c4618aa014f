"""mpx_jax.float8_linen: a linen FP8 Dense whose fp8 collection commits with the optimizer (skips, windows)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("flax")
import flax.linen as nn

import mpx
from mpx import float8 as core
from mpx_jax import float8 as f8
from mpx_jax import get_loss_scale, with_loss_scaling
from mpx_jax.float8_linen import Float8Dense, commit_float8, step_outcome

RECIPE = mpx.Float8Recipe(amax_history_len=4)


class MLP(nn.Module):
    recipe: mpx.Float8Recipe

    @nn.compact
    def __call__(self, x):
        return Float8Dense(4, self.recipe, name="l2")(nn.gelu(Float8Dense(16, self.recipe, name="l1")(x)))


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _setup(recipe, accumulate):
    model = MLP(recipe)
    v = model.init(jax.random.key(0), jnp.ones((2, 8)))
    tx = with_loss_scaling(optax.adam(1e-2), mpx.ScalerConfig(init_scale=2.0**8), accumulate=accumulate)
    return model, v["params"], v["fp8"], v["fp8_amax"], tx, tx.init(v["params"])


def _step_fn(model, recipe, tx):
    @jax.jit
    def step(params, fp8, sinks, opt_state, x, y):
        scale = get_loss_scale(opt_state)

        def loss(p, s):
            out = model.apply({"params": p, "fp8": fp8, "fp8_amax": s}, x)
            return scale.scale(jnp.mean((out - y) ** 2))

        gp, ga = jax.grad(loss, argnums=(0, 1))(params, sinks)
        updates, new_opt = tx.update(gp, opt_state, params)
        params = optax.apply_updates(params, updates)
        boundary, applied = step_outcome(opt_state, new_opt)
        fp8 = commit_float8(recipe, fp8, ga, boundary=boundary, applied=applied)
        return params, fp8, new_opt, jnp.stack([ga["l1"]["amax"], ga["l2"]["amax"]])

    return step


def _data(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fp8_collection_follows_the_core_reference_and_a_skip_changes_nothing(accumulate):
    model, params, fp8, sinks, tx, opt = _setup(RECIPE, accumulate)
    step = _step_fn(model, RECIPE, tx)
    ref = core.float8_init(RECIPE, {f"{m}.{r}": r for m in ("l1", "l2") for r in core.ROLES})
    window = None
    for s in range(8):
        x, y = _data(s)
        if s == 4:
            x[0, 0] = np.nan  # this step (and with accumulate=2 its whole window) is skipped
        skipped_before = int(get_loss_scale(opt).skipped_steps)
        if s % accumulate == 0:  # the window's start: its pending amaxes are empty (-inf)
            before = _bits((params, fp8, opt.inner_state))
        params, fp8, opt, amaxes = step(params, fp8, sinks, opt, x, y)
        window = np.asarray(amaxes) if window is None else np.fmax(window, amaxes)
        window = np.where(np.isnan(amaxes), np.nan, window)
        if (s + 1) % accumulate == 0:
            skipped = int(get_loss_scale(opt).skipped_steps) != skipped_before
            if skipped:
                assert _bits((params, fp8, opt.inner_state)) == before
            flat = {
                f"{m}.{r}": float(window[i, j])
                for i, m in enumerate(("l1", "l2"))
                for j, r in enumerate(core.ROLES)
            }
            ref = core.float8_update(RECIPE, ref, flat, skipped=skipped)
            window = None
    assert int(get_loss_scale(opt).skipped_steps) == 1
    for m in ("l1", "l2"):
        for j, r in enumerate(core.ROLES):
            ts = ref.tensors[f"{m}.{r}"]
            assert np.float32(fp8[m]["scale"][j]) == np.float32(ts.scale)
            assert np.array_equal(np.asarray(fp8[m]["history"][j]), np.asarray(ts.amax_history, np.float32))


def test_dense_state_dict_through_the_core():
    model, params, fp8, sinks, tx, opt = _setup(RECIPE, 1)
    params, fp8, opt, _ = _step_fn(model, RECIPE, tx)(params, fp8, sinks, opt, *_data(0))
    state = f8.Float8State(  # the core's types, holding the collection's JAX arrays
        {
            f"{m}.{r}": f8.TensorScale(r, fp8[m]["scale"][j], fp8[m]["history"][j])
            for m in ("l1", "l2")
            for j, r in enumerate(core.ROLES)
        }
    )
    recipe, back = core.load_state_dict(core.state_dict(RECIPE, state))
    assert recipe == RECIPE and back.tensors["l1.input"].amax_history[0] == float(np.abs(_data(0)[0]).max())
