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
from mpx_tools.workers import BACKENDS, is_installed

#: Keras on JAX and on PyTorch (issue 24) run a selection of the cases in a fixture of their own
#: (``keras_data``), so they add about two minutes; ``mpx conformance --backend keras-jax`` runs every case.
#: ``data``, the full run of the other columns, is conftest's (the browser test renders its report).
KERAS_NEW = ("keras-jax", "keras-torch")
INSTALLED = [b for b in BACKENDS if is_installed(b) and b not in KERAS_NEW]
CASE_IDS = [c["id"] for c in C.all_cases()]


def _result(data, backend, case, mode):
    rows = [r for r in data["results"] if (r["backend"], r["case"], r["mode"]) == (backend, case, mode)]
    assert len(rows) == 1, f"{backend} {case} {mode}: {len(rows)} results"
    return rows[0]


def test_cases_are_many_and_grouped():
    assert len(set(CASE_IDS)) == len(CASE_IDS) >= 30
    assert {c["group"] for c in C.all_cases()} == set(C.GROUPS) and len(C.GROUPS) >= 5
    for case in C.all_cases():
        json.dumps(case)  # cases are plain data


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in KERAS_NEW])
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
    # Keras on TensorFlow has no sharded engine: a finding (its observation names why), not a skip
    "distributed.inf_in_loss_one_replica.sharded", "distributed.inf_in_grads_after_reduce.sharded",
    "distributed.fp8_amax_one_shard.sharded",
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
            "distributed.inf_in_grads_after_reduce.sharded",
            "distributed.fp8_amax_one_shard.sharded"],  # jit: Flax's FP8 amaxes are global values
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
    from mpx_tools.skip import Skip

    out = distributed._launch("torch", C.all_cases(), python=str(tmp_path / "no-python"))
    assert set(out) == {c["id"] for c in C.distributed_cases()}
    case = C.distributed_cases()[0]
    distributed._CACHE["nowhere"] = out
    distributed._SPECS["nowhere"] = {c["id"]: c["params"] for c in C.distributed_cases()}
    try:
        with pytest.raises(Skip, match="cannot launch the torch replicas: FileNotFoundError"):
            distributed.observed("nowhere", case["params"], "mpx")
    finally:
        del distributed._CACHE["nowhere"], distributed._SPECS["nowhere"]


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
    "keras-jax": ("policy.bf16-mixed", "ValueError: Cannot convert 'bf16-mixed'", "keras/src/dtype_policies/"),
    "keras-torch": ("policy.bf16-mixed", "ValueError: Cannot convert 'bf16-mixed'", "keras/src/dtype_policies/"),
}  # fmt: skip
#: The file of a backend's adapter where it is not ``conformance/adapters/BACKEND.py``: the Keras columns
#: share conformance/adapters/keras.py
ADAPTER_FILE = {"tf": "keras", "keras-jax": "keras", "keras-torch": "keras"}
#: Runs a crashing case (an op case without its input dtype: the adapter's own ``p["dtype"]`` raises) and the
#: framework's case through the real worker functions and adapter in one mode, in a process of its own
#: (natively with mpx blocked first, as the native worker does), on the cases of a cases file.
CRASH_SCRIPT = """
import json, sys
backend, framework_case, mode, path = sys.argv[1:]
if mode == "native":
    from conformance import isolation
    isolation.install()
from conformance import worker
worker.unfiltered_tracebacks(backend)
adapter = worker.load_adapter(backend)
worker.unfiltered_tracebacks(backend)
cases = {c["id"]: c for c in worker.read_cases(path)}
op = cases["ops.softmax.mixed_float16.float16"]
crash = dict(op, params={k: v for k, v in op["params"].items() if k != "dtype"})
print(json.dumps([worker.run_case(adapter, crash, mode, None), worker.run_case(adapter, cases[framework_case], mode, None)]))
"""


def _cases_file(tmp_path, only: str):
    from conformance.runner import selected

    return C.write(selected(only), tmp_path / "cases.json")


