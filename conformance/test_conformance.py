"""``pytest conformance``: every case under mpx passes on every installed backend, and
the native divergences found so far are still detected (so a framework upgrade that
changes behaviour shows up here).

The run happens once per session through the runner, which starts one worker process
per backend; this process imports no framework.
"""

from __future__ import annotations

import json

import pytest

import mpx
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
#: issue 16: replicas and accumulation (REFERENCES.md, "Native behaviour on the paths users scale to")
KNOWN_DIVERGENCES["torch"] += ["distributed.inf_in_grads_after_reduce.per_replica"]  # DDP: ranks diverge
KNOWN_DIVERGENCES["torch"] += ["models.gpt2.ops", "models.bert.ops"]  # autocast: pow (GPT-2), layer_norm (BERT) in half
KNOWN_DIVERGENCES["tf"] += [  # Keras's LSO under MirroredStrategy applies a step non-finite on replica 1
    "distributed.inf_in_loss_one_replica.per_replica", "distributed.inf_in_grads_after_reduce.per_replica",
    *(c["id"] for c in C.accumulation_cases()),  # gradient_accumulation_steps: scale per micro-batch
]  # fmt: skip
KNOWN_DIVERGENCES["jax"] += [  # shard_map without axis_name: shards diverge; MultiSteps: scale per micro-batch
    "distributed.inf_in_grads_after_reduce.per_replica", *(c["id"] for c in C.accumulation_cases()),
]  # fmt: skip
#: ...and where the framework's own machinery already follows the contract
KNOWN_AGREEMENTS = {
    "torch": ["distributed.inf_in_loss_one_replica.per_replica", "distributed.inf_in_loss_one_replica.sharded",
              "distributed.inf_in_grads_after_reduce.sharded",  # DTensor all-reduces GradScaler's found_inf
              *(c["id"] for c in C.accumulation_cases())],
    "jax": ["distributed.inf_in_loss_one_replica.per_replica", "distributed.inf_in_loss_one_replica.sharded",
            "distributed.inf_in_grads_after_reduce.sharded"],
}  # fmt: skip


@pytest.mark.parametrize("backend,case", [(b, c) for b, cs in KNOWN_DIVERGENCES.items() for c in cs])
def test_known_native_divergences_are_detected(data, backend, case):
    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    assert _result(data, backend, case, "native")["status"] == "differs"


@pytest.mark.parametrize("backend,case", [(b, c) for b, cs in KNOWN_AGREEMENTS.items() for c in cs])
def test_known_native_agreements_pass(data, backend, case):
    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    assert _result(data, backend, case, "native")["status"] == "pass"


def test_replica_and_accumulation_groups_are_listed():
    groups = {g: [c for c in C.all_cases() if c["group"] == g] for g in ("distributed", "accumulation")}
    assert {"distributed", "accumulation"} <= set(C.GROUPS)
    assert {c["id"] for c in groups["distributed"]} >= {
        f"distributed.{s}.{e}" for s in ("inf_in_loss_one_replica", "inf_in_grads_after_reduce")
        for e in ("per_replica", "sharded")
    }  # fmt: skip
    assert {c["params"]["steps"] for c in groups["accumulation"]} == {2, 4}
    for c in groups["accumulation"]:  # the expectation is the core's reference, per optimizer step
        trace = mpx.accumulation_trace(mpx.ScalerConfig.from_dict(c["params"]["config"]), c["params"]["flags"],
                                       c["params"]["steps"])  # fmt: skip
        assert c["expected"]["scales"] == [t["scale"] for t in trace]
        assert c["expected"]["applied"] == [t["applied"] for t in trace]


def test_accumulation_traces_are_identical_across_backends(data):
    """Under mpx the three backends give the same per-optimizer-step trace, skip decisions and parameters."""
    if len(INSTALLED) < 2:
        pytest.skip("needs two installed backends")
    for case in C.accumulation_cases():
        seen = {b: _result(data, b, case["id"], "mpx")["observed"] for b in INSTALLED}
        assert all(seen[b] == seen[INSTALLED[0]] for b in INSTALLED), (case["id"], seen)


def test_keras_and_multisteps_share_the_per_micro_batch_rule(data):
    """Natively Keras and optax.MultiSteps agree with each other (drop the bad micro-batch, move per micro-batch)."""
    if not {"tf", "jax"} <= set(INSTALLED):
        pytest.skip("needs tf and jax")
    for case in C.accumulation_cases():
        tf_obs, jax_obs = (_result(data, b, case["id"], "native")["observed"] for b in ("tf", "jax"))
        assert tf_obs == jax_obs != case["expected"], case["id"]


