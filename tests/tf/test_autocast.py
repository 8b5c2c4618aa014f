"""mpx_tf.autocast: keras.ops, keras.losses and tf functions follow the op table (eager, tf.function, fit)."""

from __future__ import annotations

import importlib
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf
from conformance import cases as C
from conformance.adapters import tf as adapter

L = keras.layers
OP_CASES = [c for c in C.op_cases()]
VALUE_CASES = [c for c in C.numeric_cases() if c["kind"] == "op_value"]


def _ids(cases):
    return [c["id"] for c in cases]


def _np(t) -> np.ndarray:
    """A tensor's values in float64 (exact for every half and float32 value)."""
    return np.array(t.numpy(), dtype=np.float64)


def _run(case, fn, args):
    with mpx_tf.autocast(case["params"]["policy"]):
        return fn(*args)


@pytest.mark.parametrize("case", OP_CASES, ids=_ids(OP_CASES))
def test_every_op_case_eagerly_and_in_tf_function(case):
    p = case["params"]
    fn, args = adapter.functions(p["op"], p["dtype"], p.get("other"))
    assert adapter.dtype_name(_run(case, fn, args).dtype) == case["expected"]["dtype"]

    traced = tf.function(fn)
    with mpx_tf.autocast(p["policy"]):
        first = traced(*args)
        second = traced(*args)
    assert traced.experimental_get_tracing_count() == 1
    assert adapter.dtype_name(first.dtype) == adapter.dtype_name(second.dtype) == case["expected"]["dtype"]
    if p["op"] != "dropout":  # random
        np.testing.assert_array_equal(_np(first), _np(_run(case, fn, args)))


@pytest.mark.parametrize("case", VALUE_CASES, ids=_ids(VALUE_CASES))
def test_float32_ops_of_half_inputs_are_the_float32_computation(case):
    """Bit for bit: the half inputs are cast up and the op runs on them in float32."""
    p = case["params"]
    fn, args = adapter.functions(p["op"], p["dtype"])
    ref_fn, ref_args = adapter.functions(p["op"], p["dtype"], upcast=True)
    out = _run(case, fn, args)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(_np(out), _np(ref_fn(*ref_args)))
    native = _np(fn(*args))  # outside the scope: Keras/TF compute in half
    assert not np.array_equal(native, _np(out))


def test_outside_any_scope_nothing_changes():
    x16 = tf.ones((2, 3), "float16")
    assert keras.ops.softmax(x16).dtype == tf.float16
    assert tf.reduce_sum(x16).dtype == tf.float16
    assert keras.ops.matmul(tf.ones((2, 3)), tf.ones((3, 2))).dtype == tf.float32
    # Keras's own global policy alone does not switch the op table on
    keras.config.set_dtype_policy("mixed_float16")
    assert keras.ops.softmax(x16).dtype == tf.float16
    with mpx_tf.autocast("float32"):  # a policy that does not lower: a no-op
        assert keras.ops.softmax(x16).dtype == tf.float16
        assert keras.ops.matmul(tf.ones((2, 3)), tf.ones((3, 2))).dtype == tf.float32


def test_keras_layers_keep_their_own_dtypes_inside_a_scope():
    """Keras's layers call tf functions from Keras's modules: those calls pass through."""
    with mpx_tf.policy_scope("mixed_bfloat16"):
        dense = L.Dense(3, activation="softmax")
    with mpx_tf.autocast("mixed_bfloat16"):
        assert dense(tf.ones((2, 4))).dtype == tf.bfloat16


def test_keras_losses_called_directly():
    y, p16 = tf.zeros((4, 3), "bfloat16"), tf.fill((4, 3), tf.constant(0.3, "bfloat16"))
    labels = tf.constant([0, 1, 2, 0])
    with mpx_tf.autocast("mixed_bfloat16"):
        assert keras.losses.mean_squared_error(y, p16).dtype == tf.float32
        assert keras.losses.categorical_crossentropy(y, p16, from_logits=True).dtype == tf.float32
        assert keras.losses.sparse_categorical_crossentropy(labels, p16, from_logits=True).dtype == tf.float32
        assert keras.losses.binary_crossentropy(y, p16, from_logits=True).dtype == tf.float32
    with mpx_tf.autocast(C.KEEP_NONE_SPEC):  # keep_fp32=none: losses follow the compute dtype
        assert keras.losses.mean_squared_error(y, p16).dtype == tf.bfloat16
        assert keras.ops.exp(p16).dtype == tf.float32  # exp is not in a category: still float32


