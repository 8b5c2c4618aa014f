"""Framework-neutral helpers the adapters share: seeded inputs and the float64 reference MLP.

mpx-free (numpy only): native runs import this module with mpx blocked (conformance/isolation.py).
"""

from __future__ import annotations

import numpy as np


def mlp_data(seed: int = 0) -> dict[str, np.ndarray]:
    """Weights and data of the 8-32-4 tanh MLP, float32 values."""
    rng = np.random.default_rng(seed)
    f = np.float32
    return {
        "x": rng.standard_normal((16, 8)).astype(f),
        "y": rng.standard_normal((16, 4)).astype(f),
        "w1": (rng.standard_normal((8, 32)) / np.sqrt(8)).astype(f),
        "b1": (0.1 * rng.standard_normal(32)).astype(f),
        "w2": (rng.standard_normal((32, 4)) / np.sqrt(32)).astype(f),
        "b2": (0.1 * rng.standard_normal(4)).astype(f),
    }


def mlp_reference(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Loss mean((tanh(x w1 + b1) w2 + b2 - y)**2) and its gradients, in float64."""
    x, y, w1, b1, w2, b2 = (d[k].astype(np.float64) for k in ("x", "y", "w1", "b1", "w2", "b2"))
    h = np.tanh(x @ w1 + b1)
    out = h @ w2 + b2
    diff = out - y
    loss = np.mean(diff**2)
    g_out = 2 * diff / diff.size
    g_w2 = h.T @ g_out
    g_b2 = g_out.sum(0)
    g_h = g_out @ w2.T
    g_pre = g_h * (1 - h**2)
    return {"loss": np.array(loss), "w1": x.T @ g_pre, "b1": g_pre.sum(0), "w2": g_w2, "b2": g_b2}


def max_rel_error(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest relative error (in norm) over the loss and every gradient."""
    worst = 0.0
    for key, want in ref.items():
        have = np.asarray(got[key], dtype=np.float64)
        worst = max(worst, float(np.linalg.norm(have - want) / max(np.linalg.norm(want), 1e-30)))
    return worst


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """``|got - want| / |want|`` in norm, computed in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))


def op_input(shape: tuple[int, ...], seed: int = 0, positive: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    return np.abs(x) + 0.5 if positive else x


def flag_gradient(finite: bool, bad: str = "inf") -> float:
    """The multiplier that makes a step's gradient finite (1.0) or not (inf / nan)."""
    if finite:
        return 1.0
    return float("inf") if bad == "inf" else float("nan")


#: The canonical dtype names a result may have (mpx's CANONICAL_DTYPES).
CANONICAL = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
#: Framework spellings of them (TensorFlow's ``half``/``double``, torch's ``torch.`` prefix is stripped).
_ALIASES = {"half": "float16", "float": "float32", "double": "float64"}


def dtype_name(value: object) -> str:
    """The canonical name of a framework's dtype object (torch, TensorFlow, numpy/ml_dtypes, JAX), or of
    a name: ``float16``, ``bfloat16``, ``float32``, ``float64``, ``float8_e4m3fn``, ``float8_e5m2``.

    Raises:
        ValueError: when ``value`` is not one of those floating dtypes (an integer result, an unknown object).
    """
    if isinstance(value, type) and issubclass(value, np.generic):  # a numpy / ml_dtypes scalar type
        value = np.dtype(value)
    elif isinstance(getattr(value, "dtype", None), np.dtype):  # jax.numpy's scalar types (jnp.float16)
        value = value.dtype  # type: ignore[attr-defined]
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(name, str):  # torch.dtype has no name: its str is "torch.float16"
        name = str(value)
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in CANONICAL:
        raise ValueError(f"dtype {value!r} is not a floating dtype; allowed: {', '.join(CANONICAL)}")
    return name
