"""keras-hub backbones under mpx_keras.apply_policy on this process's Keras backend (#24, item 5).

Bert, GPT2 and Llama backbones (keras-hub 0.32, tiny configs built from constructor arguments, random
weights, nothing downloaded) under ``"mixed_float16"`` and ``"mixed_bfloat16"``:

- the dtypes of the forward pass's ops, read from the backend (``_op_dtypes.record``: the jaxpr on jax, a
  ``TorchDispatchMode`` on torch, the traced graph on TensorFlow), with attention dropout on: every matmul
  (attention included) computes in the dtypes it computes in natively, under Keras's own policy of the same
  name; softmax and norms compute in float32; Llama's rotary embedding keeps its float32;
- with a small head, ``fit`` trains (``mpx_keras.LossScaleOptimizer`` for float16) and a batch whose loss
  overflows is skipped: weights and optimizer variables bit-identical;
- ``model.save`` / ``keras.models.load_model`` keep every layer's dtype policy and autocast flag, and the
  loaded model computes its ops in the same dtypes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import keras
import numpy as np
import pytest

import mpx
import mpx_keras
from mpx_keras._compat import child_layers
from mpx_keras.dtype_policy import policy_of

keras_hub = pytest.importorskip("keras_hub")

_spec = importlib.util.spec_from_file_location("_op_dtypes", Path(__file__).with_name("_op_dtypes.py"))
op_dtypes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(op_dtypes)

AUTOCAST = importlib.import_module("mpx_keras.autocast")  # the module (mpx_keras.autocast is its scope)
BACKEND = keras.config.backend()
POLICIES = ["mixed_float16", "mixed_bfloat16"]
SEQ, VOCAB = 8, 50


def bert(layers: int = 2):
    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1,
    )  # fmt: skip


def gpt2(layers: int = 2):
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.1,
    )  # fmt: skip


def llama(layers: int = 2):
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=layers, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32, dropout=0.1,
    )  # fmt: skip


MODELS = {"bert": bert, "gpt2": gpt2, "llama": llama}


def inputs(name: str, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(1, VOCAB, (batch, SEQ)).astype("int32"),
        "padding_mask": np.ones((batch, SEQ), "int32"),
    }
    if name == "bert":
        x["segment_ids"] = np.zeros((batch, SEQ), "int32")
    return x


def native(name: str, policy: str) -> keras.Model:
    """The backbone under Keras's own dtype policy of that name (mpx applies nothing)."""
    keras.config.set_dtype_policy(policy)
    try:
        return MODELS[name]()
    finally:
        keras.config.set_dtype_policy("float32")


def under_mpx(name: str, policy: str) -> keras.Model:
    with mpx_keras.policy_scope(policy):
        model = MODELS[name]()
    return mpx_keras.apply_policy(model, policy)


def trace(model: keras.Model, x: dict[str, np.ndarray]) -> list[op_dtypes.Op]:
    """The op dtypes of ``model(x, training=True)`` (attention dropout on)."""
    if BACKEND == "jax":
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def forward(t, n, x):
            return model.stateless_call(t, n, x, training=True)[0]

        return op_dtypes.record(forward, trainable, non_trainable, x)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return op_dtypes.record(
            lambda x: model(x, training=True), {k: tf.TensorSpec(v.shape, v.dtype) for k, v in x.items()}
        )
    return op_dtypes.record(lambda x: model(x, training=True), x)


# -- op dtypes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(MODELS))
def test_op_dtypes_as_natively_with_softmax_and_norms_in_float32(name, policy):
    half = mpx.get_policy(policy).compute_dtype
    x = inputs(name)
    ops, reference = trace(under_mpx(name, policy), x), trace(native(name, policy), x)
    matmuls = op_dtypes.dtypes_of(ops, "matmul") + op_dtypes.dtypes_of(ops, "attention")
    # every matmul (projections, query x key, scores x values, fused attention) as natively
    assert op_dtypes.dtypes_of(ops, "matmul") == op_dtypes.dtypes_of(reference, "matmul")
    assert op_dtypes.dtypes_of(ops, "attention") == op_dtypes.dtypes_of(reference, "attention")
    assert matmuls.count((half, half)) >= 2 * 4  # per layer: 3 projections + the output projection, at least
    softmax = op_dtypes.dtypes_of(ops, "softmax")
    assert set(softmax) <= {("float32",)}  # the policy's softmax category (natively in half, jax/TF)
    if name != "llama" or BACKEND != "torch":  # torch: Llama's attention is one fused kernel
        assert len(softmax) == 2
    norms = op_dtypes.dtypes_of(ops, "rsqrt") + [d[:1] for d in op_dtypes.dtypes_of(ops, "layer_norm")]
    assert len(norms) == 2 * 2 + 1 and set(norms) == {("float32",)}  # two per layer and the final one
    if name == "llama":  # the rotary embedding: its authors' float32 (queries and keys, per layer)
        rotary = op_dtypes.dtypes_of(ops, "sin") + op_dtypes.dtypes_of(ops, "cos")
        assert rotary == op_dtypes.dtypes_of(reference, "sin") + op_dtypes.dtypes_of(reference, "cos")
        assert rotary == [("float32",)] * len(rotary) and len(rotary) >= 4