def test_nested_scopes_and_errors():
    x = tf.ones((2, 3), "bfloat16")
    with mpx_tf.autocast("mixed_bfloat16"):
        with mpx_tf.autocast("mixed_float16"):  # the innermost wins
            assert keras.ops.matmul(tf.ones((2, 3)), tf.ones((3, 2))).dtype == tf.float16
        assert keras.ops.softmax(x).dtype == tf.float32
    with pytest.raises(mpx.PolicyError):
        with mpx_tf.autocast("float17"):
            pass
    with pytest.raises(mpx.MPXError, match="not in the op table"):
        mpx_tf.autocast_op("softmaxx")
    for scope in (mpx_tf.autocast, mpx_tf.policy_scope):
        with pytest.raises(mpx.MPXError, match="op_table: expected an mpx.OpTable or None, got dict"):
            with scope("mixed_float16", op_table={"softmax": "lower"}):
                pass
    with pytest.raises(mpx.MPXError, match="op_table: expected an mpx.OpTable"):
        mpx_tf.apply_policy(keras.Sequential([keras.Input((2,)), L.Dense(2)]), "mixed_float16", op_table="x")


H16, W16 = (
    tf.constant([[1.0, 2.0, 3.0]] * 2, "float16"),
    tf.constant([[0.1, 0.2], [0.3, 0.4], [0.5, 0.7]], "float16"),
)


def _forced_float32():
    """Under a float32 region: LOWER and FLOAT32 ops compute the half inputs in float32, exactly."""
    out = keras.ops.matmul(H16, W16)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(
        out.numpy(), tf.matmul(tf.cast(H16, "float32"), tf.cast(W16, "float32")).numpy()
    )
    assert tf.matmul(H16, W16).dtype == tf.float32
    assert keras.ops.softmax(tf.ones((2, 3), "bfloat16")).dtype == tf.float32
    assert keras.ops.add(H16, tf.ones((2, 3))).dtype == tf.float32  # PROMOTE: the widest input
    assert keras.ops.relu(H16).dtype == tf.float16  # PASSTHROUGH: untouched


def test_a_float32_autocast_nested_in_a_mixed_one_forces_float32():
    with mpx_tf.autocast("float32"):  # at top level there is nothing to force: a no-op
        assert keras.ops.matmul(H16, W16).dtype == tf.float16
    with mpx_tf.autocast("mixed_float16"):
        assert keras.ops.matmul(H16, W16).dtype == tf.float16
        with mpx_tf.autocast("float32"):
            _forced_float32()
            with mpx_tf.autocast("float32"):  # still inside the mixed scope
                _forced_float32()
            with mpx_tf.autocast("mixed_bfloat16"):  # a mixed scope inside lowers again
                assert keras.ops.matmul(tf.ones((2, 3)), tf.ones((3, 2))).dtype == tf.bfloat16
            traced = tf.function(lambda: keras.ops.matmul(H16, W16))
            assert traced().dtype == tf.float32
        assert keras.ops.matmul(H16, W16).dtype == tf.float16  # restored on exit


def test_a_float32_policy_scope_nested_in_a_mixed_one_forces_float32():
    with mpx_tf.policy_scope("mixed_float16"):
        assert keras.ops.softmax(H16).dtype == tf.float32 and keras.ops.matmul(H16, W16).dtype == tf.float16
        with mpx_tf.policy_scope("float32"):
            assert L.Dense(2).compute_dtype == "float32"  # new layers too
            _forced_float32()
        assert keras.ops.matmul(H16, W16).dtype == tf.float16
    with mpx_tf.policy_scope("float32"):  # not nested: nothing forced
        assert keras.ops.matmul(H16, W16).dtype == tf.float16


class Float32Island(L.Layer):
    """A custom layer that computes a block of its call in a float32 autocast scope."""

    def call(self, x):
        with mpx_tf.autocast("float32"):
            return keras.ops.matmul(x, keras.ops.transpose(x))


def test_a_float32_scope_inside_a_layer_call_forces_float32():
    with mpx_tf.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), L.Dense(3), Float32Island()])
    mpx_tf.apply_policy(model, "mixed_float16")
    assert model(tf.ones((2, 3))).dtype == tf.float32  # the island's matmul of float16 inputs: float32


