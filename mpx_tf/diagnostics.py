"""Diagnostics for Keras 3 on TensorFlow: :func:`watch` and :func:`underflow_stats` are mpx_keras's.

They read backend tensors through ``keras.ops`` and, on TensorFlow, check what flows back into each layer
through a ``tf.custom_gradient`` identity; see :mod:`mpx_keras.diagnostics`.  This module keeps the
``mpx_tf`` names.

>>> import keras, mpx_tf, tensorflow as tf
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
>>> with mpx_tf.watch(model) as w:
...     _ = model(tf.ones((1, 4)))
>>> w.report().finite
True
"""

from mpx_keras.diagnostics import Watch, underflow_stats, watch

__all__ = ["Watch", "underflow_stats", "watch"]
