"""``mpx compare`` stores each run's scaler history (mpx.ScalerHistory) and draws the timeline from it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mpx

ROOT = Path(__file__).resolve().parents[2]
NEEDS = [m for m in ("torch", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(bool(NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_compare_runs_carry_the_history(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpx", "compare", "--backend", "torch", "--epochs", "1",
                           "--max-steps", "4", "--policy", "mixed_float16", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    data = json.loads((tmp_path / "compare.json").read_text())
    runs = [r for r in data["runs"] if r["policy"] == "mixed_float16"]
    assert runs and all(r["backend"] == "torch" for r in runs)
    run = runs[0]
    history = mpx.ScalerHistory.from_dict(run["history"])
    assert history.steps == [1, 2, 3, 4]
    assert history.scale == run["scales"] and sum(history.skipped) == run["skipped_steps"]
    assert history.config == mpx.ScalerConfig.for_policy("mixed_float16")
    (tmp_path / "h.json").write_text(json.dumps(run["history"]))
    plot = subprocess.run([sys.executable, "-m", "mpx", "history", "plot", str(tmp_path / "h.json"), "--out",
                           str(tmp_path / "h.png")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
