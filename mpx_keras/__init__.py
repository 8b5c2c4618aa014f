"""mpx for Keras 3 on any backend (``KERAS_BACKEND=tensorflow|jax|torch``): policies and loss scaling.

>>> import keras, mpx_keras
>>> with mpx_keras.policy_scope("mixed_float16"):
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.LayerNormalization()])
>>> model = mpx_keras.apply_policy(model, "mixed_float16")
>>> [layer.compute_dtype for layer in model.layers]
['float16', 'float32']
>>> optimizer = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam())
>>> optimizer.get_scale(), optimizer.state.steps
(65536.0, 0)

>>> with mpx_keras.autocast("mixed_float16"):  # user code's keras.ops follow the op table
...     keras.backend.standardize_dtype(keras.ops.softmax(keras.ops.ones((2, 3), dtype="float16")).dtype)
'float32'

It imports only Keras and mpx's core (and the backend Keras runs on).  What it
installs in Keras, at import, is one documented exception
(:mod:`mpx_keras.layer_policy`): Keras's dtype-policy name parser learns
``mpx:`` names (so ``keras.models.load_model`` rebuilds the layers
:func:`apply_policy` named), and mpx's classes are registered with Keras's
serialization; :func:`uninstall` undoes both, :func:`install` does them again.
No Keras class is changed otherwise: ``keras.layers.Layer.__call__`` stays
Keras's own, a layer with an ``mpx:`` name carries its behaviour itself (its
policy's ``convert_input`` and a per-instance wrapper of its ``call``), and the
op table's dispatch (:mod:`mpx_keras.autocast`) replaces ``keras.ops`` and
``keras.losses`` functions only while a policy holds it.  A Keras older than mpx is tested with raises
:class:`mpx.FrameworkVersionError`; every Keras internal is reached through
:mod:`mpx_keras._compat`.  On TensorFlow, :mod:`mpx_tf` adds ``tf.distribute``,
the reduce dtype, TensorBoard history and the ``tf.*``
functions of the op table.
"""

from mpx_keras import _compat  # noqa: F401  (the Keras version check, first)
from mpx_keras.autocast import autocast, autocast_op
from mpx_keras.diagnostics import underflow_stats, watch
from mpx_keras.dtype_policy import NAME_PREFIX
from mpx_keras.layer_policy import install, uninstall
from mpx_keras.loss_scale_optimizer import LossScaleOptimizer
from mpx_keras.monitor import LossScaleMonitor, ModelCheck, UnscaledFloat16Warning, check_model
from mpx_keras.policy import (
    apply_policy,
    category_of,
    get_global_policy,
    keras_dtype_policy,
    op_of,
    policy_scope,
    set_global_policy,
)

__all__ = [
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "ModelCheck",
    "NAME_PREFIX",
    "UnscaledFloat16Warning",
    "apply_policy",
    "autocast",
    "autocast_op",
    "category_of",
    "check_model",
    "get_global_policy",
    "install",
    "keras_dtype_policy",
    "op_of",
    "policy_scope",
    "set_global_policy",
    "underflow_stats",
    "uninstall",
    "watch",
]

install()  # the parser of mpx: names (mpx_keras.layer_policy): the one thing installed at import
