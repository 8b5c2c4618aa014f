"""mpx policies on Keras 3: the global policy, scopes, per-layer overrides, output dtype."""

from __future__ import annotations

import doctest
import sys
from typing import ClassVar

import keras
import numpy as np
import pytest
import tensorflow as tf

import mpx
import mpx_tf
import mpx_tf.dtype_policy
import mpx_tf.loss_scale_optimizer
import mpx_tf.policy
from mpx_keras._layer_kinds import walk
from mpx_tf.policy import category_of, keras_dtype_policy

L = keras.layers
MIXED = ["mixed_float16", "mixed_bfloat16"]


@pytest.fixture(autouse=True)
def _no_global_hold():
    """mpx's global policy of this thread back to float32 after each test: a mixed one set here holds the
    op table's dispatch (documented), and the tests run after these in the process expect none."""
    yield
    mpx_tf.set_global_policy("float32")


@pytest.mark.parametrize(
    "module", [mpx_tf, mpx_tf.policy, mpx_tf.loss_scale_optimizer, mpx_tf.dtype_policy, sys.modules["mpx_tf.autocast"]]
)
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


# -- mapping to Keras dtype policies ---------------------------------------------------
@pytest.mark.parametrize(
    "spec, name, variable, compute",
    [
        ("float32", "float32", "float32", "float32"),
        ("mixed_float16", "mixed_float16", "float32", "float16"),
        ("16-mixed", "mixed_float16", "float32", "float16"),
        ("bf16", "mixed_bfloat16", "float32", "bfloat16"),
        ("float16", "float16", "float16", "float16"),
        ("bf16-true", "bfloat16", "bfloat16", "bfloat16"),
        ("p=f64", "float64", "float64", "float64"),
        ("params=float16,compute=float32", "mpx:params=float16,compute=float32", "float16", "float32"),
        ("params=float64,compute=bfloat16", "mpx:params=float64,compute=bfloat16", "float64", "bfloat16"),
    ],
)
def test_keras_dtype_policy(spec, name, variable, compute):
    kp = keras_dtype_policy(spec)
    assert isinstance(kp, keras.DTypePolicy)
    assert (kp.name, kp.variable_dtype, kp.compute_dtype) == (name, variable, compute)
    back = keras.dtype_policies.deserialize(keras.dtype_policies.serialize(kp))
    assert (type(back), back.name) == (type(kp), kp.name)
    # Keras rebuilds a saved layer's policy from its name alone
    again = keras.DTypePolicy(kp.name)
    assert (again.variable_dtype, again.compute_dtype) == (variable, compute)


def test_mpx_dtype_policy_names():
    with pytest.raises(mpx.PolicyError, match="dtype policy name"):
        keras.DTypePolicy("mpx:params=float17")
    with pytest.raises(ValueError, match="Cannot convert"):
        keras.DTypePolicy("float17")  # Keras's own names are untouched


