"""The report's schema, the findings' classification and the atomic write, on rows built from the real cases.

No framework is imported: the rows are what a native worker reports, with observed values computed
by the mpx core (a scaler with a bound removed reproduces torch's trace exactly) or written out.
"""

from __future__ import annotations

import html
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpx
from conformance import cases as C
from conformance import findings as F
from conformance import report, results
from conformance.plots import first_divergence

CASES = {c["id"]: c for c in C.all_cases()}


def _trace(config: dict, flags: list[bool], **changes) -> list[float]:
    scaler = mpx.LossScaler(mpx.ScalerConfig.from_dict({**config, **changes}))
    out = []
    for finite in flags:
        scaler.update(finite)
        out.append(scaler.get_scale())
    return out


def _row(case_id: str, backend: str, mode: str, status: str, observed) -> dict:
    c = CASES[case_id]
    return {"case": case_id, "group": c["group"], "backend": backend, "mode": mode, "status": status,
            "expected": c["expected"], "observed": observed, "detail": ""}  # fmt: skip


def _scaler_obs(case_id: str, **changes) -> dict:
    p = CASES[case_id]["params"]
    return {
        "scales": _trace(p["config"], p["flags"], **changes),
        "skipped": CASES[case_id]["expected"]["skipped"],
    }


#: (case, observed, expected kind, severity): one native divergence of each sort the suite finds.
DIVERGENCES = [
    ("ops.softmax.mixed_bfloat16.bfloat16", {"dtype": "bfloat16"}, "precision hazard", "high"),
    ("ops.layer_norm.mixed_float16.float16", {"dtype": "float16"}, "precision hazard", "high"),
    ("numerics.softmax.mixed_bfloat16", {"max_rel_error": 1.8e-3}, "precision hazard", "high"),
    ("ops.add.mixed_bfloat16.bfloat16+float32", {"dtype": "bfloat16"}, "precision hazard", "medium"),
    ("ops.softmax.keep_fp32=none.float32", {"dtype": "float32"}, "default differs", "low"),
    ("ops.matmul.mixed_float16.float32", {"dtype": "float32"}, "default differs", "low"),
    ("policy.mixed_float16", {"params": "float32", "compute": "float16", "output": "float16"}, "default differs",
     "medium"),
    ("policy.bf16-mixed", {"raised": "ValueError: Cannot convert 'bf16-mixed' to a DTypePolicy"},
     "API or format gap", "low"),
    ("scaler.floor", _scaler_obs("scaler.floor", min_scale=None), "scaler semantics", "medium"),
    ("scaler.ceiling", _scaler_obs("scaler.ceiling", max_scale=None), "scaler semantics", "medium"),
    ("scaler.hysteresis_2", _scaler_obs("scaler.hysteresis_2", hysteresis=1), "scaler semantics", "medium"),
    ("scaler.defaults", _scaler_obs("scaler.defaults", init_scale=2.0**15), "default differs", "low"),
    ("scaler.growth_on_nth_step", _scaler_obs("scaler.growth_on_nth_step", growth_interval=4), "default differs",
     "low"),
    ("scaler.backoff_0_3",  # the factor rounded another way: every scale off in its last bits
     {"scales": [v * (1 + 1e-7) for v in CASES["scaler.backoff_0_3"]["expected"]["scales"]], "skipped": 3},
     "scaler semantics", "low"),
    ("skip.adam.inf", {"changed": [True, True, True], "scale_halved": False}, "scaler semantics", "high"),
    ("portability.saves_neutral_format", {"state_dict": {"scale": 1024.0, "_growth_tracker": 2}},
     "API or format gap", "medium"),
    ("portability.resume_from_core", {"raised": "KeyError: 'growth_factor'"}, "API or format gap", "medium"),
]  # fmt: skip


def _data(rows: list[dict], backends=("torch",)) -> dict:
    ids = dict.fromkeys(r["case"] for r in rows)
    return {"mpx_version": mpx.__version__, "python": "3", "machine": "x86_64", "seconds": 1.0,
            "backends": {b: {"version": f"{b} 1", "device": "cpu", "seconds": 1.0} for b in backends},
            "cases": {i: {"group": CASES[i]["group"], "spec": CASES[i]["spec"], "params": CASES[i]["params"]}
                      for i in ids},
            "results": rows}  # fmt: skip


