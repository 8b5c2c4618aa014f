"""The core's kernels (mpx.kernels) run with mpx_keras's ``keras.ops`` table give the numpy table's bits, on the
Keras backend this suite runs on: eagerly and inside that backend's compiled function (``tf.function`` on
TensorFlow, ``jax.jit`` on JAX; torch runs the table eagerly, as Keras's torch trainer does without
``jit_compile``).

The cases are :mod:`kernel_parity`'s (hypothesis-drawn subnormals, infs, NaNs, huge and tiny scales, every
format, recipe and scaler config), shared by every backend; the table's flags are what these tests prove.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import kernel_parity
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from mpx.kernels import ArrayOps
from mpx_keras._array_ops import KERAS_ARRAY_OPS, KerasOps

BACKEND = keras.config.backend()
OPS = KERAS_ARRAY_OPS

globals().update(kernel_parity.make_tests(lambda: OPS))


def _compiled(fn: Callable[..., Any]) -> Callable[[ArrayOps], Any]:
    """``fn(ops, *args)`` run as one compiled function of ``args``' tensors (the rest static)."""

    def run(o: ArrayOps, *args: Any) -> Any:
        traced = [i for i, a in enumerate(args) if keras.ops.is_tensor(a)]

        def inner(*tensors: Any) -> Any:
            full = list(args)
            for i, t in zip(traced, tensors, strict=True):
                full[i] = t
            return fn(o, *full)

        if BACKEND == "tensorflow":
            import tensorflow as tf

            compiled = tf.function(inner)
        else:
            import jax

            compiled = jax.jit(inner)
        return compiled(*(args[i] for i in traced))

    return run


def _compiled_test(name: str, strategy: Any, fn: Callable[..., Any]) -> Any:
    @pytest.mark.skipif(BACKEND == "torch", reason="torch runs the table eagerly (no compiled variant here)")
    def test(inputs: tuple[Any, ...]) -> None:
        kernel_parity.check(OPS, name, _compiled(fn), *inputs)

    test.__name__ = f"test_kernel_parity_{name}_compiled"
    return settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(strategy)(test)
    )


for _name, (_strategy, _fn) in kernel_parity.KERNELS.items():
    globals()[f"test_kernel_parity_{_name}_compiled"] = _compiled_test(_name, _strategy, _fn)


def test_the_flags_are_the_backends_arithmetic():
    """A subnormal float32 product survives on torch only; float64 exists on torch and TensorFlow (on JAX
    only with x64, which the table does not rely on)."""
    tiny = keras.ops.convert_to_tensor(np.float32(2.0**-140))
    product = float(keras.ops.convert_to_numpy(keras.ops.multiply(tiny, np.float32(0.5))))
    assert OPS.exact_float32 is (product == 2.0**-141) is (BACKEND == "torch")
    assert OPS.float64 is (BACKEND != "jax")
    assert (KerasOps("jax").exact_float32, KerasOps("jax").float64) == (False, False)


def test_fp8_tensors_come_back_with_their_bytes():
    x = np.asarray([1.0, -448.0, np.nan, 2.0**-9], np.float32)
    q = OPS.cast(OPS.from_numpy(x), "float8_e4m3fn")
    got = OPS.to_numpy(q)
    assert got.dtype.name == "float8_e4m3fn"
    np.testing.assert_array_equal(got.astype(np.float32)[[0, 1, 3]], x[[0, 1, 3]])
    assert np.isnan(got.astype(np.float32)[2])
