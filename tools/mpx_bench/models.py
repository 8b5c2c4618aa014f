"""The benchmark models' sizes (shared by every backend; each worker builds the same network).

* ``mlp``: Linear(D, H), GELU, Linear(H, D), MSE loss (at the default size
  D=1024, H=4096, batch 256).
* ``transformer``: pre-norm encoder blocks (LayerNorm, self-attention with a
  softmax, LayerNorm, GELU MLP), a final LayerNorm, mean pooling, a linear
  head, MSE loss.
* ``cnn``: three 3x3 convolutions (the last two with stride 2) with ReLU,
  global average pooling, a linear head with 10 classes, cross-entropy loss.

Every model trains with AdamW (learning rate 1e-4) on fixed random data.

>>> dims("mlp", "tiny")["batch"]
8
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODELS", "SIZES", "dims", "linears"]

MODELS = ("mlp", "transformer", "cnn")
SIZES = ("default", "small", "tiny")

_DIMS: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "default": {"batch": 256, "d": 1024, "h": 4096},
        "small": {"batch": 64, "d": 256, "h": 1024},
        "tiny": {"batch": 8, "d": 16, "h": 32},
    },
    "transformer": {
        "default": {"batch": 16, "seq": 128, "d": 256, "heads": 4, "ff": 1024, "layers": 2},
        "small": {"batch": 8, "seq": 64, "d": 128, "heads": 4, "ff": 512, "layers": 2},
        "tiny": {"batch": 2, "seq": 8, "d": 16, "heads": 2, "ff": 32, "layers": 1},
    },
    "cnn": {
        "default": {"batch": 64, "hw": 32, "cin": 3, "channels": (32, 64, 64), "classes": 10},
        "small": {"batch": 32, "hw": 16, "cin": 3, "channels": (16, 32, 32), "classes": 10},
        "tiny": {"batch": 2, "hw": 8, "cin": 3, "channels": (4, 8, 8), "classes": 10},
    },
}


def dims(model: str, size: str = "default") -> dict[str, Any]:
    """The dimensions of ``model`` at ``size`` (a fresh dict)."""
    if model not in _DIMS:
        raise ValueError(f"model: {model!r} is not a bench model; choose one of {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"size: {size!r} is not a model size; choose one of {', '.join(SIZES)}")
    return dict(_DIMS[model][size])


def data(model: str, size: str = "default", seed: int = 0) -> tuple[Any, Any]:
    """Fixed float32 numpy inputs and targets for ``model`` (integer class labels for the cnn)."""
    import numpy as np

    d = dims(model, size)
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = rng.standard_normal((d["batch"], d["d"]), np.float32)
        return x, rng.standard_normal((d["batch"], d["d"]), np.float32)
    if model == "transformer":
        x = rng.standard_normal((d["batch"], d["seq"], d["d"]), np.float32)
        return x, rng.standard_normal((d["batch"], d["d"]), np.float32)
    x = rng.standard_normal((d["batch"], d["hw"], d["hw"], d["cin"]), np.float32)  # NHWC
    return x, rng.integers(0, d["classes"], d["batch"]).astype(np.int64)


def linears(model: str, size: str = "default") -> list[tuple[str, tuple[int, int], int]]:
    """The Linear layers of ``model`` (what a block recipe converts; the cnn's convolutions are not):
    ``(name, weight shape (out, in), rows M of its 2-D input in one step)``, as every worker builds them."""
    d = dims(model, size)
    if model == "mlp":
        return [("0", (d["h"], d["d"]), d["batch"]), ("2", (d["d"], d["h"]), d["batch"])]
    if model == "cnn":
        return [("7", (d["classes"], d["channels"][2]), d["batch"])]
    m, dm, ff = d["batch"] * d["seq"], d["d"], d["ff"]
    out = []
    for i in range(d["layers"]):
        out += [(f"blocks.{i}.attn.qkv", (3 * dm, dm), m), (f"blocks.{i}.attn.out", (dm, dm), m),
                (f"blocks.{i}.mlp.0", (ff, dm), m), (f"blocks.{i}.mlp.2", (dm, ff), m)]  # fmt: skip
    return [*out, ("head", (dm, dm), d["batch"])]
