"""The op table for user code's ``keras.ops``/``keras.losses`` on this process's Keras backend (#24).

Exact dtypes eagerly and inside ``fit`` (the ops run in a custom layer's ``call`` and a hand-written
loss: at trace time on TensorFlow and JAX, each step on torch; ``jit_compile`` on and off); library
code (Keras's own layers and activations) untouched; every function put back (``is``) after the scope
and after ``fit``; a nested float32 scope forces float32; ``op_table=`` overrides.
"""

from __future__ import annotations

import doctest
import importlib

import keras
import numpy as np
import pytest

import mpx
import mpx_keras

A = importlib.import_module("mpx_keras.autocast")  # the module (mpx_keras.autocast is also the scope)
BACKEND = keras.config.backend()
MIXED = ["mixed_float16", "mixed_bfloat16"]
dtype = keras.backend.standardize_dtype


def snapshot() -> dict:
    """Every public function of keras.ops (and its submodules) and keras.losses, by dotted name."""
    out = {}
    for path in ("ops", "ops.nn", "ops.numpy", "ops.linalg", "losses"):
        module = keras
        for part in path.split("."):
            module = getattr(module, part)
        for name in dir(module):
            fn = getattr(module, name)
            if not name.startswith("_") and callable(fn) and not isinstance(fn, type):
                out[f"keras.{path}.{name}"] = fn
    return out


def changed(before: dict) -> list[str]:
    after = snapshot()
    return sorted(name for name, fn in before.items() if after.get(name) is not fn)


@pytest.fixture(autouse=True)
def _nothing_held():
    """mpx's global policy of this thread back to float32 (a mixed one would hold the dispatch)."""
    mpx_keras.set_global_policy("float32")
    assert A.holds() == 0
    yield
    mpx_keras.set_global_policy("float32")
    keras.config.set_dtype_policy("float32")


def ops_of(x) -> dict[str, str]:
    """The dtypes of the op table's ops on ``x`` (a half tensor), called here: user code."""
    h32 = keras.ops.cast(x, "float32")
    return {
        "softmax": dtype(keras.ops.softmax(x).dtype),
        "logsumexp": dtype(keras.ops.logsumexp(x, axis=-1).dtype),
        "mean": dtype(keras.ops.mean(x).dtype),
        "matmul": dtype(keras.ops.matmul(h32, keras.ops.transpose(h32)).dtype),
        "einsum": dtype(keras.ops.einsum("ij,kj->ik", h32, h32).dtype),
        "add": dtype(keras.ops.add(x, h32).dtype),
        "add_half": dtype(keras.ops.add(x, x).dtype),
        "relu": dtype(keras.ops.relu(x).dtype),
    }


def expected(spec: str) -> dict[str, str]:
    """What mpx.OP_TABLE says for a half input of ``spec``'s compute dtype."""
    half = mpx.get_policy(spec).compute_dtype
    return {
        "softmax": "float32",  # FLOAT32 ops
        "logsumexp": "float32",
        "mean": "float32",
        "matmul": half,  # LOWER ops: float32 inputs computed in the compute dtype
        "einsum": half,
        "add": "float32",  # PROMOTE: the widest input
        "add_half": half,
        "relu": half,  # PASSTHROUGH
    }


def native(spec: str) -> dict[str, str]:
    half = mpx.get_policy(spec).compute_dtype
    return {**expected(spec), "softmax": half, "logsumexp": half, "mean": half, "matmul": "float32",
            "einsum": "float32"}  # fmt: skip


@pytest.mark.parametrize("module", [A, mpx_keras], ids=["mpx_keras.autocast", "mpx_keras"])
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("spec", MIXED)
def test_user_code_follows_the_table_eagerly_and_nothing_stays_installed(spec):
    x = keras.ops.ones((2, 3), dtype=mpx.get_policy(spec).compute_dtype)
    before = snapshot()
    assert ops_of(x) == native(spec)  # outside any scope: Keras's own dtypes
    for scope in (mpx_keras.autocast, mpx_keras.policy_scope):
        with scope(spec):
            assert A.holds() == 1 and keras.ops.softmax is not before["keras.ops.softmax"]
            assert ops_of(x) == expected(spec)
        assert A.holds() == 0 and changed(before) == []
        assert ops_of(x) == native(spec)


def test_keras_losses_called_from_user_code():
    y, p16 = keras.ops.zeros((4, 3), "bfloat16"), keras.ops.full((4, 3), 0.3, "bfloat16")
    with mpx_keras.autocast("mixed_bfloat16"):
        assert dtype(keras.losses.mean_squared_error(y, p16).dtype) == "float32"
        assert dtype(keras.losses.categorical_crossentropy(y, p16, from_logits=True).dtype) == "float32"
    assert dtype(keras.losses.mean_squared_error(y, p16).dtype) == "bfloat16"


