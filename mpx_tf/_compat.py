"""Every Keras and TensorFlow internal mpx_tf uses, in one place, behind one version check.

Keras's internals (private optimizer methods, ``keras.src`` modules) are
:mod:`mpx_keras._compat`'s, shared by every Keras backend and re-exported here;
this module adds TensorFlow's own: ``tf.__internal__`` (``tf.distribute``'s
merge-call test) and a TensorBoard protobuf.

At import this module checks the installed TensorFlow (and, through
:mod:`mpx_keras._compat`, Keras) against the versions mpx is tested with
(:func:`mpx.versions.require_version`).  A private name that is missing raises
:class:`mpx.FrameworkVersionError` from :func:`mpx.versions.missing_internal`:
the name, what mpx uses it for, and the versions mpx supports.  Nothing falls
back silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from mpx.versions import require_version
from mpx_keras import _compat as _keras_compat
from mpx_keras._compat import *  # noqa: F403  (Keras's internals: one list, mpx_keras._compat.__all__)
from mpx_keras._compat import _attribute, _module_attribute

__all__ = [*_keras_compat.__all__, "strategy_supports_no_merge_call", "summary_pb2"]

require_version("tensorflow", tf.__version__)
require_version("keras", keras.__version__)

strategy_supports_no_merge_call: Callable[[], bool] = _attribute(
    "tensorflow",
    tf,
    "__internal__.distribute.strategy_supports_no_merge_call",
    "LossScaleOptimizer.apply under tf.distribute",
)
summary_pb2: Any = _module_attribute(
    "tensorflow", "tensorflow.core.framework", "summary_pb2", "TensorBoard scalars of the scaler history"
)
