"""The ``models`` group in every column (issue 33, item 3): keras-hub backbones in tf, keras-jax and keras-torch,
a Flax NNX GPT, a linen ResNet and keras-hub's GPT-2 through mpx_jax.autocast in jax.

Each column is checked on a subset (one model per column: GPT-2 on Keras, the NNX GPT on JAX, and
keras-hub's GPT-2 in the jax column; ``mpx conformance --only models`` runs every model): the tf and jax
columns' rows come from the session's full run (conftest's ``data``), keras-jax and keras-torch run theirs
through the runner, in their own worker processes; this process imports no framework.  Under mpx every
case passes or is skipped for a stated reason; natively the divergences found so far are detected and
explained by one finding each.
"""

from __future__ import annotations

import pytest

import mpx
from conformance import cases as C
from conformance.runner import run, select
from mpx_tools import models as M
from mpx_tools.skip import Skip
from mpx_tools.workers import BACKENDS, is_installed

#: column -> the models it runs here (the subset)
SUBSET = {"tf": "gpt2", "keras-jax": "gpt2", "keras-torch": "gpt2", "jax": "nnx_gpt"}
#: the runs of this module: (column, model), the subset and keras-hub's GPT-2 through mpx_jax.autocast in jax
RUNS = [*SUBSET.items(), ("jax", "keras_gpt2")]
#: (column, case) -> what the case's skip says: what the column cannot measure, natively and under mpx
SKIPS = {
    ("tf", "models.gpt2.activations"): "TensorFlow has no public figure",
}
#: the native divergences of the subset: Keras's policies compute the attention softmax in half; Flax NNX's
#: attention (jax.nn.dot_product_attention, softmax in float32) asks XLA:CPU for a float16 x float16 ->
#: float32 dot it cannot compile, so natively the float16 run raises
NATIVE_DIVERGENCES = {"gpt2": ["models.gpt2.ops"], "nnx_gpt": ["models.nnx_gpt.overflow"],
                      "keras_gpt2": ["models.keras_gpt2.ops", "models.keras_gpt2.overflow"]}  # fmt: skip


@pytest.fixture(scope="module", params=RUNS, ids=[f"{b}-{m}" if m == "keras_gpt2" else b for b, m in RUNS])
def column(request, tmp_path_factory):
    backend, name = request.param
    if not is_installed(backend):
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    if backend in request.getfixturevalue("full_columns"):  # the session's full run has every case of these
        return backend, name, select(request.getfixturevalue("data"), backend, f"models.{name}.")
    out = tmp_path_factory.mktemp(f"models-{backend}-{name}")
    return backend, name, run([backend], out, only=f"models.{name}.", quiet=True)


def _rows(data: dict, backend: str, mode: str) -> dict[str, dict]:
    return {r["case"]: r for r in data["results"] if r["backend"] == backend and r["mode"] == mode}


def test_every_case_passes_under_mpx_or_says_why_not(column):
    backend, name, data = column
    rows = _rows(data, backend, "mpx")
    assert sorted(rows) == sorted(f"models.{name}.{a}" for a in M.ASPECTS)
    for case, r in rows.items():
        if (backend, case) in SKIPS:
            assert r["status"] == "skip" and SKIPS[backend, case] in r["detail"], r
        else:
            assert r["status"] == "pass", (case, r["detail"])
    assert not [r for r in data["results"] if r["case"] == "worker"]


