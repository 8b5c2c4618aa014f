"""Moved to :mod:`mpx_keras._scale_bits` (backend-neutral, #24); re-exported for existing imports."""

from mpx_keras._scale_bits import KERAS_OPS, TensorOps, next_scale

__all__ = ["KERAS_OPS", "TensorOps", "next_scale"]
