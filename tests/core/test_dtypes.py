import ml_dtypes
import numpy as np
import pytest

import mpx

ALIASES = {
    "float32": "float32", "f32": "float32", "fp32": "float32", "float": "float32", "full": "float32",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "f64": "float64", "fp64": "float64", "double": "float64",
}  # fmt: skip


@pytest.mark.parametrize("alias,canonical", ALIASES.items())
def test_aliases(alias, canonical):
    assert mpx.canonical_dtype(alias) == canonical


@pytest.mark.parametrize(
    "value,canonical",
    [
        (np.float16, "float16"),
        (np.dtype("float32"), "float32"),
        (np.float64, "float64"),
        (ml_dtypes.bfloat16, "bfloat16"),
        (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    ],
)
def test_numpy_and_ml_dtypes(value, canonical):
    assert mpx.canonical_dtype(value) == canonical


@pytest.mark.parametrize("bad", ["int8", "FP16", "", "float8", np.int32, np.bool_, 3, None, "bool"])
def test_bad_dtypes_raise_naming_field(bad):
    with pytest.raises(mpx.DTypeError, match=r"^compute: .*allowed: float16, bfloat16, float32, float64"):
        mpx.canonical_dtype(bad, field="compute")


def test_float8_is_reserved_for_policies():
    with pytest.raises(mpx.DTypeError, match="not allowed here"):
        mpx.canonical_dtype("float8_e4m3fn")
    assert mpx.canonical_dtype("float8_e5m2", allowed=mpx.CANONICAL_DTYPES) == "float8_e5m2"


@pytest.mark.parametrize(
    "name,bits,max_,normal,subnormal,eps",
    [
        ("float16", 16, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
        ("bfloat16", 16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 2.0**-126, 2.0**-133, 2.0**-7),
        ("float32", 32, float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149, 2.0**-23),
        ("float64", 64, float(np.finfo(np.float64).max), 2.0**-1022, 2.0**-1074, 2.0**-52),
        ("float8_e4m3fn", 8, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
        ("float8_e5m2", 8, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
    ],
)
def test_dtype_info(name, bits, max_, normal, subnormal, eps):
    info = mpx.dtype_info(name)
    assert (info.name, info.bits, info.max, info.smallest_normal, info.smallest_subnormal, info.eps) == (
        name, bits, max_, normal, subnormal, eps,
    )  # fmt: skip


def test_dtype_info_reads_aliases():
    assert mpx.dtype_info("half") == mpx.dtype_info("float16")


@pytest.mark.parametrize(
    "dtypes,widest",
    [
        (["float16"], "float16"),
        (["float16", "float16"], "float16"),
        (["float16", "bfloat16"], "float32"),
        (["bfloat16", "float32"], "float32"),
        (["float64", "float16"], "float64"),
    ],
)
def test_widest_dtype(dtypes, widest):
    assert mpx.widest_dtype(dtypes) == widest


def test_widest_of_nothing_is_an_error():
    with pytest.raises(mpx.DTypeError, match="input_dtypes: at least one"):
        mpx.widest_dtype([])