def _script(script: str, *args: str) -> list | dict:
    """Run a script in a process of its own (the worker's environment) and return its last line's JSON."""
    import subprocess
    import sys

    from mpx_tools.workers import ROOT, worker_env

    # the bound only catches a hang: the framework's import and a few cases take seconds
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("backend", list(FRAMEWORK_RAISES))
def test_an_adapter_crash_is_an_error_and_a_framework_raise_a_divergence(backend, tmp_path):
    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    case, message, where = FRAMEWORK_RAISES[backend]
    path = _cases_file(tmp_path, f"{OP_CASE},{case}")
    out = {mode: _script(CRASH_SCRIPT, backend, case, mode, path) for mode in ("native", "mpx")}
    for mode in ("native", "mpx"):
        crashed = out[mode][0]
        assert crashed["status"] == "error" and crashed["observed"] is None, crashed
        assert crashed["detail"] == "KeyError: 'dtype'"
        assert crashed["at"].startswith(f"conformance/adapters/{ADAPTER_FILE.get(backend, backend)}.py:"), crashed
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


# -- native runs are mpx-free (issue 24) --------------------------------------------------------------
#: A small selection that reaches each kind of native path: ops, a scaler, numerics, the core's saved state,
#: replicas (a process of their own, started by the worker).
NATIVE_ONLY = ("ops.softmax.mixed_float16.float16,scaler.defaults,scaler.backoff_0_3,skip.adam.inf,numerics.mlp.mixed_bfloat16,"
               "portability.resume_from_core,accumulation.k2.bad_last,distributed.inf_in_loss_one_replica.per_replica")  # fmt: skip


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_native_worker_runs_with_nothing_of_mpx_loaded(backend, tmp_path):
    """``--mode native``: its info row and its last row list no mpx module, the blocker refused no import
    (its replicas' neither), and no case errored."""
    from mpx_tools.workers import run_worker

    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    path = _cases_file(tmp_path, NATIVE_ONLY)
    rows, code, stderr = run_worker("conformance.worker", [backend, "--mode", "native", "--cases", str(path)],
                                    timeout_s=900, backend=backend)  # fmt: skip
    assert code == 0, stderr
    info, *results, done = rows
    assert (info["type"], info["mode"], info["mpx_modules"]) == ("info", "native", [])
    assert (done["type"], done["mode"], done["mpx_modules"], done["blocked"]) == ("done", "native", [], [])
    assert {r["case"] for r in results} == {c["id"] for c in json.loads(path.read_text())["cases"]}
    assert [(r["case"], r["detail"]) for r in results if r["mode"] != "native" or r["status"] == "error"] == []
    replicas = done.get("replicas") or {}
    assert replicas.get("mpx_modules", []) == [] and replicas.get("blocked", []) == []
    if backend in ("torch", "jax", "keras-jax"):  # these replica scripts report their isolation
        assert replicas == {"mpx_modules": [], "blocked": []}


#: Runs the torch/jax adapter's scaler case natively with mpx blocked, its native scaler mutated to reach
#: the core (an adapter that forgot to branch on the mode), once plainly and once with the ImportError
#: swallowed; prints both results and the isolation report.
BLOCKED_SCRIPT = """
import json, sys
from conformance import isolation
isolation.install()
from conformance import worker
backend, path = sys.argv[1:]
adapter = worker.load_adapter(backend)
case = {c["id"]: c for c in worker.read_cases(path)}["scaler.backoff_0_3"]
native = adapter._native_scaler
adapter._native_scaler = lambda cfg: adapter._mpx().ScalerConfig(**cfg)
loud = worker.run_case(adapter, case, "native", None)
def swallowed(cfg):
    try:
        adapter._mpx()
    except ImportError:
        pass
    return native(cfg)
adapter._native_scaler = swallowed
quiet = worker.run_case(adapter, case, "native", None)
print(json.dumps([loud, quiet, isolation.report()]))
"""


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_native_path_that_imports_mpx_fails_loudly(backend, tmp_path):
    from conformance import runner

    if backend not in INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    loud, quiet, isolated = _script(BLOCKED_SCRIPT, backend, _cases_file(tmp_path, "scaler.backoff_0_3"))
    assert loud["status"] == "error" and loud["observed"] is None, loud
    assert loud["detail"].startswith("conformance.isolation.MpxImportBlocked: import of 'mpx' refused: this process runs the framework "
                                     "natively"), loud  # fmt: skip
    assert loud["at"].startswith(f"conformance/adapters/{backend}.py:") and loud["at"].endswith("in _mpx"), loud
    # an adapter that swallows the ImportError runs on, but the worker's report names the refused import,
    # and the runner fails such a native run
    assert quiet["status"] in ("pass", "differs", "skip") and isolated == {"mpx_modules": [], "blocked": ["mpx"]}
    assert not runner._mpx_free(isolated) and runner._loaded(isolated) == "mpx imports refused: mpx"