def test_library_code_keeps_its_own_dtypes():
    """Keras's layers and activations call keras.ops from Keras's modules: those calls pass through."""
    x = keras.ops.ones((2, 3), dtype="float16")
    with mpx_keras.policy_scope("mixed_float16"):
        softmax, dense = keras.layers.Softmax(), keras.layers.Dense(3, activation="softmax")
        assert dtype(softmax(x).dtype) == "float16"  # as natively (apply_policy would make it float32)
        assert dtype(dense(x).dtype) == "float16"
        assert dtype(keras.activations.softmax(x).dtype) == "float16"  # Keras's function, called from here
        assert dtype(keras.ops.softmax(x).dtype) == "float32"  # the user's own call


def test_a_nested_float32_scope_forces_float32():
    h, w = keras.ops.ones((2, 3), "float16"), keras.ops.ones((3, 2), "float16")
    for scope in (mpx_keras.autocast, mpx_keras.policy_scope):
        with scope("float32"):  # at top level there is nothing to force
            assert dtype(keras.ops.matmul(h, w).dtype) == "float16"
        with scope("mixed_float16"):
            assert dtype(keras.ops.matmul(h, w).dtype) == "float16"
            with scope("float32"):
                assert dtype(keras.ops.matmul(h, w).dtype) == "float32"  # LOWER ops compute in float32
                assert dtype(keras.ops.softmax(h).dtype) == "float32"
                assert dtype(keras.ops.add(h, keras.ops.ones((2, 3))).dtype) == "float32"
                assert dtype(keras.ops.relu(h).dtype) == "float16"  # PASSTHROUGH
                with scope("mixed_bfloat16"):  # a mixed scope inside lowers again
                    assert dtype(keras.ops.matmul(keras.ops.ones((2, 3)), keras.ops.ones((3, 2))).dtype) == (
                        "bfloat16"
                    )
            assert dtype(keras.ops.matmul(h, w).dtype) == "float16"
        assert A.holds() == 0


class Float32Island(keras.layers.Layer):
    """A custom layer that computes a block of its call in a float32 scope."""

    def call(self, x):
        with mpx_keras.autocast("float32"):
            SEEN["island_matmul"] = dtype(keras.ops.matmul(x, keras.ops.transpose(x)).dtype)
        SEEN["after_island_matmul"] = dtype(keras.ops.matmul(x, keras.ops.transpose(x)).dtype)
        return x


@pytest.mark.parametrize("spec", MIXED)
def test_a_float32_scope_inside_a_layer_call_forces_float32(spec):
    half = mpx.get_policy(spec).compute_dtype
    with mpx_keras.policy_scope(spec):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Float32Island()])
    mpx_keras.apply_policy(model, spec)
    SEEN.clear()
    model(np.ones((2, 3), "float32"))
    assert SEEN == {"island_matmul": "float32", "after_island_matmul": half}
    assert A.holds() == 0


def test_registering_targets_while_the_dispatch_is_installed_is_refused():
    with mpx_keras.autocast("mixed_float16"):
        with pytest.raises(
            mpx.MPXError, match="register_targets\\(\\) while the op table's dispatch is installed"
        ):
            A.register_targets(lambda: [])
        assert keras.backend.standardize_dtype(
            keras.ops.softmax(keras.ops.ones((2, 2), "float16")).dtype
        ) == ("float32")
    assert A.holds() == 0


def test_op_table_argument_of_autocast_policy_scope_and_apply_policy():
    table = mpx.OP_TABLE.replace(softmax="lower", matmul="float32")
    h, w = keras.ops.ones((2, 3), "float16"), keras.ops.ones((3, 2), "float16")
    for scope in (mpx_keras.autocast, mpx_keras.policy_scope):
        with scope("mixed_float16", op_table=table):
            assert dtype(keras.ops.softmax(h).dtype) == "float16"  # LOWER in this table
            assert dtype(keras.ops.matmul(h, w).dtype) == "float32"  # FLOAT32 in this table
        with scope("mixed_float16", op_table=mpx.OP_TABLE.without("softmax")):
            assert dtype(keras.ops.softmax(h).dtype) == "float16"  # not in the table: left alone
        with pytest.raises(mpx.MPXError, match="op_table: expected an mpx.OpTable or None, got dict"):
            with scope("mixed_float16", op_table={"softmax": "lower"}):
                pass
    with mpx_keras.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Capture(name="capture")])
    mpx_keras.apply_policy(model, "mixed_float16", op_table=table)
    model(np.ones((2, 3), "float32"))
    assert SEEN["softmax"] == "float16" and SEEN["matmul"] == "float32"
    mpx_keras.apply_policy(model, "mixed_float16")  # the default table again
    model(np.ones((2, 3), "float32"))
    assert SEEN["softmax"] == "float32" and SEEN["matmul"] == "float16"


def test_autocast_op_makes_a_users_function_follow_an_op():
    @mpx_keras.autocast_op("nll_loss")
    def nll(log_probs, target):
        picked = keras.ops.take_along_axis(log_probs, target[:, None], axis=-1)
        return -keras.ops.mean(picked)

    lp, t = keras.ops.full((4, 3), -1.0, "bfloat16"), keras.ops.convert_to_tensor(np.array([0, 1, 2, 0]))
    assert dtype(nll(lp, t).dtype) == "bfloat16"
    with mpx_keras.autocast("mixed_bfloat16"):
        assert dtype(nll(lp, t).dtype) == "float32"
    with pytest.raises(mpx.MPXError, match="not in the op table"):
        mpx_keras.autocast_op("softmaxx")


