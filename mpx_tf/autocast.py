"""The mpx op table for functional Keras/TensorFlow code: ``keras.ops``, ``keras.losses``, ``tf.*``.

The op table for ``keras.ops``/``keras.losses`` is :mod:`mpx_keras.autocast`'s (the
same on every Keras backend) and is re-exported here; this module adds
TensorFlow's own functions (:data:`TF_OPS`) to what its dispatch replaces, with
one :func:`mpx_keras.autocast.register_targets` at import, and gives every wrapper
AutoGraph's ``do_not_convert``.

Keras chooses dtypes per layer, not per op: a custom layer that calls
``keras.ops.softmax`` on float16 inputs gets a float16 softmax whatever the
policy says.  :func:`autocast` is a scope in which the public ``keras.ops.*``,
``keras.losses.*`` functions and the matching ``tf.*``, ``tf.math.*``,
``tf.nn.*`` and ``tf.linalg.*`` functions follow :data:`mpx.OP_TABLE`:

- LOWER ops (matmul, einsum, conv, attention) compute in the compute dtype;
- FLOAT32 ops (softmax, norms, losses, exp/log/pow, reductions, cumsum,
  logsumexp) cast half-precision inputs to float32 and return float32;
- PROMOTE ops (add, multiply, concatenate, stack, where) return the widest
  floating input; PASSTHROUGH ops are not touched.

The mechanism is Python-level dispatch, installed only while a policy needs
it: importing mpx_tf replaces nothing.  While at least one *hold* is taken
(an :func:`autocast` or :func:`mpx_tf.policy_scope` scope of a policy that
lowers precision or forces float32, :func:`mpx_tf.set_global_policy` of such a
policy in some thread, or the ``call`` of a layer :func:`mpx_tf.apply_policy`
gave a lowering policy), those public functions are replaced in their
namespaces by thin wrappers; when the last hold is given back (on scope exit,
errors too; reference-counted under a lock, so threads share one install)
every original is put back and each of them is again identical (``is``) to
Keras's or TensorFlow's own.  Wrappers only run in Python: inside
``tf.function`` (and so in ``model.fit``) they run once, at trace time, and the
traced graph holds nothing but the casts.  A function reference taken before
the scope (``from keras.ops import softmax`` at import) is Keras's own and
never follows the table: call ``keras.ops.softmax`` (looked up at the call),
or decorate your own function with :func:`autocast_op`.

Which calls follow the table: **user code only**.  A call is user code when
the first frame above the op, looking through at most
:data:`MAX_TRACING_FRAMES` frames of TensorFlow's tracing machinery (AutoGraph,
``tf.function``), is from a file that belongs to no installed library: not a
module of :data:`LIBRARY_PACKAGES` (Keras, TensorFlow, keras-hub, keras-nlp,
keras-cv...), not under a ``site-packages``/``dist-packages`` directory or the
standard library, and not mpx's own packages.  Code typed in (``<stdin>``,
doctests, notebooks) is user code.  Each file's kind is decided once and
cached, so the check is one frame lookup per call (plus the tracing frames
inside ``tf.function``).  So a library layer's explicit dtype choices survive
the op table: keras-hub's attention matmuls compute in the layer's compute
dtype as natively, and Llama's float32 rotary embedding stays float32, even
inside a layer given an mpx policy.  A project installed into site-packages
(not editable) is library code too: its ops follow the layers' own dtypes.

Which policy applies, innermost first:

1. the innermost Keras layer being called, if :func:`mpx_tf.apply_policy`
   gave it its mpx policy (so any layer's ``call`` follows the table, even
   after ``keras.models.load_model``);
2. the innermost :func:`autocast` scope;
3. the policy set by :func:`mpx_tf.set_global_policy` (while Keras's global
   policy is still the one it set), except inside a layer whose compute
   dtype differs from it (a layer created with ``dtype="float32"``).

Each of them comes with its op table (``op_table=`` of :func:`autocast`,
:func:`mpx_tf.policy_scope`, :func:`mpx_tf.set_global_policy`,
:func:`mpx_tf.apply_policy`; default :data:`mpx.OP_TABLE`).

A policy whose compute dtype is not half precision changes nothing, except
in a float32 scope nested in a mixed one (an :func:`autocast` or
:func:`mpx_tf.policy_scope` of such a policy entered where a lowering policy
is in force): there it forces float32, as a float32 region in every mpx
backend: LOWER and FLOAT32 ops compute half inputs in float32 (PROMOTE ops
still take the widest input).  The choice is made at trace time: a ``tf.function`` traced under one policy keeps
its casts when later called under another (trace it again to change them).

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
