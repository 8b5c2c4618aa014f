"""mpx policies as Keras 3 dtype policies: :mod:`mpx_keras.policy` (backend-neutral, #24), re-exported.

On TensorFlow, mpx_tf plugs its op table for functional code (:mod:`mpx_tf.autocast`)
into these policies: :func:`set_global_policy`, :func:`policy_scope` and
:func:`apply_policy` then also decide which op table user code's ``keras.ops``
and ``tf`` calls follow.
"""

import importlib

from mpx_keras import policy as _policy
from mpx_keras.policy import (
    CATEGORY_LAYERS,
    LAYER_TABLE,
    NAME_PREFIX,
    NORMALIZATION_LAYERS,
    active_global_policy,
    active_global_rule,
    apply_policy,
    category_of,
    get_global_policy,
    keras_dtype_policy,
    op_of,
    policy_scope,
    set_global_policy,
)

_walk = _policy._walk  # the one walk of a model's layers (tests read it here)
_autocast = importlib.import_module("mpx_tf.autocast")  # the module (mpx_tf.autocast is also a function)
_policy.set_op_table_hooks(nested_rule=_autocast.nested_rule, enable=_autocast.enable, hold=_autocast.hold)

__all__ = [
    "CATEGORY_LAYERS",
    "LAYER_TABLE",
    "NAME_PREFIX",
    "NORMALIZATION_LAYERS",
    "active_global_policy",
    "active_global_rule",
    "apply_policy",
    "category_of",
    "get_global_policy",
    "keras_dtype_policy",
    "op_of",
    "policy_scope",
    "set_global_policy",
]
