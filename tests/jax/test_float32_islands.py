"""The authors' float32 stays float32 under mpx_jax.autocast (#25 item 0), named activations follow the
op table inside, the table holds inside scan/remat/cond/while, and a nested float32 autocast forces
float32 (#22).  Asserted on the exact dtypes of the transformed jaxpr's equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpx
from mpx_jax import autocast

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


def rand(shape, key=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape).astype(dtype)


def eqns(fn, *args):
    """(primitive, input dtypes, output dtypes) of every equation of ``fn``'s jaxpr, sub-jaxprs included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            dt = [np.dtype(v.aval.dtype) for v in e.invars if hasattr(v.aval, "dtype")]
            out.append((e.primitive.name, dt, [np.dtype(v.aval.dtype) for v in e.outvars]))
            for p in e.params.values():
                for q in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(q, "jaxpr", q)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def dots(fn, *args):
    return [dt for name, dt, _ in eqns(fn, *args) if name == "dot_general"]


def rotary(x, positions=None):
    """keras-hub's RotaryEmbedding written in JAX: positions and frequencies the function makes itself."""
    n, dim = x.shape[-2], x.shape[-1]
    if positions is None:
        positions = jnp.arange(n, dtype=jnp.float32)
    inverse_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freq = jnp.einsum("i,j->ij", positions, inverse_freq)
    emb = jnp.concatenate([freq, freq], axis=-1)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * jnp.cos(emb) + rotated * jnp.sin(emb)


def test_float32_made_inside_the_function_is_not_lowered():
    def f(x, w):
        return rotary(x @ w)

    x, w = rand((2048, 16)), rand((16, 64), key=1)
    # the projection lowers; the einsum of the positions and frequencies stays float32
    assert dots(autocast(f, "mixed_bfloat16"), x, w) == [[BF16, BF16], [F32, F32]]
    ops = eqns(autocast(f, "mixed_bfloat16"), x, w)
    assert [dt for name, dt, _ in ops if name in ("cos", "sin")] == [[F32], [F32]]
    assert [dt for name, dt, _ in ops if name == "iota"] == [[], []]


@pytest.mark.parametrize("half", [BF16, F16])
def test_rotary_error_at_2048_positions_within_twice_the_plain_half_recipe(half):
    # the plain recipe (keras-hub's under Keras's mixed policy): frequencies in float32, cos/sin and
    # the input rounded to the compute dtype
    x = rand((4, 2048, 64), key=2)
    ref = np.asarray(rotary(x))
    xh = x.astype(half)

    def native(a):
        n, dim = a.shape[-2], a.shape[-1]
        freq = jnp.einsum(
            "i,j->ij",
            jnp.arange(n, dtype=jnp.float32),
            1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)),
        )
        emb = jnp.concatenate([freq, freq], axis=-1)
        cos, sin = jnp.cos(emb).astype(half), jnp.sin(emb).astype(half)
        a1, a2 = jnp.split(a, 2, axis=-1)
        return a * cos + jnp.concatenate([-a2, a1], axis=-1) * sin

    native_err = np.abs(np.asarray(native(xh), np.float32) - ref).max()
    out = jax.jit(autocast(rotary, f"mixed_{half.name}"))(xh)
    mpx_err = np.abs(np.asarray(out, np.float32) - ref).max()
    assert mpx_err <= 2 * native_err, (mpx_err, native_err)
    # positions the caller passes in are the policy's: their einsum lowers, which is what autocast
    # did to the function's own positions before, and long-context positions are lost
    positions = jnp.arange(2048, dtype=jnp.float32)
    lowered = jax.jit(autocast(rotary, f"mixed_{half.name}"))(xh, positions)
    assert np.abs(np.asarray(lowered, np.float32) - ref).max() > 20 * native_err


def test_explicit_upcast_of_a_half_value_is_a_float32_island():
    def f(x, w):
        h = x @ w
        h32 = h.astype(jnp.float32)  # the author's upcast
        gram = jnp.einsum("ij,kj->ik", h32, h32)  # float32 on float32 operands the function made
        return gram, h, jax.nn.softmax(h32) @ w.astype(jnp.float32)

    x, w = rand((4, 8), dtype=BF16), rand((8, 8), key=1, dtype=BF16)
    ops = eqns(autocast(f, "mixed_bfloat16"), x, w)
    assert [dt for name, dt, _ in ops if name == "dot_general"] == [
        [BF16, BF16],  # x @ w: the policy's
        [F32, F32],  # the island's einsum: not lowered
        [F32, F32],  # softmax of the island @ an upcast argument: both the author's float32
    ]
    gram, h, _ = autocast(f, "mixed_bfloat16")(x, w)
    assert gram.dtype == F32 and h.dtype == BF16
    np.testing.assert_array_equal(np.asarray(gram), np.asarray(f(x, w)[0]))
    # a value the caller passed in meets the island: the op table applies (the matmul lowers)
    mixed = eqns(autocast(lambda a, b: a.astype(jnp.float32) @ b, "mixed_bfloat16"), x, rand((8, 3)))
    assert [dt for name, dt, _ in mixed if name == "dot_general"] == [[BF16, BF16]]