# -- global policy and scopes ----------------------------------------------------------
def test_set_global_policy():
    p = mpx_tf.set_global_policy("mixed_bfloat16")
    assert p == mpx.get_policy("mixed_bfloat16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert mpx_tf.get_global_policy() is p
    dense = L.Dense(2)
    dense.build((None, 3))
    assert (dense.compute_dtype, dense.kernel.dtype) == ("bfloat16", "float32")


def test_get_global_policy_follows_keras():
    mpx_tf.set_global_policy("params=float32,compute=float16,output=float16")
    keras.config.set_dtype_policy("mixed_bfloat16")  # changed behind mpx's back
    assert mpx_tf.get_global_policy() == mpx.get_policy("mixed_bfloat16")
    keras.config.set_dtype_policy("float32")
    assert mpx_tf.get_global_policy() == mpx.get_policy("float32")


@pytest.mark.parametrize("spec", ["mixed_float16", "mixed_bfloat16", "bfloat16", "float16"])
def test_policy_scope_sets_and_restores(spec):
    mpx_tf.set_global_policy("mixed_bfloat16")
    outer = keras.config.dtype_policy()
    with mpx_tf.policy_scope(spec) as p:
        assert p == mpx.get_policy(spec)
        assert mpx_tf.get_global_policy() == p
        layer = L.Dense(2)
        assert layer.compute_dtype == p.compute_dtype
        assert layer.variable_dtype == p.param_dtype
    assert keras.config.dtype_policy() is outer
    assert mpx_tf.get_global_policy() == mpx.get_policy("mixed_bfloat16")


def test_policy_scope_restores_on_error_and_nests():
    with pytest.raises(RuntimeError, match="boom"):
        with mpx_tf.policy_scope("mixed_float16"):
            with mpx_tf.policy_scope("bfloat16"):
                assert keras.config.dtype_policy().name == "bfloat16"
                raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float32"


@pytest.mark.parametrize("bad", ["mixed_float17", "compute=int8", "params=f32,,compute=f16", 3])
def test_bad_specs_raise_mpx_errors(bad):
    with pytest.raises(mpx.PolicyError):
        mpx_tf.set_global_policy(bad)
    with pytest.raises(mpx.PolicyError):
        with mpx_tf.policy_scope(bad):
            pass  # pragma: no cover
    assert keras.config.dtype_policy().name == "float32"
    model = keras.Sequential([keras.Input((2,)), L.Dense(2)])
    with pytest.raises(mpx.PolicyError):
        mpx_tf.apply_policy(model, bad)


def test_apply_policy_rejects_non_layers():
    with pytest.raises(mpx.MPXError, match="Keras model or layer"):
        mpx_tf.apply_policy("model", "mixed_float16")


# -- native Keras: what mpx corrects ---------------------------------------------------
FLOAT32_LAYERS = [
    lambda: L.LayerNormalization(),
    lambda: L.BatchNormalization(),
    lambda: L.GroupNormalization(groups=2),
    lambda: L.UnitNormalization(),
    lambda: L.RMSNormalization(),
    lambda: L.Softmax(),
    lambda: L.Activation("softmax"),
    lambda: L.Activation("log_softmax"),
]


@pytest.mark.parametrize("make", FLOAT32_LAYERS)
@pytest.mark.parametrize("spec", MIXED)
def test_native_keras_runs_norms_and_softmax_in_half(make, spec):
    """Measured on the installed Keras: under a mixed policy these layers compute and return half."""
    half = mpx.get_policy(spec).compute_dtype
    with mpx_tf.policy_scope(spec):
        layer = make()
    x = tf.random.normal((4, 8), dtype=half)
    assert layer.compute_dtype == half
    assert layer(x).dtype == half


@pytest.mark.parametrize("make", FLOAT32_LAYERS)
@pytest.mark.parametrize("spec", MIXED)
def test_apply_policy_runs_norms_and_softmax_in_float32(make, spec):
    half = mpx.get_policy(spec).compute_dtype
    with mpx_tf.policy_scope(spec):
        layer = make()
        model = keras.Sequential([keras.Input((8,)), L.Dense(8, name="proj"), layer])
    assert category_of(layer) in ("normalization", "softmax")
    assert mpx_tf.apply_policy(model, spec) is model
    assert model.get_layer("proj").compute_dtype == half
    assert (layer.compute_dtype, layer.variable_dtype) == ("float32", "float32")
    x = tf.random.normal((4, 8), dtype=half)
    y = layer(x)
    assert y.dtype == "float32"
    # computed in float32 from the half input cast up: equal to a float32 layer on the cast input
    reference = type(layer).from_config({**layer.get_config(), "dtype": "float32"})
    reference.build(x.shape)
    reference.set_weights(layer.get_weights())
    np.testing.assert_array_equal(y.numpy(), reference(tf.cast(x, "float32")).numpy())
    assert model(np.ones((4, 8), "float32")).dtype == "float32"
    assert all(w.dtype == "float32" for w in model.weights)


# -- whole models ---------------------------------------------------------------------
class Recording:
    """Layer subclasses that record the dtype their call() receives and returns."""

    seen: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def wrap(cls, base: type) -> type:
        def call(self, inputs, *args, **kwargs):
            out = base.call(self, inputs, *args, **kwargs)
            cls.seen[self.name] = (inputs.dtype.name, out.dtype.name)
            return out

        return type(f"Recording{base.__name__}", (base,), {"call": call})


RLN = Recording.wrap(L.LayerNormalization)
RBN = Recording.wrap(L.BatchNormalization)
RSoftmax = Recording.wrap(L.Softmax)
RDense = Recording.wrap(L.Dense)


def _functional():
    inputs = keras.Input((4, 6))
    x = RDense(8, name="proj")(inputs)
    x = RLN(name="ln")(x)
    x = L.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(x, x)
    x = L.Conv1D(8, 3, padding="same", name="conv")(x)
    x = RBN(name="bn")(x)
    x = L.Flatten()(x)
    x = L.EinsumDense("ab,bc->ac", output_shape=10, name="head")(x)
    outputs = RSoftmax(name="probs")(x)
    return keras.Model(inputs, outputs, name="net")


def _nested_sequential():
    block = keras.Sequential([keras.Input((4, 6)), RDense(8, name="proj"), RLN(name="ln")], name="encoder")
    return keras.Sequential(
        [
            keras.Input((4, 6)),
            block,
            L.Conv1D(8, 3, name="conv"),
            RBN(name="bn"),
            L.Flatten(),
            L.Dense(10, name="head"),
            RSoftmax(name="probs"),
        ],
        name="net",
    )


@keras.saving.register_keras_serializable(package="mpx_tf_tests")
class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = RDense(8, name="proj")
        self.ln = RLN(name="ln")
        self.mha = L.MultiHeadAttention(2, 4, dropout=0.1, name="mha")

    def call(self, x, training=None):
        x = self.ln(self.proj(x))
        return self.mha(x, x, training=training)


class Net(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = Block(name="encoder")
        self.conv = L.Conv1D(8, 3, padding="same", name="conv")
        self.bn = RBN(name="bn")
        self.flat = L.Flatten()
        self.head = L.Dense(10, name="head")
        self.probs = RSoftmax(name="probs")

    def call(self, x, training=None):
        x = self.bn(self.conv(self.encoder(x, training=training)), training=training)
        return self.probs(self.head(self.flat(x)))


BUILDERS = {"functional": _functional, "nested-sequential": _nested_sequential, "subclassed": Net}


def _layers_by_path(model):
    return dict(walk(model))


@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("spec", MIXED)
def test_apply_policy_on_models(kind, spec):
    policy = mpx.get_policy(spec)
    half = policy.compute_dtype
    with mpx_tf.policy_scope(spec):
        model = BUILDERS[kind]()
        model(np.zeros((2, 4, 6), "float32"))  # builds the subclassed one
    Recording.seen.clear()
    native = model(np.random.rand(2, 4, 6).astype("float32"), training=True)
    assert native.dtype == half  # Keras alone: even the softmax output is half
    assert Recording.seen["ln"] == (half, half)

    assert mpx_tf.apply_policy(model, spec) is model
    by_path = _layers_by_path(model)
    for path, layer in by_path.items():
        if isinstance(layer, L.InputLayer):
            continue
        expected = "float32" if category_of(layer) else half
        assert layer.compute_dtype == expected, path
        lp = policy.for_module(path, category_of(layer))
        kp = keras_dtype_policy(lp)
        assert (layer.compute_dtype, layer.variable_dtype) == (kp.compute_dtype, kp.variable_dtype), path
        assert mpx_tf.dtype_policy.choices_of(layer.dtype_policy).policy == lp, path
    # the dotted paths are the names down the nesting
    if kind != "functional":
        assert "encoder.ln" in by_path and "encoder.proj" in by_path
    for mha in (layer for layer in by_path.values() if isinstance(layer, L.MultiHeadAttention)):
        assert mha.compute_dtype == half and mha._softmax.compute_dtype == "float32"

    Recording.seen.clear()
    out = model(np.random.rand(2, 4, 6).astype("float32"), training=True)
    assert out.dtype == "float32"
    assert Recording.seen["proj"][1] == half
    # every kept layer gets float32 in (its half input cast up) and gives float32 out
    assert Recording.seen["ln"] == ("float32", "float32")
    assert Recording.seen["bn"] == ("float32", "float32")
    assert Recording.seen["probs"] == ("float32", "float32")
    assert all(w.dtype == "float32" for w in model.weights)
    assert model.predict(np.zeros((3, 4, 6), "float32"), verbose=0).dtype == np.float32


def test_apply_policy_path_overrides_and_idempotence():
    policy = mpx.get_policy("mixed_bfloat16").with_overrides({"head": "float32", "encoder.*": "float32"})
    with mpx_tf.policy_scope(policy):
        model = Net()
        model(np.zeros((2, 4, 6), "float32"))
    for _ in range(2):  # applying twice changes nothing further
        mpx_tf.apply_policy(model, policy)
        assert model.head.compute_dtype == "float32"
        assert model.conv.compute_dtype == "bfloat16"
        assert model.encoder.compute_dtype == "bfloat16"
        assert model.encoder.proj.compute_dtype == "float32"
        assert model(np.zeros((2, 4, 6), "float32")).dtype == "float32"
    mpx_tf.apply_policy(model, "float32")
    assert {layer.compute_dtype for layer in _layers_by_path(model).values()} == {"float32"}


def test_output_dtype_and_nested_output_casts():
    """Only the outermost model casts its outputs; an inner model applied before loses its cast."""
    with mpx_tf.policy_scope("mixed_float16"):
        inner = keras.Sequential([keras.Input((3,)), L.Dense(4, name="d")], name="inner")
    mpx_tf.apply_policy(inner, "mixed_float16")
    assert inner(np.ones((1, 3), "float32")).dtype == "float32"
    with mpx_tf.policy_scope("mixed_float16"):
        outer = keras.Sequential([keras.Input((3,)), inner, L.Dense(2, name="out")], name="outer")
    mpx_tf.apply_policy(outer, "params=float32,compute=float16,output=float16")
    assert inner(np.ones((1, 3), "float32")).dtype == "float16"
    assert outer(np.ones((1, 3), "float32")).dtype == "float16"
    mpx_tf.apply_policy(outer, "mixed_float16")
    assert outer(np.ones((1, 3), "float32")).dtype == "float32"
    assert outer.compute_output_spec(keras.KerasTensor((1, 3))).dtype == "float32"
    # the outer model still nests symbolically, with the cast output dtype
    tensor = outer(keras.Input((3,)))
    assert tensor.dtype == "float32"


@pytest.mark.parametrize("spec, half", [("float16", "float16"), ("bfloat16", "bfloat16")])
def test_pure_half_policies(spec, half, tmp_path):
    """params=compute=half: norms compute in float32 over half variables, outputs in half."""
    with mpx_tf.policy_scope(spec):
        model = keras.Sequential([keras.Input((6,)), L.Dense(8, name="d"), L.LayerNormalization(name="ln")])
    mpx_tf.apply_policy(model, spec)
    ln = model.get_layer("ln")
    assert ln.dtype_policy.name == f"mpx:params={half},compute=float32,output=float32;autocast=on;model_output={half}"
    assert (ln.compute_dtype, ln.variable_dtype) == ("float32", half)
    assert all(w.dtype == half for w in model.weights)
    assert ln(tf.ones((2, 8), half)).dtype == "float32"
    assert model(np.ones((2, 6), "float32")).dtype == half
    path = tmp_path / "pure.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("ln").dtype_policy.name == ln.dtype_policy.name
    assert loaded.get_layer("ln").compute_dtype == "float32"
    assert all(w.dtype == half for w in loaded.weights)
    mpx_tf.apply_policy(loaded, spec)
    np.testing.assert_array_equal(loaded(np.ones((2, 6), "float32")), model(np.ones((2, 6), "float32")))


def test_apply_policy_refuses_to_convert_built_variables():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2, name="d")])  # float32 variables
    with pytest.raises(mpx.PolicyError, match="policy_scope"):
        mpx_tf.apply_policy(model, "bfloat16")
    mixed = mpx_tf.apply_policy(model, "mixed_bfloat16")  # float32 params: fine in place
    assert mixed.get_layer("d").compute_dtype == "bfloat16"


