"""mpx: one mixed-precision policy, loss scaler and op table for PyTorch, Keras and JAX.

The core imports numpy and ml_dtypes only; the backends live in ``mpx_torch``,
``mpx_tf`` and ``mpx_jax``.
"""

from mpx._version import __version__
from mpx.accumulation import accumulation_trace, check_accumulation_steps, window_flags
from mpx.advice import SlowPolicyWarning, warn_if_slow
from mpx.categories import CATEGORY_CLASSES, category_of, resolve_categories
from mpx.deepspeed_config import from_deepspeed_config, to_deepspeed_config
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
from mpx.errors import (
    DTypeError,
    FrameworkVersionError,
    MPXError,
    PolicyError,
    ScalerConfigError,
    ScalerFloorError,
    ScalerStuckError,
    ScalerStuckWarning,
    StateDictError,
    UnsupportedTypeError,
)
from mpx.float8 import (
    FP8_OPS,
    Float8Error,
    Float8Recipe,
    Float8State,
    float8_init,
    float8_update,
)
from mpx.history import HISTORY_FORMAT, HistoryError, ScalerHistory
from mpx.loss_scaler import LossScaler
from mpx.ops import OP_CATEGORIES, OP_TABLE, OpClass, OpTable, classify, result_dtype
from mpx.policy import (
    CATEGORIES,
    FP8_PRESETS,
    PRESET_ALIASES,
    PRESETS,
    Override,
    Policy,
    PolicySpec,
    get_policy,
)
from mpx.scaling import (
    COUNTER_MAX,
    SCALE_FLOOR,
    SCALER_PRESETS,
    STATE_DICT_FORMAT,
    ScalerConfig,
    ScalerState,
    as_scaler_config,
    load_state_dict,
    scaler_init,
    scaler_update,
    state_dict,
)
from mpx.stuck import check_floor, check_stuck, stuck_message

__all__ = [
    "CANONICAL_DTYPES",
    "CATEGORIES",
    "CATEGORY_CLASSES",
    "COUNTER_MAX",
    "FLOATING_DTYPES",
    "HISTORY_FORMAT",
    "HALF_DTYPES",
    "HistoryError",
    "OP_CATEGORIES",
    "OP_TABLE",
    "PRESETS",
    "PRESET_ALIASES",
    "SCALE_FLOOR",
    "SCALER_PRESETS",
    "STATE_DICT_FORMAT",
    "DTypeError",
    "FrameworkVersionError",
    "DTypeInfo",
    "FP8_OPS",
    "FP8_PRESETS",
    "Float8Error",
    "Float8Recipe",
    "Float8State",
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
    "ScalerFloorError",
    "ScalerHistory",
    "ScalerState",
    "ScalerStuckError",
    "ScalerStuckWarning",
    "SlowPolicyWarning",
    "StateDictError",
    "UnsupportedTypeError",
    "__version__",
    "accumulation_trace",
    "as_scaler_config",
    "category_of",
    "check_floor",
    "from_deepspeed_config",
    "to_deepspeed_config",
    "check_stuck",
    "check_accumulation_steps",
    "canonical_dtype",
    "classify",
    "dtype_info",
    "float8_init",
    "float8_update",
    "get_policy",
    "load_state_dict",
    "numpy_dtype",
    "resolve_categories",
    "result_dtype",
    "scaler_init",
    "scaler_update",
    "state_dict",
    "stuck_message",
    "warn_if_slow",
    "widest_dtype",
    "window_flags",
]