def test_gpt2_attention_scores_times_values_in_half_with_dropout_on():
    """Keras's MultiHeadAttention runs its own softmax and dropout layers, then einsums their output with
    the values: mpx computes the softmax in float32 and hands the probabilities back in the attention
    layer's compute dtype, so the einsum computes in half as natively (not promoted to float32)."""
    model = under_mpx("gpt2", "mixed_float16")
    attention = model.get_layer("transformer_layer_0")._self_attention_layer
    assert attention._softmax.compute_dtype == "float32"
    assert attention._softmax.dtype_policy.name.endswith(";output=float16")
    assert attention._dropout_layer.autocast is True  # Keras's own: the op table is the user's code's
    matmuls = op_dtypes.dtypes_of(trace(model, inputs("gpt2")), "matmul")
    # per layer: 3 projections, query x key, scores x values, the output projection in half; the
    # feed-forward Dense layers' 2 too, except on torch (Keras's torch backend computes a float16 Dense
    # in float32 on CPU, natively as well)
    per_layer = 6 if BACKEND == "torch" else 8
    assert matmuls.count(("float16", "float16")) == 2 * per_layer
    assert all(len(set(dtypes)) == 1 for dtypes in matmuls)  # no half x float32 matmul


def test_gpt2_without_dropout_as_natively():
    """Without attention dropout Keras's attention takes its fused path (``ops.dot_product_attention``)."""

    def build(layers: int = 2):
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=layers, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=SEQ, dropout=0.0,
        )  # fmt: skip

    with mpx_keras.policy_scope("mixed_float16"):
        model = build()
    mpx_keras.apply_policy(model, "mixed_float16")
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reference = build()
    finally:
        keras.config.set_dtype_policy("float32")
    x = inputs("gpt2")
    ops, native_ops = trace(model, x), trace(reference, x)
    for kind in ("matmul", "attention"):
        assert op_dtypes.dtypes_of(ops, kind) == op_dtypes.dtypes_of(native_ops, kind), kind
    assert ("float16", "float16") in op_dtypes.dtypes_of(ops, "matmul") + op_dtypes.dtypes_of(
        ops, "attention"
    )


# -- the op table: the user's code, not keras-hub's -------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_users_autocast_scope_changes_nothing_inside_a_backbone(name):
    """keras-hub's ops are library code: an ``mpx_keras.autocast`` scope around the call retypes none of
    them (Llama's float32 rotary einsums and sin/cos stay float32, GPT2's attention stays in half)."""
    model, x = under_mpx(name, "mixed_float16"), inputs(name)
    plain = trace(model, x)
    with mpx_keras.autocast("mixed_float16"):
        scoped = trace(model, x)
    assert scoped == plain
    assert AUTOCAST.holds() == 0  # the op table's dispatch removed on exit


def test_the_users_own_ops_around_a_backbone_still_follow_the_table():
    model, x = under_mpx("gpt2", "mixed_float16"), inputs("gpt2")
    seen = {}

    def head(x):
        h = keras.ops.cast(model(x), "float16")  # the backbone's output: float32, the policy's output dtype
        logits = keras.ops.matmul(h, keras.ops.ones((16, 3), "float16"))
        probs = keras.ops.softmax(logits)
        seen.update(matmul=keras.backend.standardize_dtype(logits.dtype))
        seen.update(softmax=keras.backend.standardize_dtype(probs.dtype))
        return probs

    with mpx_keras.autocast("mixed_float16"):
        head(x)
    assert seen == {"matmul": "float16", "softmax": "float32"}
    assert AUTOCAST.holds() == 0


