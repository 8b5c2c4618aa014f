"""mpx policies as Keras 3 dtype policies: :mod:`mpx_keras.policy` (backend-neutral, #24), re-exported.

:func:`set_global_policy`, :func:`policy_scope` and :func:`apply_policy` also
decide which op table user code's ``keras.ops`` calls follow
(:mod:`mpx_keras.autocast`); on TensorFlow, importing mpx_tf adds the ``tf.*``
functions to it (:mod:`mpx_tf.autocast`).
"""

import importlib

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

importlib.import_module("mpx_tf.autocast")  # registers the tf.* functions with the op table's dispatch

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
