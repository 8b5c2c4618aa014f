"""The mpx op table for functional Keras/TensorFlow code: ``keras.ops``, ``keras.losses``, ``tf.*``.

The op table for ``keras.ops``/``keras.losses`` is :mod:`mpx_keras.autocast`'s (the
same on every Keras backend) and is re-exported here; this module adds
TensorFlow's own functions (:data:`TF_OPS`) to what its dispatch replaces, with
one :func:`mpx_keras.autocast.register_targets` at import, and gives every wrapper
AutoGraph's ``do_not_convert``.

Everything else (which ops follow the table and how, the holds that install the
dispatch only while a policy needs it, the user-code rule, which policy applies,
nested float32 scopes) is :mod:`mpx_keras.autocast`'s, documented there.  On
TensorFlow, the ``tf.*``, ``tf.math.*``, ``tf.nn.*`` and ``tf.linalg.*``
functions follow the same table, and the user-code rule also looks through at
most :data:`MAX_TRACING_FRAMES` frames of TensorFlow's tracing machinery
(AutoGraph, ``tf.function``).  Wrappers only run in Python: inside
``tf.function`` (and so in ``model.fit``) they run once, at trace time, and the
traced graph holds nothing but the casts; a ``tf.function`` traced under one
policy keeps its casts when later called under another (trace it again to
change them).

>>> import keras
>>> x = keras.ops.ones((2, 3), dtype="float16")
>>> with autocast("mixed_float16"):
...     keras.ops.softmax(x).dtype.name, keras.ops.matmul(keras.ops.ones((2, 3)), keras.ops.ones((3, 2))).dtype.name
('float32', 'float16')
>>> keras.ops.softmax(x).dtype.name
'float16'
"""

from __future__ import annotations

from collections.abc import Iterator

import tensorflow as tf

from mpx_keras.autocast import (
    KERAS_OPS,
    LAYER_TABLE,
    LIBRARY_PACKAGES,
    LOSS_FUNCTIONS,
    MAX_TRACING_FRAMES,
    Rule,
    Target,
    acquire,
    active_rule,
    autocast,
    autocast_op,
    check_op_table,
    from_user_code,
    hold,
    holding,
    holds,
    nested_rule,
    register_targets,
    release,
    wrapped_functions,
)

__all__ = [
    "KERAS_OPS",
    "LAYER_TABLE",
    "LOSS_FUNCTIONS",
    "TF_OPS",
    "LIBRARY_PACKAGES",
    "MAX_TRACING_FRAMES",
    "Rule",
    "acquire",
    "active_rule",
    "autocast",
    "autocast_op",
    "check_op_table",
    "from_user_code",
    "hold",
    "holding",
    "holds",
    "nested_rule",
    "release",
    "wrapped_functions",
]

#: ``"module.name"`` under ``tf`` -> canonical op.
TF_OPS: dict[str, str] = {
    **{f"{m}.matmul": "matmul" for m in ("", "linalg")},
    **{f"{m}.einsum": "einsum" for m in ("", "linalg")},
    **{f"{m}.tensordot": "matmul" for m in ("", "linalg")},
    "linalg.matvec": "matmul",
    **{f"nn.{n}": "conv" for n in ("conv1d", "conv2d", "conv3d", "convolution", "depthwise_conv2d", "separable_conv2d")},
    **{f"nn.{n}": "conv_transpose" for n in ("conv1d_transpose", "conv2d_transpose", "conv3d_transpose", "conv_transpose")},
    **{f"{m}.softmax": "softmax" for m in ("nn", "math")},
    **{f"{m}.log_softmax": "log_softmax" for m in ("nn", "math")},
    **{f"{m}.exp": "exp" for m in ("", "math")},
    "math.expm1": "exp",
    **{f"{m}.log": "log" for m in ("", "math")},
    "math.log1p": "log",
    **{f"{m}.pow": "pow" for m in ("", "math")},
    **{f"{m}.reduce_sum": "sum" for m in ("", "math")},
    **{f"{m}.reduce_mean": "mean" for m in ("", "math")},
    "math.reduce_variance": "mean", "math.reduce_std": "mean",
    **{f"{m}.cumsum": "cumsum" for m in ("", "math")},
    **{f"{m}.reduce_prod": "prod" for m in ("", "math")},
    "math.cumprod": "prod",
    **{f"{m}.reduce_logsumexp": "logsumexp" for m in ("", "math")},
    **{f"{m}.norm": "vector_norm" for m in ("", "linalg")},
    "math.reduce_euclidean_norm": "vector_norm", "nn.l2_normalize": "vector_norm", "math.l2_normalize": "vector_norm",
    "nn.softmax_cross_entropy_with_logits": "cross_entropy",
    "nn.sparse_softmax_cross_entropy_with_logits": "cross_entropy",
    "nn.sigmoid_cross_entropy_with_logits": "bce_with_logits",
    "nn.weighted_cross_entropy_with_logits": "bce_with_logits",
    "nn.l2_loss": "mse_loss",
    "nn.moments": "mean", "nn.batch_normalization": "batch_norm",
    **{f"{m}.add": "add" for m in ("", "math")},
    **{f"{m}.multiply": "mul" for m in ("", "math")},
    "concat": "cat", "stack": "stack", "where": "where",
}  # fmt: skip


def _tf_targets() -> Iterator[Target]:
    """The ``tf.*`` functions of :data:`TF_OPS` this TensorFlow has."""
    for dotted, op in TF_OPS.items():
        path, _, name = dotted.rpartition(".")
        module = tf
        for part in filter(None, path.split(".")):
            module = getattr(module, part)
        if hasattr(module, name):
            yield Target(module, name, op, f"tf.{dotted.lstrip('.')}")


# The one registration: tf.* join the dispatch's install plan; AutoGraph never converts a wrapper.
register_targets(_tf_targets, finish=tf.autograph.experimental.do_not_convert)
