import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpx
import mpx_jax
from mpx_jax import autocast

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
KEY = jax.random.PRNGKey(0)


def rand(shape, dtype=F32, key=0):
    return jax.random.normal(jax.random.PRNGKey(key), shape).astype(dtype)


# canonical op -> (a JAX function, its inputs)
def op_cases():
    a, b = rand((4, 6)), rand((6, 5), key=1)
    img, ker = rand((1, 2, 6, 6)), rand((3, 2, 3, 3), key=2)
    v = rand((4, 6), key=3)
    return {
        "matmul": (lambda x, y: x @ y, (a, b)),
        "linear": (lambda x, y: jnp.dot(x, y), (a, b)),
        "einsum": (lambda x, y: jnp.einsum("ij,jk->ik", x, y), (a, b)),
        "bmm": (lambda x, y: jnp.matmul(x, y), (rand((2, 4, 6)), rand((2, 6, 3), key=4))),
        "conv": (lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"), (img, ker)),
        "softmax": (jax.nn.softmax, (v,)),
        "log_softmax": (jax.nn.log_softmax, (v,)),
        "logsumexp": (jax.nn.logsumexp, (v,)),
        "layer_norm": (jax.nn.standardize, (v,)),
        "exp": (jnp.exp, (v,)),
        "log": (lambda x: jnp.log(jnp.abs(x) + 1), (v,)),
        "pow": (lambda x: jnp.abs(x) ** 1.5, (v,)),
        "sum": (jnp.sum, (v,)),
        "mean": (jnp.mean, (v,)),
        "cumsum": (lambda x: jnp.cumsum(x, axis=1), (v,)),
        "prod": (jnp.prod, (v,)),
        "vector_norm": (jnp.linalg.norm, (v,)),
        "mse_loss": (lambda x, y: jnp.mean((x - y) ** 2), (v, a)),
        "cross_entropy": (lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.arange(4)), (v,)),
        "add": (lambda x, y: x + y, (v, a)),
        "mul": (lambda x, y: x * y, (v, a)),
        "cat": (lambda x, y: jnp.concatenate([x, y]), (v, a)),
        "stack": (lambda x, y: jnp.stack([x, y]), (v, a)),
        "where": (lambda x, y: jnp.where(x > 0, x, y), (v, a)),
        "relu": (jax.nn.relu, (v,)),
        "gelu": (jax.nn.gelu, (v,)),
        "max_pool": (
            lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"),
            (img,),
        ),
        "reshape": (lambda x: x.reshape(-1), (v,)),
        "transpose": (lambda x: x.T, (v,)),
        "embedding": (lambda t: t[jnp.array([0, 2])], (v,)),
    }


CASES = op_cases()
# built from several primitives (no name JAX keeps): their class comes from the primitives
COMPOSITE = {"cross_entropy", "mse_loss"}


def test_every_table_op_has_a_case():
    assert set(CASES) >= set(mpx.OP_TABLE) - {
        "attention",
        "conv_transpose",
        "batch_norm",
        "group_norm",
        "rms_norm",
        "nll_loss",
        "bce_with_logits",
        "dropout",
    }


