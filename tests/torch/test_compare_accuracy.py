"""Digits, float32 vs mixed_bfloat16 with mpx_torch (the in-process mpx_compare API): within 1 point.

Kept under 2 minutes: one seed, the MLP, 8 epochs (about 180 Adam steps per run).
"""

import pytest

pytest.importorskip("sklearn")

import mpx_compare
from mpx_compare import data
from mpx_compare.workers import torch as torch_worker


def test_digits_mixed_bfloat16_within_one_point(tmp_path):
    result = mpx_compare.compare("torch", torch_worker.build("mlp", 10), data.load("digits"),
                                 policies=["mixed_bfloat16"], seeds=1, epochs=8, criterion_points=1.0,
                                 out=tmp_path, progress=False)  # fmt: skip
    rows = {s["policy"]: s for s in result["summary"]}
    assert rows["float32"]["val_accuracy"] > 0.9  # it learned something: the comparison means something
    assert abs(rows["mixed_bfloat16"]["delta_points"]["mean"]) <= 1.0, rows
    assert rows["mixed_bfloat16"]["passed"] is True
    assert (tmp_path / "compare.json").exists() and (tmp_path / "compare.md").exists()
