"""The reference trace of a policy optimizer's write-back: plain SGD steps on two bfloat16 parameters, computed
in float32 and written back by the policy's update rule with the core's numpy kernels.

Shared by the backends' optimizer tests (tests/conftest.py puts this folder on ``sys.path``; it imports no
framework): torch's ``PolicyOptimizer`` around ``torch.optim.SGD`` and mpx_jax's wrapper around
``optax.sgd`` must both give these bits, so they give each other's.  ``lr`` is a power of two, so
``lr * grad`` is exact and the step ``w - lr * grad`` is one float32 rounding in every framework.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from mpx.kernels import NUMPY_OPS as o
from mpx.kernels import rounding

__all__ = ["reference_trace", "traces"]


def _bf16(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


_WEIGHT = st.one_of(st.floats(2.0**-3, 8.0, width=32), st.floats(-8.0, -(2.0**-3), width=32))
_GRAD = st.one_of(st.just(0.0), st.floats(2.0**-6, 4.0, width=32), st.floats(-4.0, -(2.0**-6), width=32))


@st.composite
def traces(draw: Any) -> dict[str, Any]:
    """A case: ``w0`` (2, n) bfloat16 values as float32 (parameter 0 and 1), ``grads`` (steps, 2, n) bfloat16
    values, ``lr`` a power of two, ``update`` and ``seed``."""
    n = draw(st.integers(1, 12))
    steps = draw(st.integers(1, 4))
    w0 = _bf16(draw(st.lists(_WEIGHT, min_size=2 * n, max_size=2 * n))).reshape(2, n)
    grads = _bf16(draw(st.lists(_GRAD, min_size=2 * n * steps, max_size=2 * n * steps))).reshape(steps, 2, n)
    return {
        "w0": w0,
        "grads": grads,
        "lr": 2.0 ** -draw(st.integers(4, 8)),
        "update": draw(st.sampled_from(["plain", "kahan", "stochastic"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def reference_trace(case: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(weights, compensation)]`` after each step, float32 (2, n) arrays holding bfloat16 values."""
    w, c = case["w0"].copy(), np.zeros_like(case["w0"])
    out = []
    for step, grad in enumerate(case["grads"]):
        new = w - np.float32(case["lr"]) * grad  # the exact product, one rounding
        if case["update"] == "stochastic":
            w = np.stack(
                [
                    rounding.stochastic_round_bf16(o, new[i], seed=case["seed"], step=step, param=i)
                    for i in range(2)
                ]
            )
        elif case["update"] == "kahan":
            w, c = rounding.kahan_add(o, w, c, new - w)
        else:
            w = rounding.round_bf16(o, new)
        out.append((w.copy(), c.copy()))
    return out
