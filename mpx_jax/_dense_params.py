"""The parameters of mpx's Flax dense layers, written once: a ``kernel`` of ``(in_features, features)``
(lecun normal by default) and an optional ``bias`` of ``(features,)`` (zeros), in ``param_dtype``.

:class:`mpx_jax.float8_flax.Float8Linear` and :class:`mpx_jax.blocks_flax.BlockLinear` (NNX) make them
with :func:`nnx_params`, :class:`mpx_jax.float8_linen.Float8Dense` and
:class:`mpx_jax.blocks_flax.BlockDense` (linen) with :func:`linen_params`: the names, shapes and
initializers of ``nnx.Linear`` / ``nn.Dense``, so a checkpoint of the plain layer loads into them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
from flax import nnx

__all__ = ["BIAS_INIT", "KERNEL_INIT", "linen_params", "nnx_params"]

#: the default initializers (``nnx.Linear``'s and ``nn.Dense``'s)
KERNEL_INIT = nnx.initializers.lecun_normal()
BIAS_INIT = nnx.initializers.zeros_init()


def nnx_params(
    in_features: int, out_features: int, *, use_bias: bool, param_dtype: Any, kernel_init: Any,
    bias_init: Any, rngs: nnx.Rngs,
) -> tuple[nnx.Param, nnx.Param | None]:  # fmt: skip
    """``(kernel, bias)`` as ``nnx.Param`` (bias None without ``use_bias``), the kernel drawn first."""
    kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None
    return kernel, bias


def linen_params(
    module: nn.Module, in_features: int, features: int, *, use_bias: bool, param_dtype: Any
) -> tuple[jax.Array, jax.Array | None]:
    """``(kernel, bias)`` of a linen ``module`` (inside its compact ``__call__``; bias None without ``use_bias``)."""
    kernel = module.param("kernel", KERNEL_INIT, (in_features, features), param_dtype)
    bias = module.param("bias", BIAS_INIT, (features,), param_dtype) if use_bias else None
    return kernel, bias