def test_op_table_on_autocast_policy_scope_and_apply_policy():
    table = mpx.OP_TABLE.replace(softmax="lower", sum="lower", matmul="float32")
    x = tf.ones((2, 3), "float16")
    with mpx_tf.autocast("mixed_float16", op_table=table):
        assert keras.ops.softmax(x).dtype == tf.float16  # LOWER now
        assert keras.ops.matmul(H16, W16).dtype == tf.float32  # FLOAT32 now
    with mpx_tf.autocast("mixed_float16", op_table=mpx.OP_TABLE.without("softmax")):
        assert keras.ops.softmax(x).dtype == tf.float16  # not in the table: left alone
    with mpx_tf.policy_scope("mixed_float16", op_table=table):
        assert keras.ops.softmax(x).dtype == tf.float16
    with mpx_tf.policy_scope("mixed_float16"):
        assert keras.ops.softmax(x).dtype == tf.float32  # the default table again
        model = keras.Sequential([keras.Input((3,)), L.Dense(3), Recording(3), L.ReLU()])
    mpx_tf.apply_policy(model, "mixed_float16", op_table=table.replace(relu="float32"))
    assert model.layers[-1].autocast is True  # relu is FLOAT32 in this table: Keras casts its inputs
    model(tf.ones((2, 3)))
    assert Recording.seen["softmax"] == "float16" and Recording.seen["matmul"] == "float32"
    mpx_tf.apply_policy(model, "mixed_float16")  # again with the default table
    assert model.layers[-1].autocast is False
    model(tf.ones((2, 3)))
    assert Recording.seen["softmax"] == "float32" and Recording.seen["matmul"] == "float16"


def test_set_global_policy_switches_the_table_on():
    x = tf.ones((2, 3), "float16")
    with mpx_tf.policy_scope("mixed_float16"):
        assert keras.ops.softmax(x).dtype == tf.float32
        keras.config.set_dtype_policy("mixed_bfloat16")  # Keras's policy changed behind mpx's back
        assert keras.ops.softmax(x).dtype == tf.float16
    assert keras.ops.softmax(x).dtype == tf.float16


class Recording(L.Layer):
    """A custom layer doing its work with keras.ops (the hazard: half precision where float32 is due)."""

    seen: dict[str, str] = {}  # noqa: RUF012

    def __init__(self, units: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], self.units), initializer="glorot_uniform")

    def call(self, x):
        h = keras.ops.matmul(x, self.w)
        probs = keras.ops.softmax(h, axis=-1)
        total = keras.ops.sum(probs, axis=-1, keepdims=True)
        Recording.seen.update(matmul=h.dtype, softmax=probs.dtype, sum=total.dtype)
        return keras.ops.log(probs / total)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


keras.saving.register_keras_serializable("mpx_tests")(Recording)


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16"])
def test_a_custom_layer_under_apply_policy_follows_the_table_in_fit(spec):
    half = mpx.get_policy(spec).compute_dtype
    with mpx_tf.policy_scope(spec):
        model = keras.Sequential([keras.Input((6,)), L.Dense(5), Recording(name="rec")])
    mpx_tf.apply_policy(model, spec)
    Recording.seen.clear()
    model(np.ones((2, 6), "float32"))
    assert Recording.seen == {"matmul": half, "softmax": "float32", "sum": "float32"}
    model.compile(optimizer=mpx_tf.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    Recording.seen.clear()
    model.fit(np.ones((8, 6), "float32"), np.zeros((8, 4), "float32"), epochs=2, batch_size=4, verbose=0)
    assert Recording.seen == {"matmul": half, "softmax": "float32", "sum": "float32"}  # the fit trace
    # without mpx the same layer computes its softmax in half precision
    with mpx_tf.policy_scope("float32"):
        pass
    keras.config.set_dtype_policy(spec)
    native = keras.Sequential([keras.Input((6,)), Recording()])
    Recording.seen.clear()
    native(np.ones((2, 6), "float32"))
    assert Recording.seen["softmax"] == half


class HandLoss(keras.Model):
    """A custom train_step that computes its loss by hand with keras.ops."""

    seen: dict[str, str] = {}  # noqa: RUF012

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            log_probs = keras.ops.log_softmax(logits, axis=-1)
            y = keras.ops.cast(y, log_probs.dtype)
            loss = -keras.ops.mean(keras.ops.sum(y * log_probs, axis=-1))
            HandLoss.seen.update(logits=logits.dtype, log_softmax=log_probs.dtype, loss=loss.dtype)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_autocast_around_fit_covers_a_hand_written_loss():
    with mpx_tf.policy_scope("mixed_bfloat16"):
        inp = keras.Input((6,))
        model = HandLoss(inp, L.Dense(3)(inp))
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    x, y = np.ones((8, 6), "float32"), np.eye(3, dtype="float32")[[0, 1, 2, 0, 1, 2, 0, 1]]
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    assert HandLoss.seen == {"logits": "bfloat16", "log_softmax": "bfloat16", "loss": "bfloat16"}
    model.train_function = None
    with mpx_tf.autocast("mixed_bfloat16"):
        model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    assert HandLoss.seen == {"logits": "bfloat16", "log_softmax": "float32", "loss": "float32"}


def test_the_layer_policy_wins_over_the_scope():
    with mpx_tf.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((6,)), Recording(name="rec")])
    mpx_tf.apply_policy(model, mpx.get_policy("mixed_bfloat16").with_overrides({"rec": "float32"}))
    Recording.seen.clear()
    with mpx_tf.autocast("mixed_bfloat16"):
        model(np.ones((2, 6), "float32"))
    assert Recording.seen == {"matmul": "float32", "softmax": "float32", "sum": "float32"}