def test_closed_over_arrays_are_the_callers_and_numpy_constants_the_functions():
    w = rand((8, 8), key=3)
    table = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)

    def f(x):
        return jnp.arange(8, dtype=jnp.float32) @ w, jnp.arange(8, dtype=jnp.float32) @ table, x @ w

    assert dots(autocast(f, "mixed_bfloat16"), rand((2, 8))) == [[BF16, BF16], [F32, F32], [BF16, BF16]]


@pytest.mark.parametrize("half", [BF16, F16])
def test_silu_logistic_runs_in_float32_and_returns_the_input_dtype(half):
    x = rand((4, 8), dtype=half)
    ops = eqns(autocast(jax.nn.silu, f"mixed_{half.name}"), x)
    assert [(dt, out) for name, dt, out in ops if name == "logistic"] == [([F32], [F32])]
    out = autocast(jax.nn.silu, f"mixed_{half.name}")(x)
    assert out.dtype == half
    want = (x.astype(jnp.float32) * jax.nn.sigmoid(x.astype(jnp.float32))).astype(half)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    # gelu has no FLOAT32 primitive: it stays in the input dtype throughout
    gelu = eqns(autocast(jax.nn.gelu, "mixed_bfloat16"), x.astype(BF16))
    assert gelu and all(out == [BF16] for _, _, out in gelu)


def block(x, w):
    return jax.nn.softmax(jnp.tanh(x @ w), axis=-1)


CONTROL_FLOW = {
    "scan": lambda x, w: jax.lax.scan(lambda c, _: (block(c, w), None), x, None, length=2)[0],
    "remat": lambda x, w: jax.checkpoint(block)(x, w),
    "cond": lambda x, w: jax.lax.cond(x.sum() > 0, block, lambda a, b: block(a * 2, b), x, w),
    "while": lambda x, w: jax.lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, block(c[1], w)), (0, x)
    )[1],
    "jit": lambda x, w: jax.jit(block)(x, w),
}


@pytest.mark.parametrize("kind", sorted(CONTROL_FLOW))
def test_the_op_table_holds_inside_control_flow(kind):
    fn = CONTROL_FLOW[kind]
    x, w = rand((4, 8)), rand((8, 8), key=1)
    ops = eqns(autocast(fn, "mixed_bfloat16"), x, w)
    assert {tuple(dt) for name, dt, _ in ops if name == "dot_general"} == {(BF16, BF16)}
    assert {tuple(dt) for name, dt, _ in ops if name in ("exp", "reduce_max", "reduce_sum")} == {(F32,)}
    # a changed op table (matmul in float32) holds there too
    table = mpx.OP_TABLE.replace(matmul="float32")
    ops = eqns(autocast(fn, "mixed_bfloat16", op_table=table), x, w)
    assert {tuple(dt) for name, dt, _ in ops if name == "dot_general"} == {(F32, F32)}


def test_nested_float32_autocast_forces_float32():
    w = rand((8, 8), key=1)
    exact = autocast(lambda h: jnp.exp(h @ w), "float32")

    def f(x):
        h = x @ w  # lowered
        return exact(h), h @ w, exact(x)

    x = rand((4, 8))
    ops = eqns(autocast(f, "mixed_bfloat16"), x)
    assert [dt for name, dt, _ in ops if name == "dot_general"] == [
        [BF16, BF16],  # x @ w
        [F32, F32],  # inside the float32 region: its half input computed in float32
        [BF16, BF16],  # h @ w, outside again
        [F32, F32],  # the region on a float32 input
    ]
    # a FLOAT32 op of a half value in the region returns float32, as outside it
    mean = autocast(lambda a: autocast(jnp.mean, "float32")(a @ w), "mixed_bfloat16")(x)
    assert mean.dtype == F32
    inner, outer, _ = autocast(f, "mixed_bfloat16")(x)
    assert inner.dtype == F32 and outer.dtype == BF16
    h = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32).astype(BF16)
    np.testing.assert_allclose(np.asarray(inner), np.asarray(jnp.exp(h.astype(F32) @ w)), rtol=1e-5)


@pytest.mark.parametrize("wrap", ["jit", "scan", "jit outside"])
def test_nested_float32_region_inside_jit_and_scan(wrap):
    w = rand((8, 8), key=1)
    region = autocast(lambda h: h @ w, "float32")
    body = {
        "jit": lambda x: jax.jit(region)(x @ w),
        "scan": lambda x: jax.lax.scan(lambda c, _: (region(c @ w), None), x, None, length=1)[0],
        "jit outside": autocast(jax.jit(lambda h: h @ w), "float32"),
    }[wrap]
    ops = dots(autocast(body, "mixed_bfloat16"), rand((4, 8)))
    assert ops[-1] == [F32, F32]
    if wrap != "jit outside":
        assert ops[0] == [BF16, BF16]


def test_mixed_autocast_inside_a_float32_region_lowers_again():
    w = rand((8, 8), key=1)
    mixed = autocast(lambda h: h @ w, "mixed_bfloat16")
    region = autocast(lambda h: mixed(h @ w) @ w, "float32")
    ops = dots(autocast(region, "mixed_bfloat16"), rand((4, 8)))
    assert ops == [[F32, F32], [BF16, BF16], [F32, F32]]
