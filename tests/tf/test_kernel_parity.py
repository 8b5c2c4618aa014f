"""The core's kernels (mpx.kernels) run with mpx_tf's TensorFlow table give the numpy table's bits, eagerly and
inside ``tf.function`` (the tensors traced, a traced ``skipped``/``when`` flag included).

The cases are :mod:`kernel_parity`'s (hypothesis-drawn subnormals, infs, NaNs, huge and tiny scales, every
format, recipe and scaler config), shared by every backend; the table's flags are what these tests prove.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kernel_parity
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings

from mpx.kernels import ArrayOps
from mpx_tf._array_ops import TF_ARRAY_OPS as OPS

globals().update(kernel_parity.make_tests(lambda: OPS))


def _in_tf_function(fn: Callable[..., Any]) -> Callable[[ArrayOps], Any]:
    """``fn(ops, *args)`` run as one ``tf.function`` whose arguments are ``args``' tensors (the rest static)."""

    def run(o: ArrayOps, *args: Any) -> Any:
        traced = [i for i, a in enumerate(args) if tf.is_tensor(a)]

        def inner(*tensors: Any) -> Any:
            full = list(args)
            for i, t in zip(traced, tensors, strict=True):
                full[i] = t
            return fn(o, *full)

        return tf.function(inner)(*(args[i] for i in traced))

    return run


def _traced_test(name: str, strategy: Any, fn: Callable[..., Any]) -> Any:
    def test(inputs: tuple[Any, ...]) -> None:
        kernel_parity.check(OPS, name, _in_tf_function(fn), *inputs)

    test.__name__ = f"test_kernel_parity_{name}_in_tf_function"
    return settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(strategy)(test)
    )


for _name, (_strategy, _fn) in kernel_parity.KERNELS.items():
    globals()[f"test_kernel_parity_{_name}_in_tf_function"] = _traced_test(_name, _strategy, _fn)


def test_the_flags_are_tensorflows_arithmetic():
    """TensorFlow flushes a subnormal float32 product to zero (so the kernels work on the bits) and has float64."""
    product = float(tf.constant(np.float32(2.0**-140)) * tf.constant(np.float32(0.5)))
    assert product == 0.0 and not OPS.exact_float32
    assert OPS.float64 and tf.constant(1.0, tf.float64).dtype == tf.float64