class EveryOp(L.Layer):
    """Evaluates every op case of one policy inside its call (so inside fit's traced step)."""

    def __init__(self, cases, **kwargs):
        super().__init__(**kwargs)
        self.cases = cases
        self.seen: dict[str, str] = {}

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 1), initializer="ones")

    def call(self, x):
        for case in self.cases:
            p = case["params"]
            fn, args = adapter.functions(p["op"], p["dtype"], p.get("other"))
            self.seen[case["id"]] = adapter.dtype_name(fn(*args).dtype)
        return keras.ops.matmul(x, self.w)


@pytest.mark.parametrize("spec", [*C.OP_POLICIES, C.KEEP_NONE_SPEC])
def test_every_op_case_inside_fit(spec):
    cases = [c for c in OP_CASES if c["params"]["policy"] == spec]
    layer = EveryOp(cases)
    with mpx_tf.autocast(spec):  # natively some cases raise (TF's add refuses float16 + float32)
        model = keras.Sequential([keras.Input((3,)), layer])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        layer.seen.clear()
        model.fit(np.ones((4, 3), "float32"), np.zeros((4, 1), "float32"), epochs=2, batch_size=2, verbose=0)
    assert layer.seen == {c["id"]: c["expected"]["dtype"] for c in cases}


# -- the user-code rule (#24): installed libraries' calls pass through -------------------------------
_SOURCE = "import keras\n\n\ndef probs(x):\n    return keras.ops.softmax(x)\n"


@pytest.fixture
def two_modules(tmp_path, monkeypatch):
    """The same source as a library (its top package in LIBRARY_PACKAGES) and as user code."""
    U = importlib.import_module("mpx_tf._user_code")
    (tmp_path / "mpx_test_lib").mkdir()
    (tmp_path / "mpx_test_lib" / "__init__.py").write_text(_SOURCE)
    (tmp_path / "mpx_test_user.py").write_text(_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(U, "LIBRARY_PACKAGES", U.LIBRARY_PACKAGES | {"mpx_test_lib"})
    monkeypatch.setattr(U, "_KINDS", {})
    for name in ("mpx_test_lib", "mpx_test_user"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module("mpx_test_lib"), importlib.import_module("mpx_test_user")


def test_a_librarys_calls_pass_through_eagerly_and_when_autograph_converts_them(two_modules):
    lib, user = two_modules
    x16 = tf.ones((2, 3), "float16")

    def both(x):  # AutoGraph converts both functions, into the same generated code
        return lib.probs(x), user.probs(x)

    with mpx_tf.autocast("mixed_float16"):
        assert [t.dtype for t in both(x16)] == [tf.float16, tf.float32]
        assert [t.dtype for t in tf.function(both)(x16)] == [tf.float16, tf.float32]
        assert lib.probs(x16).dtype == tf.float16 and keras.ops.softmax(x16).dtype == tf.float32


def test_installed_files_are_library_code(two_modules, monkeypatch):
    U = importlib.import_module("mpx_tf._user_code")
    _, user = two_modules
    x16 = tf.ones((2, 3), "float16")
    here = os.path.join(os.path.realpath(os.path.dirname(user.__file__)), "")
    monkeypatch.setattr(U, "_LIBRARY_DIRS", (*U._LIBRARY_DIRS, here))  # as if under site-packages
    with mpx_tf.autocast("mixed_float16"):
        assert user.probs(x16).dtype == tf.float16
    assert U.from_user_code(0) is True  # this test file is user code


def test_the_walk_through_tracing_frames_is_bounded(monkeypatch):
    U = importlib.import_module("mpx_tf._user_code")
    x16 = tf.ones((2, 3), "float16")
    monkeypatch.setattr(U, "MAX_TRACING_FRAMES", 1)  # the wrapper's own AutoGraph frame uses it up
    with mpx_tf.autocast("mixed_float16"):
        assert keras.ops.softmax(x16).dtype == tf.float16  # past the bound: passes through