class UserBlock(keras.layers.Layer):
    """The user's own layer (defined in a test file: user code) with a norm and a dropout inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.drop = keras.layers.Dropout(0.1)

    def call(self, x):
        return self.drop(self.norm(x))


def test_only_a_library_layers_own_sublayers_are_left_to_keras():
    """Keras's MultiHeadAttention is a library layer: its dropout keeps Keras's autocast and its float32
    softmax hands back half.  The user's own layer's sublayers follow the op table's flags as before
    (dropout keeps its input dtype) and the norm's float32 output is not cast back."""
    with mpx_keras.policy_scope("mixed_float16"):
        x = keras.Input((4, 8))
        block = UserBlock()
        attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
        model = keras.Model(x, attention(block(x), block(x)))
    mpx_keras.apply_policy(model, "mixed_float16")
    assert attention._dropout_layer.autocast is True
    assert attention._softmax.dtype_policy.name.endswith(";autocast=on;output=float16")
    assert block.drop.autocast is False and block.drop.dtype_policy.name.endswith(";autocast=off")
    assert block.norm.dtype_policy.name.endswith(";autocast=on")  # float32 out, as mpx's norms compute
    y = block(np.ones((2, 4, 8), "float16"))
    assert keras.backend.standardize_dtype(y.dtype) == "float32"


# -- fit, an overflow skipped -----------------------------------------------------------------------------
def classifier(name: str, policy: str, layers: int = 2) -> keras.Model:
    """The backbone with a pooled Dense(1) head, created under the policy and given it by apply_policy."""
    with mpx_keras.policy_scope(policy):
        backbone = MODELS[name](layers)
        h = backbone(backbone.input)
        # Bert's pooled output (its pooler trains too); the others' sequence output, averaged
        h = h["pooled_output"] if name == "bert" else keras.layers.GlobalAveragePooling1D(name="pool")(h)
        out = keras.layers.Dense(1, name="head")(h)
        model = keras.Model(backbone.input, out)
    return mpx_keras.apply_policy(model, policy)


def host(variables) -> list[np.ndarray]:
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]


def assert_bit_identical(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


#: One fit per model (compiling a train step takes ~10-20 s on a loaded CPU), both policies covered; the op
#: dtypes above are checked under both for every model.  Not Llama under float16 on jax: XLA's CPU
#: dot_general has no float16 x float16 -> float32, which its jitted train step asks for (Keras's own
#: mixed_float16 fails the same way there).
FIT = [("bert", "mixed_float16"), ("gpt2", "mixed_float16"), ("llama", "mixed_bfloat16")]


@pytest.mark.parametrize("name, policy", FIT)
def test_fit_trains_and_an_overflowing_batch_is_skipped(name, policy):
    model = classifier(name, policy, layers=1)  # one layer: compiling the train step is most of the time
    config = mpx.ScalerConfig(init_scale=2.0**6)  # GPT2's first float16 step overflows at 2**10, natively too
    optimizer = mpx_keras.LossScaleOptimizer(keras.optimizers.Adam(1e-3), config)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = inputs(name, batch=4), np.linspace(-1, 1, 4, dtype="float32")[:, None]
    before = host(model.trainable_weights)
    history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    unchanged = [
        w.path for w, a, b in zip(model.trainable_weights, host(model.trainable_weights), before, strict=True)
        if a.tobytes() == b.tobytes()
    ]  # fmt: skip
    assert all(path.endswith("reverse_embeddings") for path in unchanged)  # Llama's LM-head matrix: unused
    assert optimizer.state.steps == 2 and optimizer.state.skipped_steps == 0
    weights, inner = host(model.weights), host(optimizer.inner_optimizer.variables)
    model.fit(x, np.full_like(y, np.inf), batch_size=2, steps_per_epoch=1, verbose=0)  # overflows: skipped
    assert_bit_identical(host(model.weights), weights)
    assert_bit_identical(host(optimizer.inner_optimizer.variables), inner)
    assert optimizer.state.skipped_steps == 1 and optimizer.get_scale() == 2.0**5


# -- save and load ------------------------------------------------------------------------------------------
def layer_policies(model: keras.Model) -> list[tuple[str, str, bool]]:
    """(path, dtype policy name, autocast) of every layer under ``model`` but its input layers (mpx gives
    those none, and Keras saves only their dtype), parents first; a layer holding its backbone's
    ``DTypePolicyMap`` has its entry's name.  The path joins the layer names without
    Keras's numbering (``softmax_3`` -> ``softmax``), which differs from one build to the next."""
    found, stack = [], [("", model)]
    while stack:
        path, layer = stack.pop()
        if not isinstance(layer, keras.layers.InputLayer):
            found.append((path, policy_of(layer).name, layer.autocast))
        for child in reversed(child_layers(layer)):
            stack.append((f"{path}/{re.sub(r'_[0-9]+$', '', child.name)}", child))
    return found


def saved_and_loaded(name: str, policy: str, tmp_path: Path) -> tuple[keras.Model, keras.Model]:
    model = classifier(name, policy, layers=1)
    path = tmp_path / f"{name}-{policy}.keras"
    model.save(path)
    return model, keras.models.load_model(path)


@pytest.mark.parametrize("name, policy", FIT)
def test_save_and_load_keep_the_policy_outside_a_backbone_and_apply_policy_restores_the_rest(
    name, policy, tmp_path
):
    model, loaded = saved_and_loaded(name, policy, tmp_path)
    backbone = next(layer for layer in model.layers if isinstance(layer, keras_hub.models.Backbone))
    prefix = "/" + re.sub(r"_[0-9]+$", "", backbone.name) + "/"
    here = layer_policies(model)
    outside = [entry for entry in here[1:] if not entry[0].startswith(prefix)]  # [0]: the model
    assert outside == [entry for entry in layer_policies(loaded)[1:] if not entry[0].startswith(prefix)]
    assert len(outside) >= 2, outside  # the backbone itself, the head
    mpx_keras.apply_policy(loaded, policy)  # what keras-hub's own config does not save (see below)
    assert layer_policies(loaded) == here
    x = inputs(name)
    assert trace(loaded, x) == trace(model, x)
    assert np.array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))