def _sample() -> dict:
    rows = []
    for case, observed, _, _ in DIVERGENCES:
        rows.append(_row(case, "torch", "native", "differs", observed))
        rows.append(_row(case, "torch", "mpx", "pass", CASES[case]["expected"]))
    rows.append(_row("scaler.static", "torch", "native", "skip", None))
    rows.append(_row("scaler.static", "torch", "mpx", "pass", CASES["scaler.static"]["expected"]))
    return _data(rows)


def _finding_of(found: list[dict], case: str) -> dict:
    (f,) = [f for f in found if case in f["cases"]]
    return f


@pytest.mark.parametrize("case,observed,kind,severity", DIVERGENCES, ids=[d[0] for d in DIVERGENCES])
def test_each_divergence_is_classified(case, observed, kind, severity):
    found = F.findings(_sample())
    f = _finding_of(found, case)
    assert (f["kind"], f["severity"], f["backend"]) == (kind, severity, "torch")
    assert f["explanation"].endswith(".") and len(f["explanation"]) > 40 and f["title"]


def test_findings_schema_and_every_divergence_in_exactly_one():
    data = _sample()
    found = F.findings(data)
    for f in found:
        assert {"kind", "severity", "backend", "cases", "explanation", "title"} <= set(f)
        assert f["kind"] in F.KINDS and f["severity"] in F.SEVERITIES and f["cases"]
    listed = [c for f in found for c in f["cases"]]
    assert sorted(listed) == sorted(d[0] for d in DIVERGENCES)
    assert [F.SEVERITIES.index(f["severity"]) for f in found] == sorted(
        F.SEVERITIES.index(f["severity"]) for f in found
    )
    hazard = _finding_of(found, "numerics.softmax.mixed_bfloat16")
    assert hazard["max_rel_error"] == 1.8e-3 and hazard["tolerance"] == C.OP_VALUE_TOL
    assert hazard["cases"] == ["ops.softmax.mixed_bfloat16.bfloat16", "numerics.softmax.mixed_bfloat16"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.booleans(), min_size=3, max_size=30),
    st.sampled_from(["min_scale", "max_scale", "hysteresis"]),
)
def test_trace_cause_names_the_missing_bound(flags, field):
    config = mpx.ScalerConfig(init_scale=4.0, growth_interval=2, max_scale=64.0, hysteresis=2).to_dict()
    change = {"min_scale": None, "max_scale": None, "hysteresis": 1}[field]
    observed = _trace(config, flags, **{field: change})
    cause = F.trace_cause(config, flags, observed)
    if observed == _trace(config, flags):
        assert cause == []  # the bound never mattered on this sequence
        return
    assert cause is not None and len(cause) == 1
    # the named change reproduces the trace exactly (another single change may explain it too)
    names = {n: ch for n, ch, _ in F._VARIANTS}
    assert _trace(config, flags, **names[cause[0]](config)) == observed


def test_report_json_has_findings_beside_results(tmp_path):
    data = _sample()
    report.write_all(data, tmp_path / "rep")
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert list(saved)[-2:] == ["results", "findings"]
    assert saved["findings"] == F.findings(_sample())
    plots = sorted((tmp_path / "rep" / "plots").iterdir())
    assert [p.name for p in plots] == ["numerics-torch.svg", "traces-torch.svg"]
    assert all(p.read_text().startswith("<svg xmlns='http://www.w3.org/2000/svg' ") for p in plots)


def test_html_and_markdown_show_values_as_text_and_mirror_each_other():
    data = _sample()
    page = report.html_report(data)
    md = report.markdown(data)
    h2 = re.findall(r"<h2>(.*?)</h2>", page)
    md2 = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert [re.sub(r" \(.*", "", h) for h in h2[:8]] == [re.sub(r" \(.*", "", h) for h in md2[:8]]
    assert h2[0] == "Summary per framework" and h2[1] == "Legend"
    assert (
        page.index("id='summary'")
        < page.index("id='legend'")
        < page.index("id='findings'")
        < page.index("id='plots'")
    )
    for text in ("≠ bfloat16", "≠ raises KeyError: 'growth_factor'", "✓ float32", "≠ error 0.0018",
                 "≠ diverges at step 3: 0.5 vs 1", "skip: "):  # fmt: skip
        assert text in page and text in md, text
    assert "title=" not in page.split("id='cases'")[1]  # no value only in a tooltip
    assert "…" not in page and "…" not in md
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and " src=" not in page and page.count("<svg") == 2
    assert "![torch: numerics error against tolerance](plots/numerics-torch.svg)" in md
    assert "native</b> means torch.autocast" in page and "Native means torch.autocast" in md