@pytest.mark.parametrize(
    "policy", ["mixed_bfloat16", "mixed_float16", "bfloat16", "params=float32,compute=float16,keep_fp32=none"]
)
@pytest.mark.parametrize("in_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("op", sorted(CASES))
def test_output_dtype_follows_the_op_table(op, in_dtype, policy):
    if "keep_fp32=none" in policy and op in COMPOSITE:
        pytest.skip("a loss built from primitives has no category: its sums stay float32")
    fn, args = CASES[op]
    args = tuple(x.astype(in_dtype) for x in args)
    expected = mpx.result_dtype(op, policy, [str(x.dtype) for x in args])
    out = autocast(fn, policy)(*args)
    assert str(out.dtype) == expected, (op, in_dtype, policy)


@pytest.mark.parametrize("op", ["matmul", "softmax", "sum", "add", "gelu", "conv"])
def test_dtypes_and_values_under_jit(op):
    fn, args = CASES[op]
    eager = autocast(fn, "mixed_bfloat16")(*args)
    jitted = jax.jit(autocast(fn, "mixed_bfloat16"))(*args)
    assert jitted.dtype == eager.dtype
    np.testing.assert_allclose(
        np.asarray(jitted, np.float32), np.asarray(eager, np.float32), rtol=2e-2, atol=2e-2
    )
    ref = fn(*args)
    np.testing.assert_allclose(np.asarray(eager, np.float32), np.asarray(ref), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("policy", ["float32", "params=float64,compute=float64"])
def test_float32_policy_alone_runs_fn_unchanged(policy):
    def f(x, w):
        return jax.nn.softmax(x.astype(BF16) @ w.astype(BF16)), x * 2

    x, w = rand((3, 4)), rand((4, 5), key=1)
    g = autocast(f, policy)
    assert g.__name__ == "f" and g.__wrapped__ is f
    assert str(jax.make_jaxpr(g)(x, w)) == str(jax.make_jaxpr(f)(x, w))
    for a, b in zip(g(x, w), f(x, w), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_matmul_accumulates_in_float32():
    # 4096 products of 1 * 2**-12 in bfloat16: exact with float32 accumulation (1.0), not in bf16 adds
    x = jnp.ones((1, 4096), F32)
    w = jnp.full((4096, 1), 2.0**-12, F32)
    out = autocast(lambda a, b: a @ b, "mixed_bfloat16")(x, w)
    assert out.dtype == BF16 and float(out[0, 0]) == 1.0
    jaxpr = jax.make_jaxpr(autocast(lambda a, b: a @ b, "mixed_bfloat16"))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.params["preferred_element_type"] == np.float32 for e in dots)
    assert all(v.aval.dtype == BF16 for e in dots for v in e.invars)


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(x.shape[0]) % 3))


PARAMS = {"w1": rand((5, 8), key=5), "b1": jnp.zeros(8), "w2": rand((8, 3), key=6)}
XB = rand((6, 5), key=7)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_grad_composes_and_gradients_keep_param_dtype(policy):
    loss = autocast(mlp, policy)
    value, grads = jax.value_and_grad(loss)(PARAMS, XB)
    assert value.dtype == F32
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))
    ref = jax.grad(mlp)(PARAMS, XB)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0.1, atol=2e-2)
    jitted = jax.jit(jax.grad(loss))(PARAMS, XB)
    for g, r in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-2, atol=1e-3)
    # autocast of a function that itself takes the gradient lowers the backward matmuls too
    inner = jax.jit(autocast(jax.grad(mlp), policy))(PARAMS, XB)
    compute = mpx.numpy_dtype(mpx.get_policy(policy).compute_dtype)
    assert inner["w1"].dtype == compute and inner["w2"].dtype == compute and inner["b1"].dtype == F32
    for g, r in zip(jax.tree_util.tree_leaves(inner), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), rtol=0.1, atol=3e-2)


def test_custom_jvp_rules_survive():
    # relu's custom JVP gives 0 at 0 (plain autodiff of max(x, 0) would give 0.5)
    g = jax.grad(lambda x: autocast(lambda y: jax.nn.relu(y).sum(), "mixed_bfloat16")(x))(jnp.zeros(3))
    assert g.tolist() == [0.0, 0.0, 0.0]


def test_custom_vjp_uses_its_own_backward():
    @jax.custom_vjp
    def clip_grad(x):
        return x * 2

    clip_grad.defvjp(lambda x: (x * 2, None), lambda _, g: (jnp.full_like(g, 7.0),))

    def f(w):
        return clip_grad(XB @ w).sum()

    g = jax.grad(autocast(f, "mixed_bfloat16"))(PARAMS["w1"])
    ref = jax.grad(f)(PARAMS["w1"])
    assert g.dtype == F32
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_vmap_composes_both_ways():
    f = autocast(lambda x, w: jax.nn.softmax(x @ w), "mixed_bfloat16")
    out = jax.vmap(f, in_axes=(0, None))(rand((3, 4, 5)), PARAMS["w1"])
    assert out.shape == (3, 4, 8) and out.dtype == F32
    g = autocast(jax.vmap(lambda x, w: x @ w, in_axes=(0, None)), "mixed_bfloat16")
    assert g(rand((3, 4, 5)), PARAMS["w1"]).dtype == BF16


