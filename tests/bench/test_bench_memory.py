"""``mpx bench --memory``: bytes per parameter per policy from the state's tensors, the same in torch and JAX.

The tiny MLP (1072 parameters: 16x32, 32, 32x16, 16) in subprocesses; the int8 rows count whole blocks of 256
(each tensor's last block padded) plus a float32 absmax per block: 2 x (520 + 260 + 520 + 260) = 3120 bytes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = [
    b for b, m in {"torch": "torch", "jax": "jax"}.items() if importlib.util.find_spec(m) is not None
]

EXPECTED = {  # bytes: weights, grads, compensation/master, state (n = 1072)
    "mixed_bfloat16": (4 * 1072, 4 * 1072, 0, 8 * 1072),
    "bf16_kahan": (2 * 1072, 2 * 1072, 2 * 1072, 8 * 1072),
    "bf16_sr": (2 * 1072, 2 * 1072, 0, 8 * 1072),
    "mixed_bfloat16_8bit_adam": (4 * 1072, 4 * 1072, 0, 3120),
}


@pytest.mark.skipif(len(INSTALLED) < 2, reason="torch and jax are both needed")
def test_memory_rows_are_counted_from_the_tensors_and_agree_across_backends(tmp_path):
    args = [sys.executable, "-m", "mpx", "bench", "--memory", "--size", "tiny", "--out", str(tmp_path)]
    for backend in INSTALLED:
        args += ["--backend", backend]
    for policy in EXPECTED:
        args += ["--policy", policy]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert sorted((r["backend"], r["policy"]) for r in rows) == sorted(
        (b, p) for b in INSTALLED for p in EXPECTED
    )
    for r in rows:
        assert r["params"] == 1072
        assert (
            tuple(r["bytes"][k] for k in ("weights", "grads", "extra", "state")) == EXPECTED[r["policy"]]
        ), r
        assert r["total"] == pytest.approx(sum(EXPECTED[r["policy"]]) / 1072)
    assert "bf16_kahan" in proc.stdout and (tmp_path / "memory.md").exists()
