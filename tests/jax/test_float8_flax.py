"""mpx_jax.float8_flax: an NNX FP8 Linear whose state commits with the optimizer (skips, windows, checkpoints)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import mpx  # noqa: E402
from mpx import float8 as core  # noqa: E402
from mpx_jax import get_loss_scale, with_loss_scaling  # noqa: E402
from mpx_jax.float8_flax import (  # noqa: E402
    FLOAT8_GRADS,
    Float8Linear,
    float8_layers,
    float8_state_dict,
    float8_step,
    load_float8_state_dict,
)

RECIPE = mpx.Float8Recipe(amax_history_len=4)


class MLP(nnx.Module):
    def __init__(self, recipe, rngs):
        self.l1 = Float8Linear(8, 16, recipe=recipe, rngs=rngs)
        self.l2 = Float8Linear(16, 4, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _make(recipe=RECIPE, accumulate=1, config=None):
    model = MLP(recipe, nnx.Rngs(0))
    cfg = config or mpx.ScalerConfig(init_scale=2.0**8, growth_interval=3)
    opt = nnx.Optimizer(model, with_loss_scaling(optax.adam(1e-2), cfg, accumulate=accumulate), wrt=nnx.Param)
    return model, opt


def _loss(model, x, y, scale):
    return scale.scale(jnp.mean((model(x) - y) ** 2))


@nnx.jit
def _train_step(model, opt, x, y):
    scale = get_loss_scale(opt)
    grads = nnx.grad(_loss, argnums=FLOAT8_GRADS)(model, x, y, scale)
    float8_step(opt, model, grads)
    # the step's amaxes, for the reference replay
    return jnp.stack([grads["l1"]["fp8_amax"][...], grads["l2"]["fp8_amax"][...]])


def _data(seed, n=16):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype(np.float32), rng.normal(size=(n, 4)).astype(np.float32)


def test_skipped_step_leaves_params_optimizer_and_fp8_state_bit_identical():
    model, opt = _make()
    for s in range(3):
        _train_step(model, opt, *_data(s))
    x, y = _data(9)
    x[0, 0] = np.inf  # the input's amax is inf and the gradients non-finite: the loss scaler skips
    for _ in range(2):
        model_before = _bits(nnx.state(model))
        inner_before = _bits(opt.opt_state.inner_state)
        _train_step(model, opt, x, y)
        assert _bits(nnx.state(model)) == model_before  # parameters and FP8 state (scales, histories)
        assert _bits(opt.opt_state.inner_state) == inner_before  # Adam's moments and count
    assert int(get_loss_scale(opt).skipped_steps) == 2
    # a finite step moves the FP8 state again
    hist = np.asarray(model.l1.fp8_history[...]).copy()
    _train_step(model, opt, *_data(10))
    assert not np.array_equal(np.asarray(model.l1.fp8_history[...]), hist)


def _replay(recipe, amax_steps, applied):
    state = core.float8_init(recipe, {f"{m}.{r}": r for m in ("l1", "l2") for r in core.ROLES})
    for amaxes, ok in zip(amax_steps, applied, strict=True):
        flat = {
            f"{m}.{r}": float(amaxes[i, j])
            for i, m in enumerate(("l1", "l2"))
            for j, r in enumerate(core.ROLES)
        }
        state = core.float8_update(recipe, state, flat, skipped=not ok)
    return state


@pytest.mark.parametrize(
    "recipe", [RECIPE, mpx.Float8Recipe(scaling="current"), mpx.Float8Recipe(format="e4m3")]
)
def test_fp8_state_trace_equals_the_core_reference_with_skips(recipe):
    model, opt = _make(recipe)
    amax_steps, applied = [], []
    for s in range(8):
        x, y = _data(s)
        if s in (2, 5):
            x[1, 3] = np.nan
        skipped_before = int(get_loss_scale(opt).skipped_steps)
        amax_steps.append(np.asarray(_train_step(model, opt, x, y)))
        applied.append(int(get_loss_scale(opt).skipped_steps) == skipped_before)
    assert applied == [True, True, False, True, True, False, True, True]
    ref = core.state_dict(recipe, _replay(recipe, amax_steps, applied))
    assert float8_state_dict(model) == ref


def test_accumulation_windows_commit_the_window_max_at_the_boundary():
    model, opt = _make(accumulate=2)
    steps, windows, applied = [], [], []
    for s in range(8):
        x, y = _data(s)
        if s == 4:
            x[0, 0] = np.inf  # window 3 (micro-steps 4, 5) is skipped
        skipped_before = int(get_loss_scale(opt).skipped_steps)
        hist_before = np.asarray(model.l1.fp8_history[...]).copy()
        steps.append(np.asarray(_train_step(model, opt, x, y)))
        if s % 2 == 0:  # inside the window nothing moves
            assert np.array_equal(np.asarray(model.l1.fp8_history[...]), hist_before)
        else:
            windows.append(np.maximum(steps[-2], steps[-1]))
            applied.append(int(get_loss_scale(opt).skipped_steps) == skipped_before)
    assert applied == [True, True, False, True]
    assert float8_state_dict(model) == core.state_dict(RECIPE, _replay(RECIPE, windows, applied))


def test_checkpoint_round_trips_through_the_core():
    model, opt = _make()
    for s in range(3):
        _train_step(model, opt, *_data(s))
    d = float8_state_dict(model)
    recipe, state = core.load_state_dict(json.loads(json.dumps(d)))
    assert recipe == RECIPE and set(state.tensors) == {f"{m}.{r}" for m in ("l1", "l2") for r in core.ROLES}
    fresh, _ = _make()
    assert [path for path, layer in float8_layers(fresh) if isinstance(layer, Float8Linear)] == ["l1", "l2"]
    load_float8_state_dict(fresh, state_dict=core.state_dict(recipe, state))
    assert float8_state_dict(fresh) == d
    bad = json.loads(json.dumps(d))
    bad["tensors"].pop("l2.grad")
    before = _bits(nnx.state(fresh))
    with pytest.raises(mpx.StateDictError, match="tensors: expected the model's 6 FP8 tensors"):
        load_float8_state_dict(fresh, bad)
    other = core.state_dict(mpx.Float8Recipe(amax_history_len=4, margin=2), state)
    with pytest.raises(mpx.StateDictError, match="recipe: .* differs from the model's in margin"):
        load_float8_state_dict(fresh, other)
    assert _bits(nnx.state(fresh)) == before


def test_policy_gives_the_recipe_and_a_policy_without_fp8_is_refused():
    layer = Float8Linear(2, 2, recipe=mpx.get_policy("mixed_bfloat16_fp8"), rngs=nnx.Rngs(0))
    assert layer.recipe == mpx.Float8Recipe()
    with pytest.raises(core.Float8Error, match="recipe: this policy has no fp8 recipe"):
        Float8Linear(2, 2, recipe=mpx.get_policy("mixed_bfloat16"), rngs=nnx.Rngs(0))


# -- a small transformer ----------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, d, recipe, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = Float8Linear(d, 3 * d, recipe=recipe, rngs=rngs)
        self.proj = Float8Linear(d, d, recipe=recipe, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = Float8Linear(d, 4 * d, recipe=recipe, rngs=rngs)
        self.down = Float8Linear(4 * d, d, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        _, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        att = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(d)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        x = x + self.proj(jnp.einsum("bts,bsd->btd", jax.nn.softmax(att, axis=-1), v))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab, d, recipe, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, recipe, rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)  # the last layer stays out of FP8 (@head={fp8=none})

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def test_small_transformer_trains_under_fp8_hybrid_and_compiles_once():
    policy = mpx.get_policy("mixed_bfloat16_fp8")
    recipe = policy.fp8.__class__(**{**policy.fp8.to_dict(), "amax_history_len": 16})
    vocab, seq = 16, 12
    model = TinyLM(vocab, 32, recipe, nnx.Rngs(0))
    opt = nnx.Optimizer(model, with_loss_scaling(optax.adam(3e-3), "mixed_float16"), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, opt, tokens):
        traces.append(1)
        scale = get_loss_scale(opt)

        def loss_fn(model):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return scale.scale(loss), loss

        grads, loss = nnx.grad(loss_fn, argnums=FLOAT8_GRADS, has_aux=True)(model)
        float8_step(opt, model, grads)
        return loss

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(60):
        start = rng.integers(0, vocab, size=(16, 1))
        tokens = (start + np.arange(seq + 1)) % vocab  # counting sequences: next token = this + 1
        losses.append(float(step(model, opt, jnp.asarray(tokens, jnp.int32))))
    assert len(traces) == 1
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    st = float8_state_dict(model)
    scales = [t["scale"] for t in st["tensors"].values()]
    assert all(s != 1.0 for s in scales)  # every scale moved off its initial value


def test_float8_step_refuses_swapped_arguments():
    model, opt = _make()
    with pytest.raises(mpx.UnsupportedTypeError, match="optimizer: float8_step"):
        float8_step(model, opt, nnx.state(model))


def test_replicas_commit_the_max_of_their_amaxes():
    from mpx_jax.float8_flax import Float8Amax, commit_float8

    model, _ = _make()
    graphdef, state = nnx.split(model)
    sinks = nnx.state(model, Float8Amax)
    per = np.array([[1.0, 5.0, 2.0], [4.0, 0.5, np.nan]], np.float32)  # 2 replicas' (input, weight, grad)
    reps = jax.tree_util.tree_map(lambda _: jnp.asarray(per), sinks)

    def commit(state, amax_grads):
        m = nnx.merge(graphdef, state)
        commit_float8(m, amax_grads, axis_name="r")
        return nnx.state(m, type(m.l1.fp8_scale))

    out = jax.vmap(commit, in_axes=(None, 0), axis_name="r")(state, reps)
    ref = core.float8_update(
        RECIPE,
        core.float8_init(RECIPE, dict(zip(core.ROLES, core.ROLES, strict=True))),
        core.reduce_amaxes([dict(zip(core.ROLES, row.tolist(), strict=True)) for row in per]),
    )
    want = np.asarray([ref.tensors[r].scale for r in core.ROLES], np.float32)
    for layer in ("l1", "l2"):
        scales = np.asarray(out[layer]["fp8_scale"][...])
        assert np.array_equal(scales, np.stack([want, want])), scales