def test_apply_policy_default_is_global_policy():
    model = keras.Sequential([keras.Input((3,)), L.Dense(2, name="d"), L.Softmax(name="s")])
    with mpx_tf.policy_scope("mixed_float16"):
        mpx_tf.apply_policy(model)
    assert model.get_layer("d").compute_dtype == "float16"
    assert model.get_layer("s").compute_dtype == "float32"


class LossLayer(keras.layers.Layer):
    mpx_category = "loss"

    def call(self, x):
        return tf.reduce_mean(tf.square(x), axis=-1, keepdims=True)


def test_categories():
    assert category_of(L.Dense(2, activation="softmax")) is None
    assert category_of(L.Activation("relu")) is None
    assert category_of(L.Activation(keras.activations.log_softmax)) == "softmax"
    assert category_of(L.Normalization()) == "normalization"
    assert category_of(LossLayer()) == "loss"
    bad = LossLayer()
    bad.mpx_category = "attention"
    with pytest.raises(mpx.PolicyError, match="mpx_category"):
        category_of(bad)
    with mpx_tf.policy_scope("mixed_float16"):
        model = keras.Sequential([keras.Input((3,)), L.Dense(4), LossLayer(name="loss")])
    mpx_tf.apply_policy(model, "params=float32,compute=float16,output=float16,keep_fp32=normalization")
    assert model.get_layer("loss").compute_dtype == "float16"
    mpx_tf.apply_policy(model, "mixed_float16")
    assert model.get_layer("loss").compute_dtype == "float32"