def test_scale_traces_are_aligned_step_by_step_in_full():
    data = _sample()
    page = report.html_report(data)
    section = page.split("id='traces'")[1].split("<code>scaler.floor</code>")[1].split("</table>")[0]
    spec, native = (
        CASES["scaler.floor"]["expected"]["scales"],
        _scaler_obs("scaler.floor", min_scale=None)["scales"],
    )
    rows = re.findall(r"<tr>(.*?)</tr>", section)
    assert len(rows) == 1 + len(spec)  # a header and every step
    for i, row in enumerate(rows[1:]):
        cells = re.findall(r"<td(?: class=diverge)?>(.*?)</td>", row)
        assert cells == [str(i + 1), "NO", f"{spec[i]:.9g}", f"{native[i]:.9g}"]
        assert ("class=diverge" in row) == (spec[i] != native[i])
    assert first_divergence(spec, native) == 2


def test_terminal_shows_the_matrix_and_one_line_per_finding():
    data = _sample()
    text = report.terminal(data)
    found = F.findings(_sample())
    assert "group" in text and "torch native" in text
    assert sum(1 for f in found if f["title"] in text) == len(found)
    assert "ops.softmax.mixed_bfloat16.bfloat16" not in text  # the case list stays in the files
    assert "1 skip" in text and "0✓" not in text