@pytest.mark.parametrize("name, policy", FIT)
def test_save_and_load_keep_every_layer_policy_inside_a_backbone(name, policy, tmp_path):
    """The backbone saves its layers' policies as its DTypePolicyMap: the loaded model, without
    apply_policy, computes every op in the same dtype and every layer has its policy and autocast flag
    (a layer without weights, which Keras never builds and gives no path, takes its entry at its first
    call).  One exception: a layer keras-hub builds with its own explicit dtype (Llama's float32
    ``attention_softmax``) gets that dtype back, not the map: it computes in float32 as before and hands
    its output to Llama's code, which casts it to the compute dtype itself (the same op dtypes)."""
    model, loaded = saved_and_loaded(name, policy, tmp_path)
    backbone = next(layer for layer in loaded.layers if isinstance(layer, keras_hub.models.Backbone))
    assert isinstance(backbone.dtype_policy, keras.dtype_policies.DTypePolicyMap)
    x = inputs(name)
    assert trace(loaded, x) == trace(model, x)
    assert np.array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))
    # [0]: the model, whose own dtype Keras does not save for a functional model (its output layers'
    # policies carry its output dtype); every layer under it, the backbone's included
    here, there = layer_policies(model)[1:], layer_policies(loaded)[1:]
    explicit = [i for i, (path, *_) in enumerate(here) if path.endswith("/attention_softmax")]
    assert len(explicit) == (1 if name == "llama" else 0)
    for i in explicit:
        assert (
            there[i] == (here[i][0], "float32", True) and mpx.get_policy(policy).compute_dtype in here[i][1]
        )
    assert [e for i, e in enumerate(there) if i not in explicit] == [
        e for i, e in enumerate(here) if i not in explicit
    ]


def test_a_dtype_policy_map_is_read_by_layer_path():
    default = keras.DTypePolicy(mpx_keras.dtype_policy.mpx_name("mixed_float16"))
    norm = keras.DTypePolicy(mpx_keras.dtype_policy.mpx_name("float32", autocast=True, output="float16"))
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=default, policy_map={"block/norm": norm})
    choices_of = mpx_keras.dtype_policy.choices_of
    assert choices_of(policy_map, "block/norm") == (mpx.get_policy("float32"), True, "float16", None)
    assert choices_of(policy_map, "block/dense").policy == mpx.get_policy("mixed_float16")
    assert choices_of(policy_map).policy == mpx.get_policy("mixed_float16")  # no path: the default
    restored = keras.dtype_policies.deserialize(keras.dtype_policies.serialize(policy_map))
    assert choices_of(restored, "block/norm") == choices_of(policy_map, "block/norm")
    assert choices_of(keras.dtype_policies.DTypePolicyMap(default_policy="float32"), "block/norm") is None


