import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpx
from mpx_jax import cast_to_compute, cast_to_output, cast_to_param, cast_tree


def tree():
    return {
        "f32": jnp.ones(3, jnp.float32),
        "bf16": jnp.ones(2, jnp.bfloat16),
        "np64": np.zeros(2, np.float64),
        "npbf16": np.zeros(2, ml_dtypes.bfloat16),
        "npscalar": np.float32(2.0),
        "int": jnp.arange(3),
        "bool": jnp.array([True]),
        "key": jax.random.key(0),
        "rawkey": jax.random.PRNGKey(0),
        "complex": jnp.ones(2, jnp.complex64),
        "py": 1.5,
        "s": "text",
        "none": None,
    }


@pytest.mark.parametrize(
    ("fn", "policy", "expected"),
    [
        (cast_to_compute, "mixed_bfloat16", "bfloat16"),
        (cast_to_compute, "mixed_float16", "float16"),
        (cast_to_param, "mixed_float16", "float32"),
        (cast_to_param, "bfloat16", "bfloat16"),
        (cast_to_output, "params=float32,compute=bfloat16", "bfloat16"),
        (cast_to_output, "mixed_bfloat16", "float32"),
    ],
)
def test_floating_leaves_only(fn, policy, expected):
    src = tree()
    out = fn(policy, src)
    target = mpx.numpy_dtype(expected)
    for name in ("f32", "bf16", "np64", "npbf16", "npscalar"):
        assert out[name].dtype == target, name
    assert isinstance(out["np64"], np.ndarray) and isinstance(out["npbf16"], np.ndarray)
    assert isinstance(out["f32"], jax.Array)
    for name in ("int", "bool", "key", "rawkey", "complex"):
        assert out[name] is src[name], name
    assert out["py"] == 1.5 and out["s"] == "text" and out["none"] is None


def test_under_jit_and_policy_objects():
    pol = mpx.get_policy("mixed_float16")

    @jax.jit
    def f(t):
        return cast_to_compute(pol, t)

    out = f({"a": jnp.ones(2), "i": jnp.arange(2)})
    assert out["a"].dtype == jnp.float16 and out["i"].dtype == jnp.int32


def test_same_dtype_is_identity_and_bad_dtype_raises():
    x = jnp.ones(2)
    assert cast_tree({"x": x}, "f32")["x"] is x
    with pytest.raises(mpx.DTypeError, match="int8"):
        cast_tree({"x": x}, "int8")
    with pytest.raises(mpx.PolicyError):
        cast_to_compute("mixed_float17", {"x": x})


# -- issue #13 item 7: every framework's dtype objects ---------------------------------------------
@pytest.mark.parametrize(
    "dtype, name",
    [
        (jnp.bfloat16, "bfloat16"),
        (jnp.float16, "float16"),
        (jnp.float32, "float32"),
        (jnp.dtype("bfloat16"), "bfloat16"),
        (jnp.dtype(jnp.float16), "float16"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
        (np.float16, "float16"),
    ],
)
def test_jax_dtype_objects_are_accepted(dtype, name):
    tree = {"w": jnp.ones(3, jnp.float32), "n": jnp.arange(2)}
    out = cast_tree(tree, dtype)
    assert out["w"].dtype == jnp.dtype(name) and out["n"].dtype == tree["n"].dtype
    assert mpx.canonical_dtype(dtype) == name


def test_policy_from_jnp_scalar_types():
    policy = mpx.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert policy == mpx.get_policy("mixed_bfloat16")


@pytest.mark.parametrize("bad", [jnp.int8, jnp.ones(2), jnp.complex64, jnp.float8_e4m3fn])
def test_non_policy_jax_dtypes_raise_dtype_error_naming_the_field(bad):
    with pytest.raises(mpx.DTypeError, match="^compute: "):
        mpx.canonical_dtype(bad, field="compute")
