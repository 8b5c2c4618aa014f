"""``mpx compare``: a tiny configuration on every installed backend writes the documented files.

Every framework runs in a subprocess; this process imports none.  No accuracy is asserted here (the
digits accuracy check is tests/torch/test_compare_accuracy.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpx_compare.engine import summarize

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = [b for b, m in {"torch": "torch", "tf": "tensorflow", "jax": "jax"}.items()
             if importlib.util.find_spec(m) is not None]  # fmt: skip
HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None


def _mpx(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    # the bound only catches a hang: a loaded machine must not fail a test
    return subprocess.run([sys.executable, "-m", "mpx", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.skipif(not INSTALLED or not HAS_SKLEARN, reason="needs a framework and scikit-learn")
def test_compare_tiny_writes_reports(tmp_path):
    proc = _mpx("compare", "--seeds", "2", "--epochs", "1", "--max-steps", "3", "--policy", "mixed_bfloat16",
                "--policy", "mixed_float16", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["format"] == "mpx.compare/1"
    assert data["settings"]["policies"] == ["mixed_bfloat16", "mixed_float16"]
    assert set(data["backends"]) == {"torch", "tf", "jax"}
    for backend in INSTALLED:
        assert data["backends"][backend]["status"] == "ok", data["backends"][backend]
        runs = [r for r in data["runs"] if r["backend"] == backend]
        assert sorted((r["policy"], r["seed"]) for r in runs) == sorted(
            (p, s) for p in ("float32", "mixed_bfloat16", "mixed_float16") for s in (0, 1)
        )
        for r in runs:
            assert r["steps"] == 3 and len(r["losses"]) == 3 and len(r["scales"]) == 3
            assert 0.0 <= r["val_accuracy"] <= 1.0
            want = 65536.0 if r["policy"] == "mixed_float16" else 1.0
            assert r["scales"] == [want] * 3 and r["final_scale"] == want and r["skipped_steps"] == 0
        rows = {s["policy"]: s for s in data["summary"] if s["backend"] == backend}
        assert rows["float32"]["delta_points"] is None and rows["float32"]["passed"] is None
        assert rows["mixed_bfloat16"]["delta_points"]["n"] == 2
        assert isinstance(rows["mixed_float16"]["passed"], bool)
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "compare.md").read_text()
    assert "| backend | policy |" in md and "compare.png" in md
    assert "mixed_float16" in proc.stdout
    assert (proc.returncode == 1) == any(s["passed"] is False for s in data["summary"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "rnn"], "--model: unknown model 'rnn'"),
        (["--backend", "mxnet"], "unknown backend 'mxnet'"),
        (["--dataset", "mnist"], "--dataset: unknown dataset 'mnist'"),
        (["--seeds", "0"], "--seeds: must be at least 1"),
        (["--epochs", "x"], "--epochs: expected an integer"),
        (["--policy", "fp17"], "fp17"),
    ],
)
def test_compare_usage_errors_exit_2(args, message):
    proc = _mpx("compare", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _run(policy, seed, acc, scale=1.0, skipped=0):
    return {"backend": "torch", "policy": policy, "seed": seed, "val_accuracy": acc, "val_loss": 1.0 - acc,
            "final_scale": scale, "skipped_steps": skipped}  # fmt: skip


def test_summarize_pairs_seeds_and_applies_the_criterion():
    runs = [_run("float32", 0, 0.90), _run("float32", 1, 0.80), _run("mixed_float16", 0, 0.91, 2.0**15, 2),
            _run("mixed_float16", 1, 0.79, 2.0**16, 0), _run("mixed_bfloat16", 0, 0.88), _run("mixed_bfloat16", 1, 0.79)]  # fmt: skip
    rows = {s["policy"]: s for s in summarize(runs, criterion_points=0.5)}
    f16 = rows["mixed_float16"]
    assert f16["delta_points"]["min"] == pytest.approx(-1.0) and f16["delta_points"]["max"] == pytest.approx(
        1.0
    )
    assert f16["delta_points"]["mean"] == pytest.approx(0.0, abs=1e-12) and f16["passed"] is True
    assert f16["skipped_steps"] == 1 and f16["final_scale"] == 1.5 * 2**15
    bf16 = rows["mixed_bfloat16"]
    assert bf16["delta_points"]["mean"] == pytest.approx(-1.5) and bf16["passed"] is False
    assert summarize(runs, criterion_points=2.0)[2]["passed"] is True


def test_summarize_compares_an_fp8_policy_with_the_same_policy_without_fp8():
    runs = [
        _run("float32", 0, 0.90),
        _run("mixed_bfloat16", 0, 0.88),
        {**_run("mixed_bfloat16_fp8", 0, 0.87), "fp8_layers": 4},
    ]
    rows = {s["policy"]: s for s in summarize(runs, criterion_points=0.5)}
    fp8 = rows["mixed_bfloat16_fp8"]
    assert fp8["delta_points"]["mean"] == pytest.approx(-3.0) and fp8["passed"] is False
    assert fp8["vs_without_fp8"]["policy"] == "mixed_bfloat16"
    assert fp8["vs_without_fp8"]["mean"] == pytest.approx(-1.0) and fp8["fp8_layers"] == 4
    assert rows["mixed_bfloat16"]["vs_without_fp8"] is None and rows["mixed_bfloat16"]["fp8_layers"] == 0
    # without the policy minus FP8 in the run, there is nothing to pair with
    alone = {s["policy"]: s for s in summarize([runs[0], runs[2]])}
    assert alone["mixed_bfloat16_fp8"]["vs_without_fp8"] is None


@pytest.mark.skipif(not HAS_SKLEARN, reason="needs scikit-learn")
def test_compare_runs_fp8_policies_on_the_transformer_task(tmp_path):
    backends = [b for b in ("torch", "jax") if b in INSTALLED]
    if not backends:
        pytest.skip("needs torch or jax")
    args = [a for b in backends for a in ("--backend", b)]
    proc = _mpx("compare", *args, "--model", "transformer", "--seeds", "1", "--epochs", "1", "--max-steps", "2",
                "--policy", "mixed_bfloat16_fp8", "--policy", "mixed_bfloat16_fp8_current", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["settings"]["policies"] == ["mixed_bfloat16_fp8", "mixed_bfloat16_fp8_current"]
    for backend in backends:
        assert data["backends"][backend]["status"] == "ok", data["backends"][backend]
        runs = {r["policy"]: r for r in data["runs"] if r["backend"] == backend}
        assert runs["float32"]["fp8_layers"] == 0
        # the transformer's embed, two MLP and head layers (the attention keeps its own projections)
        assert (
            runs["mixed_bfloat16_fp8"]["fp8_layers"] == 4
            and runs["mixed_bfloat16_fp8_current"]["fp8_layers"] == 4
        )
        assert all(r["steps"] == 2 and None not in r["losses"] for r in runs.values())
    assert "FP8 layers" in (tmp_path / "compare.md").read_text()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_compare_runs_block_recipes_on_the_transformer_task(tmp_path, backend):
    """#31 item 5: the block presets (nvfp4_te: seeded, its step counters advancing) train on the transformer
    task next to float32 on torch and JAX (tiny: 2 steps, 1 seed)."""
    if backend not in INSTALLED:
        pytest.skip(f"needs {backend}")
    policies = ["mixed_bfloat16,fp8=mxfp8", "mixed_bfloat16,fp4=nvfp4", "mixed_bfloat16,fp8=fp8_blockwise",
                "mixed_bfloat16,fp4=nvfp4_te"]  # fmt: skip
    if backend == "jax":  # each policy is a compile (~20 s on a loaded CPU): one nearest, one seeded
        policies = [policies[0], policies[3]]
    proc = _mpx("compare", "--backend", backend, "--model", "transformer", "--seeds", "1", "--epochs", "1",
                "--max-steps", "2", *[a for p in policies for a in ("--policy", p)], "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["backends"][backend]["status"] == "ok", data["backends"][backend]
    runs = {r["policy"]: r for r in data["runs"]}
    assert set(runs) == {"float32", *data["settings"]["policies"]} and len(runs) == len(policies) + 1
    for name in data["settings"]["policies"]:
        assert runs[name]["fp8_layers"] == 4 and runs[name]["steps"] == 2 and None not in runs[name]["losses"]
    assert runs["float32"]["fp8_layers"] == 0
