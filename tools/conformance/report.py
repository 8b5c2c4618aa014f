"""Reports of a conformance run: the terminal summary, report.json, report.md, and report.html
(:mod:`conformance.report_html`), written together by :func:`write_all`.

The HTML and the Markdown have the same sections, in this order: a per-framework summary, a legend,
the result matrix, mpx failures, adapter errors (status ``error``: the adapter crashed, nothing
judged), the findings (every native divergence, classified by
:mod:`conformance.findings`), the plots (:mod:`conformance.plots`), the scale traces aligned step
by step, and one table per group whose cells show the observed value as text; what they show is
computed once, in :mod:`conformance.results`.  The terminal shows the matrix and one line per
finding; the full lists stay in the files.  The HTML is self-contained (inline CSS and SVG, no
script, no external resource); the Markdown links the same SVGs, written to ``plots/``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from conformance import findings as F
from conformance import plots
from conformance import results as R
from conformance.agreement import keras_traces, keras_traces_line
from conformance.report_html import html_report
from conformance.results import STATUSES, counts, errors, mpx_passes

__all__ = [
    "STATUSES",
    "counts",
    "errors",
    "html_report",
    "markdown",
    "mpx_passes",
    "prepare_out",
    "terminal",
    "write_all",
]


def terminal(data: dict) -> str:
    """The matrix, one line per finding (most severe first) and the mpx failures."""
    cols = R.columns(data)
    table = R.counts(data)
    width = max(12, *(len(g) for g in R.groups(data)))
    col = max(16, *(len(b) + len(m) + 1 for b, m in cols)) if cols else 16
    head = f"{'group':<{width}} " + " ".join(f"{b + ' ' + m:>{col}}" for b, m in cols)
    lines = ["", "conformance (✓ pass, ≠ differs from the mpx spec, ✗ fail, N skip: not applicable, N error: "
             "the adapter crashed)", head,
             "-" * len(head)]  # fmt: skip
    for g in R.groups(data):
        lines.append(f"{g:<{width}} " + " ".join(f"{R.cell(table[(g, b, m)]):>{col}}" for b, m in cols))
    for backend, meta in data["backends"].items():
        lines.append(f"  {backend}: {R.backend_line(backend, meta)}")
    agreement = keras_traces(data)
    if agreement:
        lines.append(f"  {keras_traces_line(agreement)}")
    name = max(5, *(len(b) for b in data["backends"])) if data["backends"] else 5
    found = R.run_findings(data)
    lines += ["", f"findings: {len(R.divergences(data))} native divergences in {len(found)} findings "
              "(severity, backend, finding; the cases and what each means are in the reports)"]  # fmt: skip
    for f in found:
        lines.append(f"  {f['severity']:<6} {f['backend']:<{name}} {f['title']}")
    fails = R.failures(data)
    lines.append("")
    lines.append(f"mpx failures: {len(fails)}" + ("" if fails else f" ({R.none_failed(data)})"))
    for r in fails:
        lines.append(f"  {r['backend']:<{name}} {r['case']}: {r['detail'] or R.observed(r)}")
    crashed = R.errors(data)
    if crashed:
        lines += ["", f"adapter errors: {len(crashed)} (the adapter crashed; not judged)"]
        lines += [f"  {r['backend']:<{name}} {r['mode']:<6} {r['case']}: {R.observed(r)}" for r in crashed]
    return "\n".join(lines)


# -- Markdown --------------------------------------------------------------------------------------


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(data: dict, plot_dir: str = "plots") -> str:
    """``report.md``: the sections of the HTML; plots are linked from ``plot_dir``."""
    cols = R.columns(data)
    table = R.counts(data)
    found = R.run_findings(data)
    out = ["# mpx conformance report", "",
           f"mpx {data['mpx_version']}, Python {data['python']} on {data['machine']}, {data['seconds']}s.", "",
           "## Summary per framework", ""]  # fmt: skip
    for backend, s in F.summary(data, found).items():
        meta = data["backends"][backend]
        out.append(f"### {backend}: {R.backend_line(backend, meta)}")
        out.append("")
        out.append(f"Native means {s['native']}. Native: {R.cell(Counter(s['counts']['native']))}; "
                   f"mpx: {R.cell(Counter(s['counts']['mpx']))}. Findings: "
                   + ", ".join(f"{n} {sev}" for sev, n in s["by_severity"].items()) + ".")  # fmt: skip
        out.append("")
        out += [f"- {t}" for t in s["findings"]] or ["- no native divergence"]
        out.append("")
    if keras_traces(data):
        out += [keras_traces_line(keras_traces(data)) + ".", ""]
    out += ["## Legend", ""]
    out += [f"- `{R.legend_key(k)}`: {v}" for k, v in R.LEGEND.items()]
    out += [f"- severity **{k}**: {v}" for k, v in F.SEVERITY_HELP.items()]
    out += [f"- kind **{k}**: {v}" for k, v in F.KIND_HELP.items()]
    out += ["- **native**: the framework's own mixed-precision machinery and defaults; **mpx**: the same case "
            "through mpx.", ""]  # fmt: skip
    out += ["## Results", "", "| group | " + " | ".join(f"{b} {m}" for b, m in cols) + " |"]
    out.append("|---|" + "---|" * len(cols))
    for g in R.groups(data):
        out.append(f"| {g} | " + " | ".join(R.cell(table[(g, b, m)]) for b, m in cols) + " |")
    fails = R.failures(data)
    out += ["", f"## mpx failures ({len(fails)})", ""]
    out += [f"- `{r['backend']}` `{r['case']}`: {r['detail']}" for r in fails] or [R.none_failed(data) + "."]
    crashed = R.errors(data)
    out += ["", f"## Adapter errors ({len(crashed)})", ""]
    out += [
        f"- `{r['backend']}` {r['mode']} `{r['case']}`: {_md_escape(R.observed(r))}" for r in crashed
    ] or ["none: every adapter ran every case."]
    out += ["", f"## Findings ({len(found)}, covering {len(R.divergences(data))} native divergences)", "",
            "| severity | kind | backend | finding | what it means | cases |", "|---|---|---|---|---|---|"]  # fmt: skip
    for f in found:
        out.append(f"| {f['severity']} | {f['kind']} | {f['backend']} | {_md_escape(f['title'])} | "
                   f"{_md_escape(f['explanation'])} | {', '.join(f'`{c}`' for c in f['cases'])} |")  # fmt: skip
    out += ["", "## Plots", ""]
    out += [f"![{caption}]({plot_dir}/{name})" for name, caption, _ in R.plot_svgs(data)]
    out += ["", "## Scale traces, aligned by step", "",
            "Each row is one step; cells that differ from the spec are **bold**."]  # fmt: skip
    for case, head, rows, marks in R.aligned_traces(data):
        out += ["", f"### `{case}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for cells, flags in zip(rows, marks, strict=True):
            out.append(
                "| " + " | ".join(f"**{c}**" if m else c for c, m in zip(cells, flags, strict=True)) + " |"
            )
    specs = data.get("cases", {})
    out += ["", "## Cases", "", "Each cell: status and what was observed."]
    for g, rows_ in R.by_case(data).items():
        out += [
            "",
            f"### {g}",
            "",
            "| case | spec | expected | " + " | ".join(f"{b} {m}" for b, m in cols) + " |",
        ]
        out.append("|---|---|---|" + "---|" * len(cols))
        for case, row in rows_.items():
            ref = next(iter(row.values()))
            cells = [f"{R.SYMBOL.get(r['status'], '')} {R.observed(r)}".strip() if (r := row.get(c)) else "-"
                     for c in cols]  # fmt: skip
            out.append(f"| `{case}` | {_md_escape(specs.get(case, {}).get('spec', ''))} | "
                       f"{_md_escape(R.fmt(ref['expected']))} | " + " | ".join(map(_md_escape, cells)) + " |")  # fmt: skip
    return "\n".join(out) + "\n"


# -- writing ---------------------------------------------------------------------------------------


def prepare_out(out: Path) -> Path:
    """Check that ``out`` can be written (creating its parent) and return a staging folder beside it.

    Raises:
        OSError: when ``out`` exists and is not a folder, is a folder holding files but no report.json
            (``--out .`` must not replace the current folder), or its parent cannot be created or written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "report.json").exists():
        raise FileExistsError(f"{out} is a folder with other files (no report.json): it would be replaced; "
                              "name a new or empty folder")  # fmt: skip
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.absolute().parent))


def write_all(data: dict, out: Path, staging: Path | None = None) -> None:
    """Write report.json, report.md, report.html and plots/ into ``out``, atomically.

    Everything is written into ``staging`` (a folder beside ``out``, see :func:`prepare_out`) first;
    only then is the old ``out`` moved aside and the new one renamed into place, so a run that fails
    while writing leaves the previous report as it was.
    """
    out = Path(out)
    staging = staging or prepare_out(out)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private
        data["findings"] = F.findings(data)
        (staging / "report.json").write_text(json.dumps(data, indent=1, default=str))
        (staging / "report.md").write_text(markdown(data))
        (staging / "report.html").write_text(html_report(data))
        (staging / "plots").mkdir(exist_ok=True)
        for name, _, svg in R.plot_svgs(data):
            (staging / "plots" / name).write_text(plots.standalone(svg))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.absolute().parent))
        os.replace(out, old / out.name)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
