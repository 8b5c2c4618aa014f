"""The core's kernels with JAX's table give numpy's bits: eagerly, under ``jax.jit`` (the arrays traced,
a traced ``skipped``/``when`` flag included) and with ``jax_enable_x64`` on (the table's flags stay right).

The cases are :mod:`kernel_parity`'s (hypothesis-drawn subnormals, infs, NaNs, huge and tiny scales,
every format, recipe and scaler config), shared by every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import kernel_parity
import numpy as np
from hypothesis import HealthCheck, given, settings

from mpx.kernels import ArrayOps
from mpx_jax._array_ops import JAX_OPS

globals().update(kernel_parity.make_tests(lambda: JAX_OPS))


def _under_jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(ops, *args)`` run as one ``jax.jit`` whose arguments are ``args``' arrays (the rest static)."""

    def run(o: ArrayOps, *args: Any) -> Any:
        traced = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

        def inner(*arrays: Any) -> Any:
            full = list(args)
            for i, a in zip(traced, arrays, strict=True):
                full[i] = a
            return fn(o, *full)

        return jax.jit(inner)(*(args[i] for i in traced))

    return run


def _jit_test(
    name: str,
    strategy: Any,
    fn: Callable[..., Any],
    flags: Callable[[], Any] | None = None,
    examples: int = 25,
) -> Any:
    def test(inputs: tuple[Any, ...]) -> None:
        if flags is None:
            kernel_parity.check(JAX_OPS, name, _under_jit(fn), *inputs)
        else:
            with flags():
                kernel_parity.check(JAX_OPS, name, _under_jit(fn), *inputs)

    test.__name__ = f"test_{name}"
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(strategy)(test)
    )


for _name, (_strategy, _fn) in kernel_parity.KERNELS.items():
    globals()[f"test_kernel_parity_{_name}_under_jit"] = _jit_test(_name, _strategy, _fn)
for _name in ("scale_update", "product_bits", "quantize", "update_tensor"):  # the table ignores x64
    _strategy, _fn = kernel_parity.KERNELS[_name]
    globals()[f"test_kernel_parity_{_name}_with_x64"] = _jit_test(
        _name, _strategy, _fn, lambda: jax.enable_x64(True), examples=10
    )


def test_the_table_declares_jax_arithmetic():
    # XLA:CPU flushes a float32 subnormal product to zero; JAX_OPS says so, and the kernels then work on bits
    tiny = np.float32(2.0**-140)
    flushed = float(jax.jit(lambda a, b: a * b)(tiny, np.float32(0.5)))
    assert not JAX_OPS.exact_float32 and flushed == 0.0
    assert not JAX_OPS.float64