def test_the_blocker_refuses_mpx_and_every_mpx_package_only():
    """The library's packages and the other tools, not mpx_tools (what the tools share: it imports no mpx)."""
    from conformance import isolation

    blocker = isolation.MpxBlocker()  # not installed: this test process has mpx loaded
    for name in ("mpx", "mpx.policy", "mpx_torch", "mpx_keras._compat", "mpx_tf", "mpx_jax", "mpx_bench",
                 "mpx_compare"):  # fmt: skip
        with pytest.raises(isolation.MpxImportBlocked, match=f"import of '{name}' refused") as info:
            blocker.find_spec(name)
        assert isinstance(info.value, ImportError) and info.value.name == name
        try:
            raise RuntimeError("wrapped") from info.value
        except RuntimeError as wrapped:
            assert isolation.blocked_by(wrapped) is info.value
    for name in ("numpy", "mpxx", "conformance.worker", "ml_dtypes", "jax", "torch", "mpx_tools", "mpx_tools.workers"):
        assert blocker.find_spec(name) is None
    assert blocker.blocked == ["mpx", "mpx.policy", "mpx_torch", "mpx_keras._compat", "mpx_tf", "mpx_jax",
                               "mpx_bench", "mpx_compare"]  # fmt: skip
    assert isolation.blocked_by(ValueError("x")) is None
    with pytest.raises(RuntimeError, match="mpx is already loaded in this process"):
        isolation.install()  # too late here: the blocker would not see what is loaded