def test_what_mpx_observes(column):
    """The op dtypes, the core's scale trace with the overflowing step skipped bit-identically, the logits'
    error and the bytes kept for backward, as observed under mpx."""
    backend, name, data = column
    rows = _rows(data, backend, "mpx")
    ops = rows[f"models.{name}.ops"]["observed"]
    norm = "layer_norm"
    assert ops["computed"]["softmax"] == {"float32": 1} and set(ops["computed"][norm]) == {"float32"}
    assert (
        ops["half"] == ["matmul"] and ops["computed"]["matmul"].get(M.POLICY.removeprefix("mixed_"), 0) >= 8
    )
    overflow = rows[f"models.{name}.overflow"]["observed"]
    config = mpx.ScalerConfig(**M.OVERFLOW_CONFIG)
    assert overflow["scales"] == C._trace(config, list(M.OVERFLOW_FLAGS)) and overflow["skipped"] == [2]
    logits = rows[f"models.{name}.logits"]["observed"]
    assert 0 < logits["max_abs_error"] <= M.LOGITS_TOL * logits["max_abs_float32"]
    if (backend, f"models.{name}.compile") not in SKIPS:
        compiled = rows[f"models.{name}.compile"]["observed"]
        assert compiled["graphs"] == 1 and compiled["recompiles"] == 0 and compiled["calls_agree"] is True
        if backend == "keras-torch":  # its first block, in one dynamo graph, as eager mpx computes it
            assert compiled["breaks"] == 0 and compiled["equals_eager"] is True
            assert compiled["compiled"] == "transformer_layer_0" and "is_not" in compiled["why_a_block"]
    if (backend, f"models.{name}.activations") not in SKIPS:
        kept = rows[f"models.{name}.activations"]["observed"]
        assert kept["bound"] == "1 x float32" and 0 < kept["bytes"] <= kept["float32_bytes"]
        assert kept["native_bytes"] < kept["float32_bytes"]


def test_native_runs_are_mpx_free_and_their_divergences_explained(column):
    backend, name, data = column
    assert data["backends"][backend]["mpx_free"] is True
    native = _rows(data, backend, "native")
    divergences = sorted(c for c, r in native.items() if r["status"] == "differs")
    assert divergences == NATIVE_DIVERGENCES[name], divergences
    if name == "nnx_gpt":
        assert "F16_F16_F32" in native["models.nnx_gpt.overflow"]["detail"]
        assert native["models.nnx_gpt.ops"]["observed"]["violations"] == []  # softmax in float32 natively too
    elif name == "keras_gpt2":  # Keras's mixed policy on jax, loss-scaled natively with Flax's DynamicScale
        assert native["models.keras_gpt2.ops"]["observed"]["violations"] == ["softmax"]
        overflow = native["models.keras_gpt2.overflow"]["observed"]
        assert overflow["skipped"] == [2] and overflow["unchanged_on_skip"] is True
        assert overflow["scales"] != C._trace(mpx.ScalerConfig(**M.OVERFLOW_CONFIG), list(M.OVERFLOW_FLAGS))
    else:
        assert native["models.gpt2.ops"]["observed"]["violations"] == ["softmax"]
        assert native["models.gpt2.overflow"]["status"] == "pass"  # Keras's LossScaleOptimizer
    from conformance import findings as F

    found = [f for f in F.findings(data) if f["backend"] == backend]
    assert sorted(c for f in found for c in f["cases"]) == divergences
    for f in found:
        assert "unexplained" not in f["topic"] and not f["topic"].startswith("other"), f
    if name == "keras_gpt2":  # the softmax finding names Keras's policy, not Flax's dtype argument
        ops = next(f for f in found if f["cases"] == ["models.keras_gpt2.ops"])
        assert ops["title"].startswith("Keras's mixed policy on JAX") and "softmax" in ops["title"], ops


def test_every_model_and_aspect_is_a_case_and_each_column_skips_what_it_does_not_run():
    cases = [c for c in C.all_cases() if c["group"] == "models"]
    assert [c["id"] for c in cases] == [f"models.{m}.{a}" for m in M.MODELS for a in M.ASPECTS]
    assert set(M.COLUMNS) == set(M.MODELS)
    assert {col for runs in M.COLUMNS.values() for col in runs} == set(BACKENDS)
    for model, runs in M.COLUMNS.items():
        for backend in BACKENDS:
            if backend in runs:
                M.check_column(backend, model)
            else:
                with pytest.raises(Skip, match=f"{model} is not in the {backend} column's models"):
                    M.check_column(backend, model)
    with pytest.raises(KeyError, match="no model 'gpt3'"):
        M.check_column("torch", "gpt3")


def test_the_activations_bound_is_native_autocasts_on_torch_and_float32s_elsewhere():
    torch = M.activation_verdict("torch", 104, 100, 200)
    assert torch["within_ratio"] is True and torch["bound"] == "1.05 x native"
    assert M.activation_verdict("torch", 106, 100, 200)["within_ratio"] is False
    keras = M.activation_verdict("keras-jax", 120, 100, 130)
    assert (
        keras["within_ratio"] is True and keras["ratio_to_native"] == 1.2 and keras["bound"] == "1 x float32"
    )
    assert M.activation_verdict("jax", 131, 100, 130)["within_ratio"] is False