def test_categories_are_the_core_table():
    """Parity with mpx.CATEGORY_CLASSES["keras"]: every class named there exists in this Keras and is
    categorised as the table says, by the core's rule; the one Keras-only rule is Activation(softmax)."""
    table = mpx.CATEGORY_CLASSES["keras"]
    for category, names in table.items():
        for name in names:
            cls = getattr(keras.layers, name)  # a name this Keras lacks would be a stale table
            assert mpx_tf.policy.CATEGORY_LAYERS[category].count(cls) == 1
            layer = cls.__new__(cls)  # the class decides; no constructor arguments needed
            assert category_of(layer) == mpx.category_of(layer, mpx_tf.policy.CATEGORY_LAYERS) == category
    assert mpx_tf.policy.CATEGORY_LAYERS == mpx.resolve_categories("keras", keras.layers)
    for activation in ("softmax", "log_softmax", keras.activations.softmax):
        layer = L.Activation(activation)
        assert mpx.category_of(layer, mpx_tf.policy.CATEGORY_LAYERS) is None and category_of(layer) == "softmax"
    # the mpx_category attribute wins over the class, as in every backend
    norm = L.LayerNormalization()
    norm.mpx_category = "loss"
    assert category_of(norm) == "loss"


def test_non_float_layers_are_left_alone():
    with mpx_tf.policy_scope("mixed_float16"):
        inputs = keras.Input((3,), dtype="int32")
        x = L.Embedding(10, 4, name="emb")(inputs)
        x = L.IntegerLookup(vocabulary=[1, 2], name="lookup", dtype="int64")(inputs)
        model = keras.Model(inputs, [L.Embedding(10, 4, name="emb2")(inputs), x])
    mpx_tf.apply_policy(model, "mixed_float16")
    assert model.get_layer("lookup").compute_dtype == "int64"
    emb, ids = model(np.array([[1, 2, 3]], "int32"))
    assert emb.dtype == "float32" and ids.dtype == "int64"