def test_the_worker_and_the_native_harness_modules_import_no_mpx():
    """What a native worker imports before its adapter has no module-level import of mpx (read, not run),
    mpx_tools's modules included (the blocker lets them through)."""
    import ast

    from conformance import isolation
    from mpx_tools.workers import ROOT

    files = ["conformance/__init__.py", "conformance/worker.py", "conformance/isolation.py",
             "conformance/adapters/__init__.py", "conformance/adapters/_common.py", "conformance/adapters/torch.py",
             "conformance/adapters/jax.py", "conformance/distributed/__init__.py", "conformance/distributed/torch.py",
             "conformance/distributed/jax.py", "mpx_tools/__init__.py", "mpx_tools/workers.py", "mpx_tools/skip.py",
             "mpx_tools/models/__init__.py", "mpx_tools/models/torch.py", "conformance/deepspeed/__init__.py",
             "conformance/deepspeed/torch.py"]  # fmt: skip
    for name in files:
        tree = ast.parse((ROOT / name).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert [m for m in names if isolation.is_mpx_name(m)] == [], name
        assert "mpx_tools.workers" in names or name != "conformance/worker.py"  # imported, not read by path


def test_the_report_says_native_columns_ran_mpx_free(data):
    for backend in INSTALLED:
        meta = data["backends"][backend]
        assert meta["mpx_free"] is True and meta["native"]["mpx_modules"] == [], (backend, meta)
        assert meta["native"]["blocked"] == [], (backend, meta)


#: The models group recognises torch's functions by the harness's own table; it names the functions of
#: mpx_torch's (checked in a process of its own: this one imports no framework).
OP_FUNCTIONS_SCRIPT = """
import json
from mpx_tools.models import torch as MT
from mpx_torch._ops import FUNCTIONS
theirs = {func: op for op, pairs in FUNCTIONS.items() for func, _ in pairs}
ours = MT._canonical()
print(json.dumps({"missing": sorted(f"{op}: {f}" for f, op in theirs.items() if ours.get(f) != op),
                  "extra": sorted(f"{op}: {f}" for f, op in ours.items() if theirs.get(f) != op)}))
"""


def test_the_models_op_table_names_mpx_torchs_functions():
    if "torch" not in INSTALLED:
        pytest.skip("torch is not installed")
    assert _script(OP_FUNCTIONS_SCRIPT) == {"missing": [], "extra": []}


# -- the Keras columns (issue 24): Keras on TensorFlow, JAX and PyTorch -------------------------------------
#: The cases the keras-jax and keras-torch columns run in this suite: every scaler, skip, portability and
#: accumulation case (the traces), the policies, the MLP, and ops computed by layers and by functions
#: (about 190 s for both columns on this 2-core machine under load; keras-jax takes three quarters).
KERAS_ONLY = ("policy,scaler,skip,portability,accumulation,distributed,numerics.mlp,ops.softmax.,ops.layer_norm.,"
              "ops.add.,ops.matmul.,ops.exp.")  # fmt: skip
KERAS_INSTALLED = [b for b in KERAS_NEW if is_installed(b)]
KERAS_CASE_IDS = [c for c in CASE_IDS if any(c.startswith(p) for p in KERAS_ONLY.split(","))]


@pytest.fixture(scope="session")
def keras_data(tmp_path_factory):
    if not KERAS_INSTALLED:
        pytest.skip("neither jax nor torch is installed")
    out = tmp_path_factory.mktemp("keras-report")
    result = run(KERAS_INSTALLED, out, only=KERAS_ONLY, quiet=True)
    result["out"] = out
    return result


@pytest.mark.parametrize("backend", KERAS_NEW)
@pytest.mark.parametrize("case", KERAS_CASE_IDS)
def test_keras_columns_pass_under_mpx(keras_data, backend, case):
    if backend not in KERAS_INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    r = _result(keras_data, backend, case, "mpx")
    assert r["status"] in ("pass", "skip"), r["detail"]


def test_keras_columns_ran_every_selected_case_natively_mpx_free(keras_data):
    assert not [r for r in keras_data["results"] if r["case"] == "worker" or r["status"] == "error"]
    for backend in KERAS_INSTALLED:
        assert keras_data["backends"][backend]["mpx_free"] is True
        assert keras_data["backends"][backend]["version"].startswith("keras 3.")
        for case in KERAS_CASE_IDS:
            assert _result(keras_data, backend, case, "native")["status"] in ("pass", "differs", "skip")


#: natively, Keras's LossScaleOptimizer behaves alike on every backend: no floor, no ceiling, no hysteresis,
#: an initial scale of 2**15, the scale moved per micro-batch under gradient_accumulation_steps
KERAS_NATIVE_DIVERGENCES = ["scaler.defaults", "scaler.floor", "scaler.ceiling", "scaler.hysteresis_2",
                            "portability.saves_neutral_format", *(c["id"] for c in C.accumulation_cases())]  # fmt: skip


@pytest.mark.parametrize("backend", KERAS_NEW)
@pytest.mark.parametrize("case", KERAS_NATIVE_DIVERGENCES)
def test_keras_native_divergences_are_detected_on_every_keras_backend(keras_data, backend, case):
    if backend not in KERAS_INSTALLED:
        pytest.skip(f"{BACKENDS[backend]} is not installed")
    assert _result(keras_data, backend, case, "native")["status"] == "differs"


def test_keras_scale_traces_are_the_cores_bit_for_bit_on_every_keras_backend(data, keras_data):
    """Under mpx, tf, keras-jax and keras-torch give the core's scale trace (mpx.scaler_update's) on every
    trace case, bit for bit, and so the same trace as each other."""
    from conformance.agreement import keras_traces

    merged = {"backends": {**data["backends"], **keras_data["backends"]},
              "results": data["results"] + keras_data["results"]}  # fmt: skip
    agreement = keras_traces(merged)
    assert set(agreement) == set(KERAS_INSTALLED) | ({"tf"} & set(INSTALLED))
    for backend, seen in agreement.items():
        # every scaler trace, every accumulation case and the resume from the core's state, at least
        assert seen["differ"] == [] and seen["compared"] >= len(C.SCALER_TRACES) + 8 + 1, (backend, seen)
    for case in KERAS_CASE_IDS:
        if not isinstance(C_BY_ID[case]["expected"].get("scales"), list):
            continue
        seen = {b: _result(merged, b, case, "mpx") for b in agreement}
        traces = {b: r["observed"]["scales"] for b, r in seen.items() if r["status"] != "skip"}
        assert len(set(map(tuple, traces.values()))) <= 1, (case, traces)


def test_every_keras_native_divergence_is_in_exactly_one_explained_finding(keras_data):
    saved = json.loads((keras_data["out"] / "report.json").read_text())
    divergences = sorted((r["backend"], r["case"]) for r in saved["results"]
                         if r["mode"] == "native" and r["status"] == "differs")  # fmt: skip
    assert divergences and sorted((f["backend"], c) for f in saved["findings"] for c in f["cases"]) == divergences
    for f in saved["findings"]:
        assert "unexplained" not in f["topic"] and not f["topic"].startswith("other"), f
        assert f["title"].startswith(("Keras on JAX", "Keras on PyTorch", "Keras's")), f["title"]


def test_states_saved_by_each_keras_backend_resume_on_every_keras_backend(keras_data):
    """``portability.resume_from_keras-jax`` / ``resume_from_keras-torch``: the state one saved resumes the
    core's trace on the other (and on itself; torch, tf and jax resume from them in a full run)."""
    if len(KERAS_INSTALLED) < 2:
        pytest.skip("needs jax and torch")
    for backend in KERAS_INSTALLED:
        for source in KERAS_INSTALLED:
            r = _result(keras_data, backend, f"portability.resume_from_{source}", "mpx")
            assert r["status"] == "pass", (backend, source, r["detail"])


def test_keras_scaler_states_are_the_cores_and_load_on_every_keras_backend(tmp_path):
    """The scaler state keras-jax and keras-torch save (``--save-states``) is the core's mpx.scaler/1 dict, so
    it loads wherever the core's does (every column's ``portability.resume_from_core``)."""
    import subprocess
    import sys

    from mpx_tools.workers import ROOT, worker_env

    if not KERAS_INSTALLED:
        pytest.skip("neither jax nor torch is installed")
    for backend in KERAS_INSTALLED:
        # the bound only catches a hang
        proc = subprocess.run([sys.executable, "-m", "conformance.worker", backend, "--states", str(tmp_path),
                               "--save-states"], cwd=ROOT, env=worker_env(backend), capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = json.loads((tmp_path / f"{backend}.json").read_text())
        assert saved == C.saved_prefix_state(), backend


def test_keras_on_jax_runs_the_replica_cases_on_keras_distribution(keras_data):
    """keras-jax: DataParallel (per_replica) and ModelParallel with sharded kernels (sharded) over 4 host
    devices, natively and under mpx: every device skips alike and holds the same scale, and FP8 state is
    the same on every device with the whole batch's input amax (issue 33)."""
    if "keras-jax" not in KERAS_INSTALLED:
        pytest.skip("jax is not installed")
    for case in C.distributed_cases():
        for mode in ("native", "mpx"):
            r = _result(keras_data, "keras-jax", case["id"], mode)
            assert r["status"] == "pass", (mode, r["detail"])
            engine = "DataParallel" if case["params"]["engine"] == "per_replica" else "ModelParallel"
            assert engine in r["observed"]["engine"]
            layout = "P(None, 'model')" if engine == "ModelParallel" else "P(None, None)"
            assert r["observed"]["kernel_layout"] == layout
            if case["params"]["scenario"] == "fp8_amax":
                assert r["observed"]["global_amax"] is True and "FP8" in r["observed"]["engine"]
                assert r["observed"]["core_chain"] is (True if mode == "mpx" else None)
                continue
            assert all(len(set(s)) == 1 for s in zip(*r["observed"]["scales_per_replica"], strict=True))


def test_keras_on_torch_has_no_replica_engine_and_says_so_in_a_finding(keras_data):
    """keras-torch: natively the observation is Keras's missing engine (a finding), under mpx a skip saying so."""
    if "keras-torch" not in KERAS_INSTALLED:
        pytest.skip("torch is not installed")
    from conformance.findings import findings

    ids = [c["id"] for c in C.distributed_cases()]
    for case in ids:
        native = _result(keras_data, "keras-torch", case, "native")
        assert native["status"] == "differs" and "keras.distribution is implemented for jax" in native[
            "observed"]["no_engine"]  # fmt: skip
        assert _result(keras_data, "keras-torch", case, "mpx")["status"] == "skip"
    (found,) = [f for f in findings(keras_data) if f["backend"] == "keras-torch" and f["topic"] == "replicas:no engine"]
    assert found["cases"] == ids and found["kind"] == "API or format gap"
    assert "no replica or sharding engine" in found["explanation"]
