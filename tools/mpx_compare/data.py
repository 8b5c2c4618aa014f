"""The datasets of ``mpx compare`` (numpy only): scikit-learn's digits, and a generated sequence task.

Every dataset is ``(x_train, y_train, x_val, y_val)`` with ``x`` float32 of shape
``(n, 8, 8)`` and ``y`` int64 class labels: the mlp flattens it, the cnn reads
it as an 8x8 one-channel image, the transformer as 8 tokens of 8 features.

>>> x, y, xv, yv = load("sequence")
>>> x.shape, int(y.max()) < classes("sequence")
((2048, 8, 8), True)
"""

from __future__ import annotations

import numpy as np

__all__ = ["DATASETS", "classes", "load"]

#: dataset name -> what it is
DATASETS = {
    "digits": "scikit-learn's 8x8 handwritten digits (1797 images, 10 classes; 1437 train / 360 validation)",
    "sequence": "generated: 8 tokens of 8 Gaussian features; the class is the feature with the largest sum "
    "over the tokens (8 classes; 2048 train / 512 validation)",
}


def classes(name: str) -> int:
    """The number of classes of ``name``."""
    return {"digits": 10, "sequence": 8}[name]


def load(name: str, split_seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The train and validation arrays of ``name`` (the split is fixed: it does not depend on the run's seed).

    Raises:
        ValueError: for an unknown name (naming the known ones); ImportError when digits needs scikit-learn.
    """
    rng = np.random.default_rng(split_seed)
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = (bunch.images.astype(np.float32) / 16.0 - 0.5) / 0.5  # pixels 0..16 -> [-1, 1]
        y = bunch.target.astype(np.int64)
        order = rng.permutation(len(x))
        x, y = x[order], y[order]
        n_val = 360
        return x[n_val:], y[n_val:], x[:n_val], y[:n_val]
    if name == "sequence":
        x = rng.standard_normal((2048 + 512, 8, 8)).astype(np.float32)
        y = x.sum(axis=1).argmax(axis=1).astype(np.int64)
        return x[:2048], y[:2048], x[2048:], y[2048:]
    raise ValueError(f"dataset: {name!r} is not known; choose one of {', '.join(DATASETS)}")
