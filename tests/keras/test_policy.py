"""mpx_keras's policies on this process's Keras backend: per-layer dtypes eagerly and inside fit (no op
table involved: Keras's own per-layer casting), the output dtype, scopes, and what was moved from mpx_tf."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

BACKEND = keras.config.backend()
MIXED = ["mixed_float16", "mixed_bfloat16"]


class Probe(keras.layers.Layer):
    """Records the dtype of its input each time it runs (eagerly, or once per trace inside fit)."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner
        self.seen = []

    def call(self, x):
        y = self.inner(x)
        self.seen.append((keras.backend.standardize_dtype(x.dtype), keras.backend.standardize_dtype(y.dtype)))
        return y


def build(policy):
    with mpx_keras.policy_scope(policy):
        dense = Probe(keras.layers.Dense(4), name="dense_probe")
        norm = Probe(keras.layers.LayerNormalization(), name="norm_probe")
        model = keras.Sequential([keras.Input((3,)), dense, norm, keras.layers.Dense(1)])
    return mpx_keras.apply_policy(model, policy), dense, norm


@pytest.mark.parametrize("policy", MIXED)
def test_layer_dtypes_eagerly_and_inside_fit(policy):
    half = mpx.get_policy(policy).compute_dtype
    model, dense, norm = build(policy)
    assert dense.inner.compute_dtype == half and dense.inner.kernel.dtype == "float32"
    assert norm.inner.compute_dtype == "float32"  # normalization: float32 under a mixed policy
    x = np.ones((4, 3), np.float32)
    out = model(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"  # the policy's output dtype
    assert dense.seen[-1] == (half, half)
    assert norm.seen[-1][1] == "float32"
    dense.seen.clear(), norm.seen.clear()
    model.compile(optimizer=mpx_keras.LossScaleOptimizer(keras.optimizers.SGD(), policy), loss="mse")
    model.fit(x, np.ones((4, 1), np.float32), verbose=0)
    # the last call is the train step's (torch's trainer first runs a shape pass on meta tensors)
    assert dense.seen[-1] == (half, half)
    assert norm.seen[-1][1] == "float32"


def test_policy_scope_restores_and_nested_float32_scope_forces_float32():
    with mpx_keras.policy_scope("mixed_bfloat16"):
        assert keras.layers.Dense(2).compute_dtype == "bfloat16"
        with mpx_keras.policy_scope("float32"):
            assert keras.layers.Dense(2).compute_dtype == "float32"
        assert mpx_keras.get_global_policy() == mpx.get_policy("mixed_bfloat16")
    assert keras.config.dtype_policy().name == "float32"


def test_set_global_policy_and_op_table_argument():
    try:
        p = mpx_keras.set_global_policy("mixed_bfloat16", op_table=mpx.OP_TABLE)
        assert p == mpx.get_policy("mixed_bfloat16") and keras.layers.Dense(1).compute_dtype == "bfloat16"
    finally:
        keras.config.set_dtype_policy("float32")
    with pytest.raises(mpx.MPXError, match="op_table: expected an mpx.OpTable"):
        mpx_keras.set_global_policy("mixed_bfloat16", op_table="table")
    with pytest.raises(mpx.PolicyError):
        mpx_keras.apply_policy(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "mixed_float17")


def test_mpx_names_for_policies_keras_has_no_name_for():
    kp = mpx_keras.keras_dtype_policy("params=float16,compute=float32")
    assert kp.name.startswith(mpx_keras.NAME_PREFIX)
    assert (kp.variable_dtype, kp.compute_dtype) == ("float16", "float32")


def test_category_of_reads_the_core_table():
    assert mpx_keras.category_of(keras.layers.LayerNormalization()) == "normalization"
    assert mpx_keras.category_of(keras.layers.Activation("softmax")) == "softmax"
    assert mpx_keras.category_of(keras.layers.Dense(1)) is None