def test_only_a_keras_hub_backbone_gets_a_map():
    with mpx_keras.policy_scope("mixed_float16"):
        x = keras.Input((4,))
        model = keras.Model(x, keras.layers.LayerNormalization()(keras.layers.Dense(4)(x)))
    mpx_keras.apply_policy(model, "mixed_float16")
    assert not any(
        isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap) for layer in all_layers(model)
    )


LOAD_ON = r"""
import json, re, sys, numpy as np, keras, keras_hub, mpx_keras
from mpx_keras._compat import child_layers
from mpx_keras.dtype_policy import policy_of
model = keras.models.load_model(sys.argv[1] if len(sys.argv) > 1 else {path!r})
x = {{k: np.asarray(v, "int32") for k, v in json.loads({x!r}).items()}}
out = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
found, stack = [], [("", model)]
while stack:
    path, layer = stack.pop()
    if not isinstance(layer, keras.layers.InputLayer):
        found.append((path, policy_of(layer).name, layer.autocast))
    for child in reversed(child_layers(layer)):
        stack.append((f"{{path}}/{{re.sub(r'_[0-9]+$', '', child.name)}}", child))
print(json.dumps({{"policies": found[1:], "out": out.tolist()}}))
"""


def test_a_backbone_saved_here_loads_on_every_backend_with_every_layer_policy(tmp_path, python_on):
    """GPT2 under mixed_float16 saved on this backend, loaded in a fresh process on each other backend:
    after one call, every layer under the model has the saved policy and autocast flag (see above; the
    test above loads it on this backend)."""
    model, _ = saved_and_loaded("gpt2", "mixed_float16", tmp_path)
    x = inputs("gpt2")
    here = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
    expected = [list(entry) for entry in layer_policies(model)[1:]]
    code = LOAD_ON.format(
        path=str(tmp_path / "gpt2-mixed_float16.keras"), x=json.dumps({k: v.tolist() for k, v in x.items()})
    )
    for backend in [b for b in ("tensorflow", "jax", "torch") if b != keras.config.backend()]:
        proc = python_on(code, backend)
        assert proc.returncode == 0, (backend, proc.stderr[-3000:])
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["policies"] == expected, backend
        np.testing.assert_allclose(np.asarray(got["out"]), here, rtol=2e-2, atol=2e-2)


def all_layers(root: keras.layers.Layer) -> list[keras.layers.Layer]:
    """``root`` and every layer under it."""
    found, stack = [], [root]
    while stack:
        found.append(stack.pop())
        stack.extend(child_layers(found[-1]))
    return found


def test_a_quantized_backbone_keeps_its_int8_layers_and_the_mpx_policies_through_save_and_load(tmp_path):
    """keras-hub's own use of the map: int8 layers (``backbone.quantize``) keep Keras's quantized policy
    under apply_policy, and the map holds both kinds of entries through save and load."""
    with mpx_keras.policy_scope("mixed_bfloat16"):
        backbone = gpt2(layers=1)
    backbone.quantize("int8")
    quantized = sorted(layer.path for layer in all_layers(backbone) if layer.quantization_mode)
    assert quantized  # the Dense/EinsumDense projections and the embedding
    mpx_keras.apply_policy(backbone, "mixed_bfloat16")

    def policies(model):
        return {layer.path: policy_of(layer).name for layer in all_layers(model) if layer.path}

    here = policies(backbone)
    assert {path for path, name in here.items() if name == "int8_from_mixed_bfloat16"} == set(quantized)
    assert here["transformer_layer_0/self_attention_layer_norm"].startswith(
        "mpx:params=float32,compute=float32"
    )
    backbone.save(tmp_path / "gpt2-int8.keras")
    loaded = keras.models.load_model(tmp_path / "gpt2-int8.keras")
    assert policies(loaded) == here
    x = inputs("gpt2")
    assert np.array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(backbone(x)))
