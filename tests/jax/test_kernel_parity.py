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

from mpx_jax._array_ops import JAX_OPS

globals().update(kernel_parity.make_tests(lambda: JAX_OPS))


globals().update(kernel_parity.make_tests(lambda: JAX_OPS, 25, compile_with=jax.jit, suffix="_under_jit"))


def _jit_with_x64(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with jax.enable_x64(True):
            return jax.jit(fn)(*args)

    return run


# the table ignores x64: the kernels give the same bits with it on
globals().update(
    kernel_parity.make_tests(
        lambda: JAX_OPS,
        10,
        compile_with=_jit_with_x64,
        suffix="_with_x64",
        kernels=("scale_update", "product_bits", "quantize", "update_tensor"),
    )
)


def test_the_table_declares_jax_arithmetic():
    # XLA:CPU flushes a float32 subnormal product to zero; JAX_OPS says so, and the kernels then work on bits
    tiny = np.float32(2.0**-140)
    flushed = float(jax.jit(lambda a, b: a * b)(tiny, np.float32(0.5)))
    assert not JAX_OPS.exact_float32 and flushed == 0.0
    assert not JAX_OPS.float64