def test_scan_cond_while():
    w = rand((4, 4), key=8) * 0.3

    def rnn(xs):
        def body(c, x):
            c = jnp.tanh(c @ w + x)
            return c, c @ w

        return jax.lax.scan(body, jnp.zeros(4), xs)

    f = autocast(rnn, "mixed_bfloat16")
    carry, ys = f(rand((5, 4), key=9))
    assert carry.dtype == F32  # carries keep their traced dtype
    assert ys.dtype == BF16  # per-step outputs follow the op table
    _ref_c, ref_y = rnn(rand((5, 4), key=9))
    np.testing.assert_allclose(np.asarray(ys, np.float32), np.asarray(ref_y), atol=5e-2)
    g = jax.grad(lambda xs: f(xs)[1].astype(F32).sum())(rand((5, 4), key=9))
    assert g.dtype == F32 and bool(jnp.all(jnp.isfinite(g)))

    def branches(x, pick):
        same = jax.lax.cond(pick, lambda a: a @ a.T, lambda a: (a * 2) @ a.T, x)
        mixed = jax.lax.cond(pick, lambda a: a @ a.T, lambda a: a * 2, x)
        return same, mixed

    same, mixed = jax.jit(autocast(branches, "mixed_bfloat16"))(rand((3, 3)), True)
    assert same.dtype == BF16 and mixed.dtype == F32  # branches that disagree keep the traced dtype

    def loop(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))

    n, out = autocast(loop, "mixed_bfloat16")(rand((2, 4)))
    assert int(n) == 3 and out.dtype == F32


def test_checkpoint_and_nested_jit_and_kwargs():
    def f(x, w, *, scale=1.0):
        h = jax.checkpoint(lambda a: jnp.tanh(a @ w))(x)
        return jax.jit(lambda a: jnp.sum(a) * scale)(h)

    g = autocast(f, "mixed_bfloat16")
    out = g(XB, PARAMS["w1"], scale=2.0)
    assert out.dtype == F32
    np.testing.assert_allclose(float(out), float(f(XB, PARAMS["w1"], scale=2.0)), rtol=2e-2)
    grads = jax.grad(g, argnums=1)(XB, PARAMS["w1"], scale=2.0)
    assert grads.dtype == F32


NAMED_FLOAT32 = {
    "softmax": lambda a: jax.nn.softmax(a, axis=-1),
    "log_softmax": lambda a: jax.nn.log_softmax(a, axis=-1),
    "layer_norm": lambda a: jax.nn.standardize(a, axis=-1),
}


@pytest.mark.parametrize("table", [None, mpx.OP_TABLE.replace(exp="lower")], ids=["default", "exp-lower"])
@pytest.mark.parametrize("half", [BF16, F16])
@pytest.mark.parametrize("op", sorted(NAMED_FLOAT32))
def test_named_float32_functions_compute_in_float32_on_half_inputs(op, half, table):
    # jax traces these at the input's half dtype with its own casts back to it (log_softmax rounds its
    # sum to bfloat16); under a mixed policy the whole function, forward and backward, is float32.
    # With exp lowered, softmax is traced as a named custom-JVP call and differentiated at float32.
    fn = NAMED_FLOAT32[op]
    x = (rand((4, 64)) * 3).astype(half)
    policy = f"mixed_{jnp.dtype(half).name}"
    out = jax.jit(autocast(fn, policy, op_table=table))(x)
    assert out.dtype == F32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(x.astype(F32))))

    w = rand((4, 64), key=7)
    grad = jax.grad(lambda a: jnp.sum(w * autocast(fn, policy, op_table=table)(a)))(x)
    ref = jax.grad(lambda a: jnp.sum(w * fn(a.astype(F32))))(x)  # float32 backward, rounded once to half
    assert grad.dtype == half
    ulp = np.asarray(jnp.finfo(half).eps, np.float32)
    err = np.abs(np.asarray(grad, np.float32) - np.asarray(ref, np.float32))
    tiny = np.asarray(jnp.finfo(half).tiny, np.float32)
    assert np.all(err <= ulp * np.abs(np.asarray(ref, np.float32)) + tiny), (op, float(err.max()))


@pytest.mark.parametrize("in_dtype", [BF16, F16])
@pytest.mark.parametrize("compute", [BF16, F16])
@pytest.mark.parametrize("op", sorted(NAMED_FLOAT32))
def test_keep_fp32_none_runs_named_functions_in_the_compute_dtype(op, compute, in_dtype):
    policy = f"params=float32,compute={jnp.dtype(compute).name},keep_fp32=none"
    assert autocast(NAMED_FLOAT32[op], policy)(rand((4, 8)).astype(in_dtype)).dtype == compute


