"""mpx for Keras 3 on TensorFlow: one mpx policy, Keras's own dtype policies and loss scaling.

>>> import mpx_tf
>>> with mpx_tf.policy_scope("mixed_float16"):
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.LayerNormalization()])
>>> model = mpx_tf.apply_policy(model, "mixed_float16")
>>> [layer.compute_dtype for layer in model.layers]
['float16', 'float32']
>>> with mpx_tf.autocast("mixed_float16"):  # keras.ops / tf functions follow the op table
...     keras.ops.softmax(keras.ops.ones((2, 3), dtype="float16")).dtype.name
'float32'
>>> optimizer = mpx_tf.LossScaleOptimizer(keras.optimizers.Adam())
>>> optimizer.get_scale(), optimizer.state.steps
(65536.0, 0)

Importing this package selects Keras's TensorFlow backend when ``KERAS_BACKEND``
is unset; another backend raises ImportError, and a TensorFlow or Keras older
than mpx is tested with raises :class:`mpx.FrameworkVersionError` (an ImportError).
Every Keras/TensorFlow internal mpx_tf uses is reached through :mod:`mpx_tf._compat`.

What is not TensorFlow's own lives in :mod:`mpx_keras` (any Keras backend) and is
re-exported here: the policies, ``mpx:`` dtype-policy names, :class:`LossScaleMonitor`,
:func:`check_model`, and :func:`install`/:func:`uninstall` (what mpx installs in Keras:
the parser of ``mpx:`` names and the registration of mpx's classes, :mod:`mpx_keras.layer_policy`).  TensorFlow's own parts stay here: the op table's ``tf.*``
wrappers (:func:`autocast`), ``tf.distribute``, the reduce dtype in
:class:`LossScaleOptimizer`, ``tf.summary`` history.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras

if keras.config.backend() != "tensorflow":
    raise ImportError(
        f"mpx_tf needs Keras's TensorFlow backend, but Keras runs on {keras.config.backend()!r}; "
        "set KERAS_BACKEND=tensorflow before keras is first imported"
    )

from mpx_keras.layer_policy import install, uninstall
from mpx_keras.monitor import LossScaleMonitor, check_model
from mpx_tf import _compat  # noqa: F401  (the TensorFlow and Keras version check, first)
from mpx_tf.autocast import autocast, autocast_op
from mpx_tf.diagnostics import underflow_stats, watch
from mpx_tf.distributed import set_reduce_dtype
from mpx_tf.history import ScalerHistoryCallback
from mpx_tf.loss_scale_optimizer import LossScaleOptimizer
from mpx_tf.policy import (
    NAME_PREFIX,
    apply_policy,
    category_of,
    get_global_policy,
    keras_dtype_policy,
    op_of,
    policy_scope,
    set_global_policy,
)
from mpx_tf.saving import load_model

__all__ = [
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "ScalerHistoryCallback",
    "autocast",
    "autocast_op",
    "NAME_PREFIX",
    "apply_policy",
    "category_of",
    "check_model",
    "op_of",
    "get_global_policy",
    "install",
    "load_model",
    "keras_dtype_policy",
    "policy_scope",
    "set_global_policy",
    "set_reduce_dtype",
    "underflow_stats",
    "uninstall",
    "watch",
]