def test_apply_policy_before_build_creates_variables_in_param_dtype():
    model = Net()  # subclassed, not built: variables come later, from the applied policies
    mpx_tf.apply_policy(model, "bfloat16")
    out = model(np.zeros((2, 4, 6), "float32"))
    assert out.dtype == "bfloat16"
    assert {w.dtype for w in model.weights} == {"bfloat16"}
    assert (model.encoder.ln.compute_dtype, model.encoder.ln.variable_dtype) == ("float32", "bfloat16")
    assert model.head.compute_dtype == "bfloat16"


# -- op-table classes of single-op layers ------------------------------------------------
@pytest.mark.parametrize("spec", MIXED)
@pytest.mark.parametrize(
    "make, op",
    [
        (lambda: L.ReLU(), "relu"),
        (lambda: L.Activation("gelu"), "gelu"),
        (lambda: L.Reshape((2, 4)), "reshape"),
        (lambda: L.Dropout(0.5), "dropout"),
    ],
)
def test_passthrough_layers_keep_their_input_dtype(spec, make, op):
    layer = make()
    model = keras.Sequential([keras.Input((8,)), layer])
    mpx_tf.apply_policy(model, spec)
    assert mpx_tf.op_of(layer) == op
    compute = mpx.get_policy(spec).compute_dtype
    for dtype in ("float32", compute):
        assert layer(tf.ones((2, 8), dtype)).dtype == dtype
    natively = make()
    natively.dtype_policy = keras.DTypePolicy(spec)
    assert natively(tf.ones((2, 8), "float32")).dtype == compute  # Keras casts inputs down


@pytest.mark.parametrize("spec", MIXED)
@pytest.mark.parametrize("make", [L.Add, L.Multiply, L.Concatenate])
def test_promote_layers_take_the_widest_input(spec, make):
    compute = mpx.get_policy(spec).compute_dtype
    a, b = keras.Input((8,)), keras.Input((8,))
    layer = make()
    model = keras.Model([a, b], layer([a, b]))
    mpx_tf.apply_policy(model, spec)
    assert layer([tf.ones((2, 8), compute), tf.ones((2, 8), "float32")]).dtype == "float32"
    assert layer([tf.ones((2, 8), compute), tf.ones((2, 8), compute)]).dtype == compute
