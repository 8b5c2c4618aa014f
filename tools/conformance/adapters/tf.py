"""The Keras 3 / TensorFlow adapter: :mod:`conformance.adapters.keras` plus what is TensorFlow's own.

Natively Keras dtype policies + ``keras.optimizers.LossScaleOptimizer``; under mpx :mod:`mpx_tf` (which
re-exports mpx_keras and adds the ``tf.*`` op wrappers and ``tf.distribute``).  TensorFlow's own parts:
the functional ops mix ``tf.*`` functions with ``keras.ops``, gradients come from a ``tf.GradientTape``,
the stuck case runs in a ``tf.function``, and the replicas run under ``MirroredStrategy``
(:mod:`conformance.distributed.tf`).  Native paths import nothing of mpx (conformance/isolation.py).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

os.environ["KERAS_BACKEND"] = "tensorflow"  # before Keras is imported: this column is Keras on TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from conformance.adapters._common import dtype_name  # noqa: F401  (dtype_name: tests/tf use it)
from conformance.adapters.keras import KerasAdapter, _batch_norm, export
from mpx_tools.skip import Skip

if keras.backend.backend() != "tensorflow":  # Keras was imported before, on another backend
    raise RuntimeError(f"conformance.adapters.tf needs Keras on TensorFlow; this process runs it on "
                       f"{keras.backend.backend()} (import the adapter before Keras)")  # fmt: skip


class TFAdapter(KerasAdapter):
    """Keras on TensorFlow: ``mpx_tf`` under mpx, ``tf.*`` functional ops, a tape, ``tf.function``, replicas."""

    name = "tf"

    def mpx(self) -> Any:
        return importlib.import_module("mpx_tf")

    def info(self) -> dict:
        return {"version": f"tensorflow {tf.__version__}, keras {keras.__version__}", "device": "cpu"}

    def value_and_grad(self, fn: Callable[[], Any], variables: Sequence[Any]) -> tuple[Any, list]:
        with tf.GradientTape() as tape:
            loss = fn()
        return loss, list(tape.gradient(loss, list(variables)))

    def functions(
        self, op: str, dtype: str, other: str | None = None, upcast: bool = False, mode: str = "mpx"
    ):
        """``(fn, args)``: the canonical op as a ``keras.ops`` / ``keras.losses`` / ``tf`` function call on
        inputs of ``dtype`` (``upcast``: those inputs cast to float32); under mpx the composites are
        declared with :func:`mpx_tf.autocast_op`, and mpx_tf's op table covers the ``tf`` functions."""
        if mode == "mpx":
            self.mpx()  # (its op table dispatches the functions looked up at call time, inside a scope)

        def t(shape, dt=dtype, seed=0, positive=False):
            x = self._x(shape, dt, seed, positive)
            return tf.cast(x, tf.float32) if upcast else x

        x, y, w = t((4, 8)), t((4, 8), other or dtype, seed=1), t((6, 8), seed=2)
        img = t((1, 6, 6, 2))
        labels = tf.constant([0, 1, 2, 3])
        target = tf.sigmoid(self._x((4, 8), other or dtype, seed=1))  # probabilities, at the input dtype
        target = tf.cast(target, tf.float32) if upcast else target
        qkv = [t((1, 4, 2, 8), seed=s) for s in (6, 7, 8)]
        composite = self.composite(op, mode)
        table = {
            "matmul": (lambda a, b: keras.ops.matmul(a, b), (x, t((8, 3), seed=3))),
            "linear": (lambda a, b: tf.matmul(a, b, transpose_b=True), (x, w)),
            "conv": (lambda a, k: tf.nn.conv2d(a, k, 1, "VALID"), (img, t((3, 3, 2, 3), seed=4))),
            "conv_transpose": (lambda a, k: keras.ops.conv_transpose(a, k, 1, "valid"), (img, t((3, 3, 3, 2), seed=4))),
            "bmm": (lambda a, b: tf.linalg.matmul(a, b), (t((2, 4, 8)), t((2, 8, 3), seed=5))),
            "einsum": (lambda a, b: keras.ops.einsum("ij,kj->ik", a, b), (x, w)),
            "attention": (lambda q, k, v: keras.ops.dot_product_attention(q, k, v), tuple(qkv)),
            "softmax": (lambda a: keras.ops.softmax(a, axis=-1), (x,)),
            "log_softmax": (lambda a: tf.nn.log_softmax(a, axis=-1), (x,)),
            "layer_norm": (lambda a: keras.ops.layer_normalization(a, epsilon=1e-5), (x,)),
            "batch_norm": (_batch_norm, (x,)),
            "group_norm": (composite, (img,)),
            "rms_norm": (lambda a: keras.ops.rms_normalization(a, epsilon=1e-6), (x,)),
            "cross_entropy": (lambda a: keras.losses.sparse_categorical_crossentropy(labels, a, from_logits=True), (x,)),
            "nll_loss": (lambda a: composite(a, labels), (x,)),
            "mse_loss": (lambda a, b: keras.losses.mean_squared_error(b, a), (x, y)),
            "bce_with_logits": (lambda a, b: tf.nn.sigmoid_cross_entropy_with_logits(labels=b, logits=a), (x, target)),
            "exp": (lambda a: tf.exp(a), (x,)),
            "log": (lambda a: keras.ops.log(a), (t((4, 8), positive=True),)),
            "pow": (lambda a: tf.pow(a, 2.5), (tf.abs(x),)),
            "sum": (lambda a: tf.reduce_sum(a), (x,)),
            "mean": (lambda a: keras.ops.mean(a), (x,)),
            "cumsum": (lambda a: tf.cumsum(a, axis=0), (x,)),
            "prod": (lambda a: keras.ops.prod(a), (x,)),
            "logsumexp": (lambda a: tf.reduce_logsumexp(a, axis=-1), (x,)),
            "vector_norm": (lambda a: keras.ops.norm(a), (x,)),
            "add": (lambda a, b: tf.add(a, b), (x, y)),
            "mul": (lambda a, b: keras.ops.multiply(a, b), (x, y)),
            "cat": (lambda a, b: tf.concat([a, b], 0), (x, y)),
            "stack": (lambda a, b: keras.ops.stack([a, b]), (x, y)),
            "where": (lambda a, b: tf.where(a > 0, a, b), (x, y)),
            "relu": (tf.nn.relu, (x,)),
            "gelu": (keras.ops.gelu, (x,)),
            "max_pool": (lambda a: tf.nn.max_pool2d(a, 2, 2, "VALID"), (img,)),
            "reshape": (lambda a: tf.reshape(a, (8, 4)), (x,)),
            "transpose": (keras.ops.transpose, (x,)),
            "dropout": (lambda a: tf.nn.dropout(a, 0.5, seed=0), (x,)),
            "embedding": (lambda table: keras.ops.take(table, tf.constant([0, 2, 1]), axis=0), (w,)),
        }  # fmt: skip
        return table[op]

    def run_stuck(self, p: dict, mode: str) -> dict:
        """Issue 18's stuck detection, in a traced step (``tf.function``): the step that raises and the cause."""
        if mode == "native":
            raise Skip("keras.optimizers.LossScaleOptimizer has no stuck detection")
        from conformance.cases import stuck_cause  # (imports mpx: the mpx path only)

        w = keras.Variable(np.ones(3, np.float32), name="w")
        opt = self.optimizer(mode, p["config"], keras.optimizers.SGD(0.1))
        opt.build([w])

        @tf.function
        def step(kind):
            with tf.GradientTape() as tape:
                plain = tf.reduce_sum(w * tf.where(kind == 2, np.float32(np.inf), np.float32(1.0)))
                loss = tf.cond(
                    kind == 1, lambda: tf.reduce_sum(tf.sqrt(w - tf.stop_gradient(w))), lambda: plain
                )
                scaled = opt.scale_loss(loss)
            opt.apply(tape.gradient(scaled, [w]), [w])

        for i, kind in enumerate(p["steps"], 1):
            try:
                step(tf.constant({"ok": 0, "grad": 1, "loss": 2}[kind]))
            except tf.errors.InvalidArgumentError as e:  # the ScalerStuckError, re-raised by TensorFlow
                if "ScalerStuckError" not in str(e):
                    raise
                return {"raised_at": i, "cause": stuck_cause(str(e))}
        return {"raised_at": None, "cause": None}

    def run_distributed(self, p: dict, mode: str) -> dict:
        """MirroredStrategy on 2 logical CPUs, in a process of its own started once (conformance.distributed)."""
        from conformance import distributed

        return distributed.observed("tf", p, mode)


ADAPTER = TFAdapter()
export(ADAPTER, globals())
functions = ADAPTER.functions

# the fp8 group (issue 26): conformance/fp8/keras.py, the same on every Keras backend;
# the blocks group (issue 31): conformance/blocks/keras.py
from conformance.blocks.keras import run_block_quantize  # noqa: E402, F401
from conformance.fp8.keras import run_fp8_matmul, run_fp8_quantize, run_fp8_trace  # noqa: E402, F401