def test_replica_results_name_their_engine_and_skip_with_a_reason(data):
    for r in data["results"]:
        if r["group"] != "distributed":
            continue
        if r["status"] == "skip":
            assert len(r["detail"]) > 40, r  # says why (no engine, or the replicas could not be launched)
        elif r["status"] == "pass":
            assert r["detail"].startswith("engine: "), r


def test_a_backend_that_cannot_launch_replicas_skips_saying_why(tmp_path):
    from conformance import distributed
    from conformance.adapters._common import Skip

    out = distributed._launch("torch", python=str(tmp_path / "no-python"))
    assert set(out) == {c["id"] for c in C.distributed_cases()}
    case = C.distributed_cases()[0]
    distributed._CACHE["nowhere"] = out
    try:
        with pytest.raises(Skip, match="cannot launch the torch replicas: FileNotFoundError"):
            distributed.observed("nowhere", case["params"], "mpx")
    finally:
        del distributed._CACHE["nowhere"]


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


def test_no_adapter_errored(data):
    assert [
        (r["backend"], r["mode"], r["case"], r["detail"]) for r in data["results"] if r["status"] == "error"
    ] == []


#: Per backend, a case on which the framework itself raises natively (a finding, not an error).
FRAMEWORK_RAISES = {
    "torch": ("portability.resume_from_core", "KeyError: 'growth_factor'", "torch/amp/grad_scaler.py"),
    "jax": ("ops.attention.mixed_float16.float16", "ValueError: The precision 'F16_F16_F32' is not supported",
            "jax/_src/"),
    "tf": ("policy.bf16-mixed", "ValueError: Cannot convert 'bf16-mixed'", "keras/src/dtype_policies/"),
}  # fmt: skip
#: Runs a crashing case (an op case without its policy: the adapter's own ``p["policy"]`` raises) and the
#: framework's case through the real worker functions and adapter, in a process of its own.
CRASH_SCRIPT = """
import json, sys
from conformance import cases as C, worker
backend, framework_case = sys.argv[1:]
worker.unfiltered_tracebacks(backend)
adapter = worker.load_adapter(backend)
worker.unfiltered_tracebacks(backend)
cases = {c["id"]: c for c in C.all_cases()}
op = cases["ops.softmax.mixed_float16.float16"]
crash = dict(op, params={k: v for k, v in op["params"].items() if k != "policy"})
print(json.dumps({mode: [worker.run_case(adapter, crash, mode, None),
                         worker.run_case(adapter, cases[framework_case], mode, None)] for mode in worker.MODES}))
"""


@pytest.mark.parametrize("backend", list(FRAMEWORK_RAISES))
def test_an_adapter_crash_is_an_error_and_a_framework_raise_a_divergence(backend):
    import subprocess
    import sys

    from mpx._workers import ROOT, worker_env

    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    case, message, where = FRAMEWORK_RAISES[backend]
    # the bound only catches a hang: the framework's import and two cases take seconds
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, backend, case], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for mode in ("native", "mpx"):
        crashed = out[mode][0]
        assert crashed["status"] == "error" and crashed["observed"] is None, crashed
        assert crashed["detail"] == "KeyError: 'policy'"
        assert crashed["at"].startswith(f"conformance/adapters/{backend}.py:"), crashed
    native = out["native"][1]
    assert native["status"] == "differs" and native["observed"]["raised"].startswith(message), native
    assert where in native["at"] and native["detail"] == "raised " + native["observed"]["raised"]
    assert out["mpx"][1]["status"] == "pass", out["mpx"][1]
    rows = [{"case": c, "group": c.split(".")[0], "backend": backend, "mode": m, "expected": C_BY_ID[c]["expected"],
             **r} for m in ("native", "mpx") for c, r in zip((OP_CASE, case), out[m], strict=True)]  # fmt: skip
    data = {"mpx_version": mpx.__version__, "python": "3", "machine": "x", "seconds": 1.0,
            "backends": {backend: {"version": "v", "device": "cpu", "seconds": 1.0}},
            "cases": {c: {"group": C_BY_ID[c]["group"], "spec": C_BY_ID[c]["spec"], "params": C_BY_ID[c]["params"]}
                      for c in (OP_CASE, case)}, "results": rows}  # fmt: skip
    from conformance import findings

    assert [f["cases"] for f in findings.findings(data)] == [[case]]  # the crash is no finding
    assert not report.mpx_passes(data)  # an mpx result errored: exit status 1


OP_CASE = "ops.softmax.mixed_float16.float16"
C_BY_ID = {c["id"]: c for c in C.all_cases()}
