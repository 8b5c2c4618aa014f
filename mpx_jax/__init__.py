"""mpx for JAX: policy casting, a jit-native loss scale, optax loss scaling and autocast.

Flax lives in :mod:`mpx_jax.flax` (imported separately, so this package needs
only jax and optax).

>>> import mpx, mpx_jax
>>> ls = mpx_jax.LossScale.create(mpx.ScalerConfig(growth_interval=1))
>>> float(ls.update(True).loss_scale)
131072.0
"""

from mpx_jax.autocast import AutocastError, AutocastFallbackWarning, autocast
from mpx_jax.casting import cast_to_compute, cast_to_output, cast_to_param, cast_tree
from mpx_jax.diagnostics import find_nonfinite, underflow_stats
from mpx_jax.distributed import all_reduce_gradients, combine_finite, mapped_axes
from mpx_jax.loss_scale import LossScale, all_finite, select_tree
from mpx_jax.opt_state import get_loss_scale, set_loss_scale
from mpx_jax.transform import LossScalingState, with_loss_scaling

__all__ = [
    "AutocastError",
    "AutocastFallbackWarning",
    "LossScale",
    "LossScalingState",
    "all_finite",
    "all_reduce_gradients",
    "autocast",
    "cast_to_compute",
    "cast_to_output",
    "cast_to_param",
    "cast_tree",
    "combine_finite",
    "find_nonfinite",
    "get_loss_scale",
    "mapped_axes",
    "select_tree",
    "set_loss_scale",
    "underflow_stats",
    "with_loss_scaling",
]