COMPOSITE_LOSSES = {
    "mse": lambda x, y: jnp.mean((x - y) ** 2),
    "rms_norm": lambda x, y: x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6),
    "bce": lambda x, y: optax.sigmoid_binary_cross_entropy(x, y).mean(),
}


@pytest.mark.parametrize("half", [BF16, F16])
@pytest.mark.parametrize("name", sorted(COMPOSITE_LOSSES))
def test_elementwise_work_feeding_float32_ops_runs_in_float32(name, half):
    # the difference and the square of a hand-written MSE feed only its mean: computed in half
    # precision they would be rounded before the float32 reduction; under mpx they are float32
    fn = COMPOSITE_LOSSES[name]
    x, y = (rand((4, 8)) * 3).astype(half), jax.nn.sigmoid(rand((4, 8), key=5)).astype(half)
    out = jax.jit(autocast(fn, f"mixed_{jnp.dtype(half).name}"))(x, y)
    ref = fn(x.astype(F32), y.astype(F32))
    assert out.dtype == F32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=0)


def test_elementwise_work_that_is_returned_or_lowered_keeps_its_dtype():
    def f(x, y, w):
        s = x + y
        return s, jnp.sum(s), jax.nn.gelu(x) @ w, jnp.sum((x - y) ** 2)

    x, y = rand((4, 8)).astype(BF16), rand((4, 8), key=1).astype(BF16)
    s, total, h, sq = autocast(f, "mixed_bfloat16")(x, y, rand((8, 3), key=2))
    assert (s.dtype, total.dtype, h.dtype, sq.dtype) == (BF16, F32, BF16, F32)
    # s is returned, so it stays bfloat16 and the sum reduces those bfloat16 values
    assert total == jnp.sum(s.astype(F32))
    assert sq == jnp.sum((x.astype(F32) - y.astype(F32)) ** 2)


def test_op_table_override_and_keep_fp32():
    v = rand((4, 6))
    table = mpx.OP_TABLE.replace(log_softmax="lower", exp="passthrough")
    assert autocast(jax.nn.log_softmax, "mixed_bfloat16", op_table=table)(v).dtype == BF16
    assert autocast(jax.nn.log_softmax, "mixed_bfloat16")(v.astype(BF16)).dtype == F32
    assert autocast(jax.nn.log_softmax, "params=float32,compute=bfloat16,keep_fp32=none")(v).dtype == BF16
    assert autocast(jnp.exp, "mixed_bfloat16", op_table=table)(v.astype(BF16)).dtype == BF16
    with pytest.raises(mpx.MPXError, match="op_table"):
        autocast(jnp.exp, "mixed_bfloat16", op_table={"exp": "lower"})


def test_integer_and_key_inputs_pass_through():
    def f(key, idx, table):
        noise = jax.random.normal(key, (2, 3))
        return table[idx] @ noise.T, idx * 2

    out, ints = autocast(f, "mixed_float16")(KEY, jnp.array([0, 1]), rand((4, 3)))
    assert out.dtype == F16 and ints.dtype == jnp.int32


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_dot_product_attention_in_half_precision_runs_on_cpu(policy):
    compute = mpx.get_policy(policy).compute_dtype
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 2, 8)), compute)
    if compute == "float16":  # JAX's own float16 attention picks a dot algorithm XLA:CPU cannot lower
        with pytest.raises(ValueError, match="F16_F16_F32"):
            jax.jit(jax.nn.dot_product_attention)(q, q, q)
    out = jax.jit(autocast(jax.nn.dot_product_attention, policy))(q, q, q)
    assert out.dtype == compute
    want = jax.nn.dot_product_attention(*(q.astype(jnp.float32),) * 3)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=0.05)


def test_integer_power_stays_elementwise_and_lax_pow_is_float32():
    x = jnp.ones((3,), jnp.bfloat16)
    assert autocast(lambda a: a**2, "mixed_bfloat16")(x).dtype == jnp.bfloat16
    assert autocast(lambda a: jnp.power(a, 2.5), "mixed_bfloat16")(x).dtype == jnp.float32


def bitcast_after_matmul(x, w):
    # the matmul lowers to bfloat16; a 32-bit bitcast of a 16-bit value is refused
    return jax.lax.bitcast_convert_type(x @ w, jnp.int32)


