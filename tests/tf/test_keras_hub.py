"""keras-hub backbones under mpx_tf: what is TensorFlow's own (#24).

What holds on every Keras backend (op dtypes as natively, softmax and norms in float32, Llama's float32
rotary embedding, fit with a skipped overflow, save and load) is tests/keras/test_keras_hub.py, which
tests/run.py runs on TensorFlow too.  Here: :func:`mpx_tf.autocast` also wraps TensorFlow's own functions
(``tf.*``, ``tf.math.*``, ``tf.nn.*``, ``tf.linalg.*``); keras-hub is library code for them as well, so a
user's scope around a backbone's call leaves its traced graph identical, op by op (names, types, dtypes).
"""

from __future__ import annotations

import importlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx_tf

keras_hub = pytest.importorskip("keras_hub")
A = importlib.import_module("mpx_tf.autocast")

SPEC = "mixed_float16"
INPUTS = {"token_ids": np.ones((2, 6), "int32"), "padding_mask": np.ones((2, 6), "int32")}
SIGNATURE = {k: tf.TensorSpec(v.shape, tf.int32) for k, v in INPUTS.items()}


def gpt2():
    return keras_hub.models.GPT2Backbone(
        dropout=0.1,
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=16,
    )


def llama():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=50,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
    )


def _ops(fn) -> list[tuple[str, str, tuple[str, ...]]]:
    """(op name, type, input dtypes) of every op of ``fn``'s traced graph inside the backbone, sorted.

    Layer scopes lose their numbering (``llama_rotary_embedding_2_1`` -> ``llama_rotary_embedding``),
    which differs from build to build.
    """
    graph = tf.function(fn).get_concrete_function(SIGNATURE).graph
    found = []
    for op in graph.get_operations():
        if "backbone" in op.name.split("/", 1)[0] and "/" in op.name:
            name = re.sub(r"(_\d+)+(?=/)", "", op.name.split("/", 1)[1])
            found.append((name, op.type, tuple(t.dtype.name for t in op.inputs)))
    return sorted(found)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
def test_a_users_mpx_tf_autocast_scope_leaves_a_backbones_graph_identical(build):
    with mpx_tf.policy_scope(SPEC):
        model = build()
    mpx_tf.apply_policy(model, SPEC)
    plain = _ops(lambda x: model(x, training=True))
    with mpx_tf.autocast(SPEC):  # keras.ops and tf.* wrapped: keras-hub's calls pass through both
        scoped = _ops(lambda x: model(x, training=True))
    assert scoped == plain
    assert len(plain) > 100
    assert A.holds() == 0
    assert keras.config.dtype_policy().name == "float32"
