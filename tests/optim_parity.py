"""The reference trace of a policy optimizer's write-back: plain SGD steps on two bfloat16 parameters, computed
in float32 and written back by the policy's update rule with the core's numpy kernels.

:func:`momentum_traces` adds SGD momentum 0.5 (a power of two) and the moments' storage (``opt_state``): the
buffer ``buf = 0.5 * buf + grad`` is stored between steps as ``opt_state`` says (bfloat16 rounded to nearest, or
int8 blocks) and read back before the next step.  Keras's SGD keeps ``-lr * buf`` instead (its momentum holds
the step): a power-of-two multiple, so its roundings, its int8 codes and its weights are the same bits.

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

from mpx import optim_checkpoint
from mpx.kernels import NUMPY_OPS as o
from mpx.kernels import blockwise, rounding
from mpx.update_policy import int8_block

__all__ = [
    "POLICY",
    "momentum_traces",
    "policy_of",
    "reference_checkpoint",
    "reference_trace",
    "traces",
    "equal_checkpoints",
]

#: The policy of each update rule (a case's ``opt_state`` is added by :func:`policy_of`).
POLICY = {"plain": "bfloat16", "kahan": "bf16_kahan", "stochastic": "bf16_sr"}


def policy_of(case: dict[str, Any]) -> str:
    """The policy spec a backend wraps its SGD in for ``case``."""
    opt_state = case.get("opt_state", "float32")
    return POLICY[case["update"]] + ("" if opt_state == "float32" else f",opt_state={opt_state}")


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


@st.composite
def momentum_traces(draw: Any) -> dict[str, Any]:
    """A :func:`traces` case with ``momentum`` 0.5 and ``opt_state`` (float32, bfloat16 or int8 in blocks of 32)."""
    case = draw(traces())
    case["momentum"] = 0.5
    case["opt_state"] = draw(st.sampled_from(["float32", "bfloat16", "int8:32"]))
    return case


def _stored(buf: np.ndarray, opt_state: str) -> np.ndarray:
    """The momentum buffer after a round trip through ``opt_state``'s storage."""
    block = int8_block(opt_state)
    if opt_state == "bfloat16":
        return rounding.round_bf16(o, buf)
    if block is None:
        return buf
    return np.stack([blockwise.dequantize(o, *blockwise.quantize(o, row, block), row.size) for row in buf])


def _steps(case: dict[str, Any]) -> Any:
    """``(weights, compensation, momentum buffer)`` after each step (the buffer before its storage)."""
    w, c = case["w0"].copy(), np.zeros_like(case["w0"])
    momentum = case.get("momentum", 0.0)
    stored = np.zeros_like(w)  # the momentum buffer as stored between steps
    for step, grad in enumerate(case["grads"]):
        if momentum:
            grad = np.float32(momentum) * stored + grad  # the exact product, one rounding
            stored = _stored(grad, case.get("opt_state", "float32"))
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
        yield w.copy(), c.copy(), grad.copy()


def reference_trace(case: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(weights, compensation)]`` after each step, float32 (2, n) arrays holding bfloat16 values."""
    return [(w, c) for w, c, _ in _steps(case)]


def reference_checkpoint(case: dict[str, Any], k: int) -> dict[str, Any]:
    """The ``mpx.optim/1`` checkpoint of a :func:`momentum_traces` case after ``k`` steps (``k >= 1``)."""
    _, c, buf = list(_steps(case))[k - 1]
    opt_state = case["opt_state"]
    block = int8_block(opt_state)
    params = []
    for i in range(2):
        p: dict[str, Any] = {}
        if case["update"] == "kahan":
            p["kahan_comp"] = c[i].astype(ml_dtypes.bfloat16)
        if block is not None:
            p["momentum_buffer.q"], p["momentum_buffer.absmax"] = blockwise.quantize(o, buf[i], block)
        elif opt_state == "bfloat16":
            p["momentum_buffer"] = rounding.round_bf16(o, buf[i]).astype(ml_dtypes.bfloat16)
        else:
            p["momentum_buffer"] = buf[i]
        params.append(p)
    return optim_checkpoint.make(policy_of(case), seed=case["seed"], step=k, optimizer="sgd", params=params)


def equal_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``mpx.optim/1`` dicts hold the same fields and the same bits in every array."""
    if {k: v for k, v in a.items() if k != "params"} != {k: v for k, v in b.items() if k != "params"}:
        return False
    if len(a["params"]) != len(b["params"]):
        return False
    for p, q in zip(a["params"], b["params"], strict=True):
        if set(p) != set(q):
            return False
        for name in p:
            x, y = np.asarray(p[name]), np.asarray(q[name])
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
    return True
