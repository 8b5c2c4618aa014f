"""mpx: one mixed-precision policy, loss scaler and op table for PyTorch, Keras and JAX.

The core imports numpy and ml_dtypes only; the backends live in ``mpx_torch``,
``mpx_tf`` and ``mpx_jax``.
"""

from mpx._version import __version__
from mpx.advice import SlowPolicyWarning, warn_if_slow
from mpx.dtypes import (
    CANONICAL_DTYPES,
    FLOATING_DTYPES,
    HALF_DTYPES,
    DTypeInfo,
    canonical_dtype,
    dtype_info,
    numpy_dtype,
    widest_dtype,
)
from mpx.errors import DTypeError, MPXError, PolicyError, ScalerConfigError, StateDictError
from mpx.ops import OP_CATEGORIES, OP_TABLE, OpClass, OpTable, classify, result_dtype
from mpx.policy import CATEGORIES, PRESET_ALIASES, PRESETS, Override, Policy, PolicySpec, get_policy
from mpx.scaling import (
    STATE_DICT_FORMAT,
    LossScaler,
    ScalerConfig,
    ScalerState,
    load_state_dict,
    scaler_init,
    scaler_update,
    state_dict,
)

__all__ = [
    "CANONICAL_DTYPES",
    "CATEGORIES",
    "FLOATING_DTYPES",
    "HALF_DTYPES",
    "OP_CATEGORIES",
    "OP_TABLE",
    "PRESETS",
    "PRESET_ALIASES",
    "STATE_DICT_FORMAT",
    "DTypeError",
    "DTypeInfo",
    "LossScaler",
    "MPXError",
    "OpClass",
    "OpTable",
    "Override",
    "Policy",
    "PolicyError",
    "PolicySpec",
    "ScalerConfig",
    "ScalerConfigError",
    "ScalerState",
    "SlowPolicyWarning",
    "StateDictError",
    "__version__",
    "canonical_dtype",
    "classify",
    "dtype_info",
    "get_policy",
    "load_state_dict",
    "numpy_dtype",
    "result_dtype",
    "scaler_init",
    "scaler_update",
    "state_dict",
    "warn_if_slow",
    "widest_dtype",
]