def test_a_failed_write_keeps_the_earlier_report(tmp_path):
    out = tmp_path / "rep"
    report.write_all(_sample(), out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    broken = _sample()
    broken["results"].append(
        {"case": "worker", "group": "worker", "backend": "torch", "mode": "mpx"}
    )  # no status
    with pytest.raises(KeyError):
        report.write_all(broken, out)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # no staging folder left behind


def test_prepare_out_refuses_what_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        report.prepare_out(tmp_path / "file")
    with pytest.raises(OSError):
        report.prepare_out(tmp_path / "file" / "sub")


#: The sample's finding titles, pinned when ``_explain`` became the table ``F.TEXTS`` (#22).
SAMPLE_TITLES = [
    "torch autocast computes softmax in bfloat16: 2 cases, max rel. error 1.8e-03 (tolerance 1e-05)",
    "torch autocast computes layer_norm in float16: 1 case",
    "torch.amp.GradScaler: a step with inf/NaN gradients is applied, not skipped: 1 case",
    "torch autocast rounds float32 inputs or operands to half in add: 1 case",
    "torch.amp.GradScaler: no floor: 1 trace",
    "torch.amp.GradScaler: no ceiling: 1 trace",
    "torch.amp.GradScaler: no hysteresis: 1 trace",
    "torch autocast models return the compute dtype, not float32: 1 policy",
    "torch.amp.GradScaler saves its own state format (_growth_tracker, scale)",
    "torch.amp.GradScaler cannot resume from the neutral mpx.scaler/1 state: 1 case",
    "torch.amp.GradScaler rounds its factors differently: 1 trace",
    "torch autocast runs softmax, matmul in float32 where the policy asks for half: 2 cases",
    "torch.amp.GradScaler: initial scale halved: 1 trace",
    "torch.amp.GradScaler: growth one step later: 1 trace",
    "torch autocast cannot parse 1 policy names (bf16-mixed)",
]


def test_finding_texts_are_the_table_filled_in():
    found = F.findings(_sample())
    assert [f["title"] for f in found] == SAMPLE_TITLES
    floor = _finding_of(found, "scaler.floor")
    assert (
        floor["explanation"]
        == "It has no min_scale: overflows keep halving the scale: " + F.CONSEQUENCES["no floor"] + "."
    )
    assert set(F.CONSEQUENCES) == {name for name, _, _ in F._VARIANTS}
    assert all(subject in F.SUBJECTS for subject, _, _ in F.TEXTS.values())


def test_policies_are_counted_in_words():
    ids = [i for i in CASES if i.startswith("policy.")][:11]
    rows = [
        _row(i, "tf", "native", "differs", {"params": "float32", "compute": "float16", "output": "float16"})
        for i in ids
    ]
    assert F._explain("tf", "default differs", "policy-output", rows[:1])[0].endswith(": 1 policy")
    assert F._explain("tf", "default differs", "policy-output", rows)[0].endswith(
        ": 11 policies"
    )  # was "11 policyies"
    other = F._explain("tf", "default differs", "other:models", rows[:2])
    assert other[0] == "Keras: 2 other divergences in policy" and other[2] == {}


STUCK = "scaler.stuck.gradients_at_min_scale"
ERROR = {"detail": "KeyError: 'policy'", "at": "conformance/adapters/torch.py:114 in run_op"}


def _with_errors_and_stuck() -> dict:
    """The sample, plus both stuck cases (one fails under mpx) and a case whose adapter crashed in both modes."""
    rows = _sample()["results"]
    rows.append({**_row(STUCK, "torch", "native", "skip", None), "detail": "no stuck detection"})
    rows.append(_row(STUCK, "torch", "mpx", "pass", CASES[STUCK]["expected"]))
    rows.append(
        _row("scaler.stuck.nonfinite_loss", "torch", "mpx", "fail", {"raised_at": None, "cause": None})
    )
    for mode in ("native", "mpx"):
        rows.append({**_row("ops.exp.mixed_float16.float16", "torch", mode, "error", None), **ERROR})
    return _data(rows)


def test_an_adapter_error_is_shown_as_such_and_never_a_finding():
    data = _with_errors_and_stuck()
    assert F.findings(data) == F.findings(_sample())  # errors add no finding and change none
    assert report.mpx_passes(_sample()) and not report.mpx_passes(data)
    crashed = {**_row("ops.exp.mixed_float16.float16", "torch", "mpx", "error", None), **ERROR}
    assert not report.mpx_passes(_data([crashed])) and report.mpx_passes(
        _data([{**crashed, "mode": "native"}])
    )
    assert "mpx failures: 0 (none, but 1 mpx result errored (below))" in report.terminal(_data([crashed]))
    assert "none, but 1 mpx result errored (below)." in report.markdown(_data([crashed]))
    cell = "error: KeyError: 'policy' (at conformance/adapters/torch.py:114 in run_op)"
    text, md, page = report.terminal(data), report.markdown(data), report.html_report(data)
    (ops_line,) = [line for line in text.splitlines() if line.startswith("ops ")]
    assert ops_line.split()[1:] == ["5≠", "1", "error", "5✓", "1", "error"]
    assert "adapter errors: 2 (the adapter crashed; not judged)" in text
    assert f"torch native ops.exp.mixed_float16.float16: {cell}" in " ".join(text.split())
    assert "| ops | 5≠ 1 error | 5✓ 1 error |" in md and "## Adapter errors (2)" in md
    assert f"- `torch` mpx `ops.exp.mixed_float16.float16`: {cell}" in md
    assert "<h2>Adapter errors (2)</h2>" in page and "<td class='error'>5≠ 1 error</td>" in page
    assert page.count(f"<td class='error'> {html.escape(cell, quote=False)}</td>") == 2
    assert f"| `ops.exp.mixed_float16.float16` | {CASES['ops.exp.mixed_float16.float16']['spec']}" in md
    assert md.count(cell) == 4  # the case table and the error list


def test_every_case_cell_is_text_not_json():
    data = _with_errors_and_stuck()
    page, md = report.html_report(data), report.markdown(data)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", page.split("id='cases'")[1])
    md_cells = [c.strip() for line in md.split("## Cases")[1].splitlines() if line.startswith("| `")
                for c in line.split(" | ")[2:]]  # fmt: skip
    assert cells and md_cells
    for text in cells + md_cells:
        assert "{" not in text and '"' not in text, text
    (stuck,) = [line for line in md.splitlines() if line.startswith(f"| `{STUCK}`")]
    assert stuck.split(" | ")[2:] == ["stuck at step 5: gradients overflow at min_scale", "skip: no stuck detection",
                                      "✓ stuck at step 5: gradients overflow at min_scale |"]  # fmt: skip
    assert "✗ never stuck" in md and "✗ never stuck" in page
    assert "stuck at step 3: the loss is non-finite" in page
    assert results.fmt({"a": [1, 2.5], "b": True, "c": None}) == "a 1, 2.5; b yes; c -"
