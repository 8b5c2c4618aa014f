"""mpx_jax.autocast on keras-hub 0.32's Llama (KERAS_BACKEND=jax, a tiny config, random weights) keeps the
authors' float32 (#25 item 0): the rotary embedding's positions einsum and SiLU's logistic run in float32,
the error against float32 is no worse than native Keras ``mixed_bfloat16``'s, and the rotary error at
2048 positions is within 2x native's.

Keras and keras-hub (which imports TensorFlow) run in a subprocess with ``KERAS_BACKEND=jax`` set before
keras is imported, so the jax suite's process loads neither.  Run this file as a script to print the
figures: ``KERAS_BACKEND=jax python tests/jax/test_keras_hub_jax.py``.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

#: a hang guard only: the worker takes about 40 s on a quiet 2-core machine
TIMEOUT_S = 1800


def measure() -> dict:
    """The figures, in a process whose keras backend is jax (called by the worker)."""
    import jax
    import keras
    import keras_hub
    import numpy as np

    import mpx_jax

    out: dict = {"keras": keras.__version__, "keras_hub": keras_hub.__version__}
    # the rotary embedding alone, at 2048 positions, on an input rounded to the compute dtype as a
    # lowered projection would give it
    x = np.random.default_rng(0).standard_normal((1, 2048, 4, 64)).astype("float32")
    rope = keras_hub.layers.RotaryEmbedding(max_wavelength=10000)
    ref = np.asarray(rope(x))
    for half in ("bfloat16", "float16"):
        policy = f"mixed_{half}"
        native = keras_hub.layers.RotaryEmbedding(max_wavelength=10000, dtype=policy)
        out[f"rotary native {policy}"] = float(np.abs(np.asarray(native(x), np.float32) - ref).max())
        mixed = jax.jit(mpx_jax.autocast(lambda a: rope(a), policy))(x.astype(half))
        out[f"rotary mpx {policy}"] = float(np.abs(np.asarray(mixed, np.float32) - ref).max())

    # the whole backbone through stateless_call
    cfg = dict(
        vocabulary_size=128,
        num_layers=2,
        num_query_heads=4,
        hidden_dim=64,
        intermediate_dim=128,
        num_key_value_heads=2,
    )
    keras.utils.set_random_seed(0)
    model = keras_hub.models.LlamaBackbone(**cfg)
    native = keras_hub.models.LlamaBackbone(**cfg, dtype="mixed_bfloat16")
    native.set_weights(model.get_weights())
    rng = np.random.default_rng(1)
    seq = 512
    inputs = {
        "token_ids": rng.integers(0, 128, (2, seq)).astype("int32"),
        "padding_mask": np.ones((2, seq), "int32"),
    }
    ref = np.asarray(model(inputs))
    out["llama native mixed_bfloat16"] = float(np.abs(np.asarray(native(inputs), np.float32) - ref).max())
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def call(tv, ntv, x):
        return model.stateless_call(tv, ntv, x)[0]

    for policy in ("mixed_bfloat16", "mixed_float16"):
        mixed = jax.jit(mpx_jax.autocast(call, policy))(trainable, non_trainable, inputs)
        out[f"llama mpx {policy} dtype"] = str(mixed.dtype)
        out[f"llama mpx {policy}"] = float(np.abs(np.asarray(mixed, np.float32) - ref).max())

    # the dtypes of the transformed program's equations
    dots, logistic = [], []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            dt = [str(v.aval.dtype) for v in e.invars]
            if e.primitive.name == "dot_general":
                dots.append(dt)
            elif e.primitive.name == "logistic":
                logistic.append(dt)
            for p in e.params.values():
                for q in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(q, "jaxpr", q)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(mpx_jax.autocast(call, "mixed_bfloat16"))(trainable, non_trainable, inputs).jaxpr)
    out["dot_general operand dtypes"] = sorted({",".join(d) for d in dots})
    out["dot_general float32"] = sum(1 for d in dots if d == ["float32", "float32"])
    out["dot_general bfloat16"] = sum(1 for d in dots if d == ["bfloat16", "bfloat16"])
    out["logistic input dtypes"] = sorted({",".join(d) for d in logistic})
    out["layers"] = cfg["num_layers"]
    return out


@pytest.fixture(scope="module")
def figures():
    if importlib.util.find_spec("keras_hub") is None or importlib.util.find_spec("keras") is None:
        pytest.skip("keras-hub is not installed")
    env = dict(os.environ, KERAS_BACKEND="jax", MPX_NO_SLOW_WARNING="1", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_rotary_error_at_2048_positions_within_twice_native(figures):
    for policy in ("mixed_bfloat16", "mixed_float16"):
        assert figures[f"rotary mpx {policy}"] <= 2 * figures[f"rotary native {policy}"], figures


def test_llama_error_no_worse_than_native_mixed_bfloat16(figures):
    assert figures["llama mpx mixed_bfloat16 dtype"] == "float32"
    assert figures["llama mpx mixed_bfloat16"] <= figures["llama native mixed_bfloat16"], figures
    # native Keras mixed_float16 cannot run Llama on XLA:CPU (F16_F16_F32 dot_general); mpx does
    assert figures["llama mpx mixed_float16"] <= figures["llama native mixed_bfloat16"], figures


def test_rotary_einsum_and_silu_stay_float32_the_projections_lower(figures):
    layers = figures["layers"]
    # per layer: the rotary einsum for the queries and for the keys in float32; 7 projections and
    # 2 attention products lowered
    assert figures["dot_general float32"] == 2 * layers, figures
    assert figures["dot_general bfloat16"] == 9 * layers, figures
    assert figures["dot_general operand dtypes"] == ["bfloat16,bfloat16", "float32,float32"], figures
    assert figures["logistic input dtypes"] == ["float32"], figures


if __name__ == "__main__":
    if os.environ.get("KERAS_BACKEND") != "jax":
        sys.exit("run with KERAS_BACKEND=jax")
    print(json.dumps(measure()))
