"""``pytest conformance``: every case under mpx passes on every installed backend, and
the native divergences found so far are still detected (so a framework upgrade that
changes behaviour shows up here).

The run happens once per session through the runner, which starts one worker process
per backend; this process imports no framework.
"""

from __future__ import annotations

import json

import pytest

from conformance import cases as C
from conformance import report
from conformance.runner import run
from mpx._workers import BACKENDS, is_installed

INSTALLED = [b for b in BACKENDS if is_installed(b)]
CASE_IDS = [c["id"] for c in C.all_cases()]


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    if not INSTALLED:
        pytest.skip("no framework is installed")
    out = tmp_path_factory.mktemp("report")
    result = run(INSTALLED, out, quiet=True)
    result["out"] = out
    return result


def _result(data, backend, case, mode):
    rows = [r for r in data["results"] if (r["backend"], r["case"], r["mode"]) == (backend, case, mode)]
    assert len(rows) == 1, f"{backend} {case} {mode}: {len(rows)} results"
    return rows[0]


def test_cases_are_many_and_grouped():
    assert len(set(CASE_IDS)) == len(CASE_IDS) >= 30
    assert {c["group"] for c in C.all_cases()} == set(C.GROUPS) and len(C.GROUPS) >= 5
    for case in C.all_cases():
        json.dumps(case)  # cases are plain data


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASE_IDS)
def test_mpx_mode_passes(data, backend, case):
    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    r = _result(data, backend, case, "mpx")
    assert r["status"] in ("pass", "skip"), r["detail"]


def test_no_worker_crashed(data):
    assert not [r for r in data["results"] if r["case"] == "worker"]


KNOWN_DIVERGENCES = {
    "torch": [
        "ops.softmax.mixed_float16.float16", "ops.softmax.mixed_bfloat16.bfloat16",
        "ops.layer_norm.mixed_float16.float16", "ops.layer_norm.mixed_bfloat16.bfloat16",
        "scaler.floor", "scaler.ceiling", "portability.resume_from_core",
        "numerics.softmax.mixed_bfloat16", "numerics.layer_norm.mixed_bfloat16",
        "ops.cross_entropy.keep_fp32=none.bfloat16",
    ],
    "tf": [
        "ops.softmax.mixed_float16.float32", "ops.softmax.mixed_float16.float16",
        "ops.layer_norm.mixed_float16.float32", "ops.layer_norm.mixed_bfloat16.float32",
        "scaler.defaults", "scaler.floor", "scaler.ceiling",
        "numerics.softmax.mixed_float16", "numerics.layer_norm.mixed_float16",
        "ops.matmul.mixed_float16.float32", "ops.exp.mixed_bfloat16.bfloat16", "ops.sum.mixed_float16.float16",
        "ops.cross_entropy.mixed_bfloat16.bfloat16", "numerics.exp.mixed_bfloat16", "numerics.mean.mixed_float16",
    ],
    "jax": [
        "ops.matmul.mixed_float16.float32", "ops.softmax.mixed_bfloat16.bfloat16",
        "scaler.growth_on_nth_step", "scaler.floor", "skip.adam.inf",
        "numerics.log_softmax.mixed_bfloat16", "ops.softmax.keep_fp32=none.float32",
    ],
}  # fmt: skip


@pytest.mark.parametrize("backend,case", [(b, c) for b, cs in KNOWN_DIVERGENCES.items() for c in cs])
def test_known_native_divergences_are_detected(data, backend, case):
    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    assert _result(data, backend, case, "native")["status"] == "differs"


def test_reports_are_written(data):
    out = data["out"]
    saved = json.loads((out / "report.json").read_text())
    assert set(saved["backends"]) == set(INSTALLED)
    for r in saved["results"]:
        assert {"case", "group", "backend", "mode", "status", "expected", "observed", "detail"} <= set(r)
        assert r["mode"] in ("native", "mpx") and r["status"] in report.STATUSES
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "http://" not in html and "https://" not in html
    assert "# mpx conformance report" in (out / "report.md").read_text()


def test_every_native_divergence_is_in_exactly_one_finding(data):
    from conformance.findings import KINDS, SEVERITIES

    saved = json.loads((data["out"] / "report.json").read_text())
    divergences = sorted((r["backend"], r["case"]) for r in saved["results"]
                         if r["mode"] == "native" and r["status"] == "differs")  # fmt: skip
    listed = sorted((f["backend"], c) for f in saved["findings"] for c in f["cases"])
    assert listed == divergences
    for f in saved["findings"]:
        assert f["kind"] in KINDS and f["severity"] in SEVERITIES and f["explanation"] and f["title"]
        assert "unexplained" not in f["topic"], f  # every scale trace is explained by named rules