# -- inside fit ----------------------------------------------------------------------------------
SEEN: dict[str, str] = {}


class Capture(keras.layers.Layer):
    """A custom layer: records the op table's dtypes inside its call (traced, or each step on torch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.softmax = keras.layers.Softmax()  # a Keras layer inside: library code

    def call(self, x):
        SEEN.update(ops_of(x), input=dtype(x.dtype))
        SEEN["library_softmax"] = dtype(self.softmax(x).dtype)
        SEEN["activations_softmax"] = dtype(keras.activations.softmax(x).dtype)  # Keras's function
        return x


def user_loss(y_true, y_pred):
    """A hand-written loss (user code Keras calls inside the train step)."""
    SEEN["loss_logsumexp"] = dtype(keras.ops.logsumexp(y_pred, axis=-1).dtype)
    return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float32") - y_true))


def _fit(model, jit_compile: bool) -> None:
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=user_loss, jit_compile=jit_compile)
    SEEN.clear()
    model.fit(np.ones((8, 3), "float32"), np.zeros((8, 3), "float32"), batch_size=4, epochs=1, verbose=0)


# jit_compile=True on torch is torch.compile: dynamo traces the wrappers (tests/keras/test_torch_compile.py)
FIT_CASES = [("mixed_float16", False), ("mixed_bfloat16", False), ("mixed_bfloat16", True)]


@pytest.mark.parametrize(("spec", "jit_compile"), FIT_CASES, ids=[f"{s}-jit{int(j)}" for s, j in FIT_CASES])
def test_inside_fit_under_a_policy_scope(spec, jit_compile):
    before = snapshot()
    half = mpx.get_policy(spec).compute_dtype
    with mpx_keras.policy_scope(spec):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Capture()])
        _fit(model, jit_compile)
    # Keras's Softmax layer and softmax activation compute in the compute dtype, as natively
    library = {"library_softmax": half, "activations_softmax": half}
    assert SEEN == {**expected(spec), **library, "input": half, "loss_logsumexp": "float32"}
    assert A.holds() == 0 and changed(before) == []


@pytest.mark.parametrize("spec", MIXED)
def test_inside_fit_of_a_model_given_its_policy_by_apply_policy(spec):
    """No scope around fit: the layer's own mpx policy holds the dispatch during its call."""
    before = snapshot()
    half = mpx.get_policy(spec).compute_dtype
    with mpx_keras.policy_scope(spec):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Capture()])
    mpx_keras.apply_policy(model, spec)
    assert A.holds() == 0
    _fit(model, False)
    # the loss runs outside every layer and scope, on the model's outputs in the output dtype (float32)
    # the Softmax layer inside is in the softmax category: float32 by apply_policy's per-layer policy
    library = {"library_softmax": "float32", "activations_softmax": half}
    assert SEEN == {**expected(spec), **library, "input": half, "loss_logsumexp": "float32"}
    assert A.holds() == 0 and changed(before) == []


class CustomStep(keras.Model):
    """A model with the backend's own hand-written ``train_step`` (Keras's guide for each backend)."""

    def _loss(self, y, y_pred):
        SEEN["step_softmax"] = dtype(keras.ops.softmax(y_pred).dtype)  # user code inside the step
        SEEN["step_matmul"] = dtype(keras.ops.matmul(y, keras.ops.transpose(y)).dtype)
        return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float32") - y))

    if BACKEND == "tensorflow":

        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                loss = self._loss(y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    elif BACKEND == "torch":

        def train_step(self, data):
            import torch

            x, y = data
            self.zero_grad()
            loss = self._loss(y, self(x, training=True))
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(grads, self.trainable_weights)
            return {"loss": loss}

    else:

        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_vars, metrics_vars = state
            x, y = data

            def loss_fn(tv, ntv):
                y_pred, ntv = self.stateless_call(tv, ntv, x, training=True)
                return self._loss(y, y_pred), ntv

            (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable)
            trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
            return {"loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)


@pytest.mark.parametrize("spec", MIXED)
def test_inside_a_custom_train_step(spec):
    before = snapshot()
    half = mpx.get_policy(spec).compute_dtype
    with mpx_keras.policy_scope(spec):
        inputs = keras.Input((3,))
        model = CustomStep(inputs, Capture()(keras.layers.Dense(3)(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.0), jit_compile=False)
        SEEN.clear()
        model.fit(np.ones((8, 3), "float32"), np.zeros((8, 3), "float32"), batch_size=4, epochs=1, verbose=0)
    library = {"library_softmax": half, "activations_softmax": half}
    assert SEEN == {
        **expected(spec),
        **library,
        "input": half,
        "step_softmax": "float32",
        "step_matmul": half,
    }
    assert A.holds() == 0 and changed(before) == []