def linear_solve(a, b):
    return jax.lax.custom_linear_solve(lambda v: a @ v, b, lambda mv, bb: bb / 2)


def test_a_refused_retyping_warns_once_per_primitive_and_runs_at_the_traced_dtypes():
    x, w = rand((2, 3)), rand((3, 4), key=1)
    f = autocast(bitcast_after_matmul, "mixed_bfloat16")
    with pytest.warns(mpx_jax.AutocastFallbackWarning) as rec:
        out = f(x, w)
        f(x, w)  # a second trace: no second warning for the same primitive
    fallbacks = [r for r in rec if r.category is mpx_jax.AutocastFallbackWarning]
    assert len(fallbacks) == 1
    message = str(fallbacks[0].message)
    assert "bitcast_convert_type" in message and "['bfloat16']" in message and "['float32']" in message
    assert "strict=True" in message
    # it ran at its traced dtype: the bfloat16 product cast back to float32, then bitcast
    h = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32).astype(BF16).astype(F32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.lax.bitcast_convert_type(h, jnp.int32)))


def test_a_primitive_autocast_cannot_look_inside_warns():
    a, b = jnp.eye(3) * 2, jnp.ones(3)
    with pytest.warns(mpx_jax.AutocastFallbackWarning, match="custom_linear_solve.*does not look inside"):
        out = autocast(linear_solve, "mixed_bfloat16")(a, b)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(linear_solve(a, b)))


@pytest.mark.parametrize("fn", [bitcast_after_matmul, linear_solve], ids=["refused", "opaque"])
def test_strict_raises_instead(fn):
    args = (rand((3, 3)), rand((3, 3), key=1)) if fn is bitcast_after_matmul else (jnp.eye(3), jnp.ones(3))
    g = autocast(fn, "mixed_bfloat16", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx_jax.AutocastFallbackWarning)
        with pytest.raises(mpx_jax.AutocastError, match="could not run .* strict=True") as info:
            g(*args)
    assert isinstance(info.value, mpx.MPXError)
    with pytest.raises(mpx.MPXError, match="strict: expected True or False"):
        autocast(fn, "mixed_bfloat16", strict="yes")


def test_scatters_run_at_their_traced_dtypes_without_a_warning():
    def f(x, w):
        return jnp.zeros((4, 4)).at[jnp.array([0, 2])].add(x @ w)

    with warnings.catch_warnings():
        warnings.simplefilter("error", mpx_jax.AutocastFallbackWarning)
        out = autocast(f, "mixed_bfloat16")(rand((2, 3)), rand((3, 4), key=1))
    assert out.dtype == F32


def test_a_renamed_primitive_is_the_one_version_error(monkeypatch):
    from jax.extend.core import primitives

    import mpx_jax._compat as compat

    class Renamed:
        name = "pjit"

    monkeypatch.setattr(primitives, "jit_p", Renamed())
    with pytest.raises(mpx.FrameworkVersionError, match="jit_p named 'jit'.*autocast"):
        autocast(jnp.exp, "mixed_bfloat16")
    monkeypatch.undo()
    compat.check_autocast_primitives()
    # a primitive of the op rules' tables (logistic runs in float32) renamed away
    Renamed.name = "sigmoid"
    monkeypatch.setattr(primitives, "logistic_p", Renamed())
    with pytest.raises(mpx.FrameworkVersionError, match="a primitive named 'logistic'.*op rules"):
        autocast(jax.nn.silu, "mixed_bfloat16")


def test_a_missing_softmax_flag_is_the_one_version_error(monkeypatch):
    monkeypatch.delattr(jax, "softmax_custom_jvp")
    f = autocast(jax.nn.softmax, "params=float32,compute=bfloat16,keep_fp32=none")
    with pytest.raises(
        mpx.FrameworkVersionError, match=r"jax.softmax_custom_jvp, which mpx uses for autocast"
    ):
        f(rand((2, 3)))


def test_a_missing_bind_params_is_the_one_version_error(monkeypatch):
    from jax.extend.core import Primitive

    monkeypatch.delattr(Primitive, "get_bind_params")
    with pytest.raises(mpx.FrameworkVersionError, match="Primitive.get_bind_params"):
        autocast(lambda x: x @ x, "mixed_bfloat16")(rand((2, 2)))
