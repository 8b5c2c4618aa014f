"""Reports of a conformance run: the terminal summary, report.json, report.md, report.html.

The HTML and the Markdown have the same sections, in this order: a per-framework summary, a legend,
the result matrix, mpx failures, adapter errors (status ``error``: the adapter crashed, nothing
judged), the findings (every native divergence, classified by
:mod:`conformance.findings`), the plots (:mod:`conformance.plots`), the scale traces aligned step
by step, and one table per group whose cells show the observed value as text.  The terminal shows
the matrix and one line per finding; the full lists stay in the files.  The HTML is self-contained
(inline CSS and SVG, no script, no external resource); the Markdown links the same SVGs, written
to ``plots/``.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from conformance import findings as F
from conformance import plots
from conformance.agreement import TRACE_GROUPS, keras_traces, keras_traces_line
from conformance.cases import GROUPS

__all__ = [
    "STATUSES",
    "errors",
    "html_report",
    "markdown",
    "mpx_passes",
    "prepare_out",
    "terminal",
    "write_all",
]

STATUSES = ("pass", "differs", "fail", "skip", "error")
_SYMBOL = {"pass": "✓", "differs": "≠", "fail": "✗"}
_LEGEND = {
    "pass": "meets the mpx spec",
    "differs": "natively only: the framework does not do what the spec says (a finding, not an error)",
    "fail": "under mpx only: mpx does not meet its own spec (a bug; the exit status is 1)",
    "skip": "not applicable (the reason is in the case table)",
    "error": "the adapter running the case crashed, so nothing was judged: not a finding against the "
    "framework; under mpx the exit status is 1 (the exception is in the case table)",
}


def _legend_key(status: str) -> str:
    return f"{_SYMBOL[status]} {status}" if status in _SYMBOL else f"N {status}"


def _columns(data: dict) -> list[tuple[str, str]]:
    return [(b, m) for b in data["backends"] for m in ("native", "mpx")]


def counts(data: dict) -> dict[tuple[str, str, str], Counter]:
    """(group, backend, mode) -> Counter of statuses."""
    out: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for r in data["results"]:
        out[(r["group"], r["backend"], r["mode"])][r["status"]] += 1
    return out


def _cell(c: Counter) -> str:
    """``136✓ 42≠ 15 skip 1 error``: only the counts that are not zero; skips and errors spelled out."""
    if not c:
        return "-"
    parts = [f"{c[s]}{_SYMBOL[s]}" for s in ("pass", "differs", "fail") if c[s]]
    parts += [f"{c[s]} {s}" for s in ("skip", "error") if c[s]]
    return " ".join(parts)


def _groups(data: dict) -> list[str]:
    present = {r["group"] for r in data["results"]}
    return [g for g in (*GROUPS, "worker") if g in present]


def _fmt(value: Any) -> str:
    """A compact text form of an expected or observed value (never truncated)."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        if set(value) == {"dtype"}:
            return str(value["dtype"])
        if "raised" in value:
            return "raises " + F._error_line(str(value["raised"]))
        if "max_rel_error" in value:
            return f"error {_fmt(value['max_rel_error'])}"
        if "max_rel_error_at_most" in value:
            return f"error <= {value['max_rel_error_at_most']:g}"
        if set(value) >= {"params", "compute", "output"}:
            return f"{value['params']}/{value['compute']}/{value['output']}"
        if "consistent" in value and "scales" in value:  # distributed: replicas, applied steps, scale trace
            agree = "replicas agree" if value["consistent"] else "replicas DIVERGE"
            return (f"{agree}; applied {_yn(value.get('applied'))}; scales {_scales(value['scales'])}"
                    + ("" if value.get("params_finite", True) else "; parameters inf/NaN"))  # fmt: skip
        if "micro_scales" in value and "scales" in value:  # accumulation: per optimizer step
            param = value.get("param")
            return (f"applied {_yn(value.get('applied'))}; scales {_scales(value['scales'])}"
                    + (f"; w {param:g}" if isinstance(param, float) else ""))  # fmt: skip
        if "scales" in value:
            extra = f", {value['skipped']} skipped" if "skipped" in value else ""
            last = _scale(value["scales"][-1]) if value["scales"] else "-"
            return f"{len(value['scales'])} steps, last {last}{extra}"
        if "changed" in value:
            return (
                "changed "
                + "".join("Y" if c else "n" for c in value["changed"])
                + (", scale halved" if value.get("scale_halved") else ", scale kept")
            )
        if "state_dict" in value:
            sd = value["state_dict"] or {}
            return str(sd.get("format") or "keys " + ", ".join(sorted(sd)))
        if set(value) == {"raised_at", "cause"}:  # scaler.stuck: the step that raises ScalerStuckError
            if value["raised_at"] is None:
                return "never stuck"
            why = _STUCK_CAUSE.get(value["cause"], str(value["cause"]))
            return f"stuck at step {value['raised_at']}: {why}"
        return "; ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


#: What the cause of a ``scaler.stuck`` case means (:func:`conformance.cases.stuck_cause`).
_STUCK_CAUSE = {"min_scale": "gradients overflow at min_scale", "loss": "the loss is non-finite",
                "other": "another cause"}  # fmt: skip


#: groups whose results carry a scale trace (one value per optimizer step) to align and plot
def _scale(v: float) -> str:
    return f"{v:.9g}"


def _yn(flags: Any) -> str:
    return "".join("Y" if f else "n" for f in flags) if isinstance(flags, list) else "-"


def _scales(scales: list) -> str:
    return " ".join(_scale(v) for v in scales)


def _observed(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] == "skip":
        return "skip: " + (r.get("detail") or "")
    if r["status"] == "error":
        return "error: " + (r.get("detail") or "") + (f" (at {r['at']})" if r.get("at") else "")
    text = _fmt(r.get("observed"))
    grouped = r.get("group") in ("distributed", "accumulation")  # their text already shows the whole trace
    if (
        not grouped
        and r["status"] == "differs"
        and isinstance(r.get("observed"), dict)
        and "scales" in r["observed"]
    ):
        at = plots.first_divergence(r["expected"].get("scales", []), r["observed"]["scales"])
        if at is not None:
            obs, exp = r["observed"]["scales"], r["expected"]["scales"]
            text = (f"diverges at step {at + 1}: {_scale(obs[at]) if at < len(obs) else 'no step'} "
                    f"vs {_scale(exp[at]) if at < len(exp) else 'no step'}")  # fmt: skip
    return text


def divergences(data: dict) -> list[dict]:
    return [r for r in data["results"] if r["mode"] == "native" and r["status"] == "differs"]


def failures(data: dict) -> list[dict]:
    return [r for r in data["results"] if r["mode"] == "mpx" and r["status"] == "fail"]


def errors(data: dict) -> list[dict]:
    """Results whose adapter crashed (status ``error``), in both modes."""
    return [r for r in data["results"] if r["status"] == "error"]


def mpx_passes(data: dict) -> bool:
    """Whether every mpx result passes or is skipped: no ``fail`` and no ``error`` (exit status 0)."""
    return not any(r["mode"] == "mpx" and r["status"] in ("fail", "error") for r in data["results"])


def _none_failed(data: dict) -> str:
    mpx_errors = sum(1 for r in errors(data) if r["mode"] == "mpx")
    if not mpx_errors:
        return "none: every mpx result passes"
    return f"none, but {mpx_errors} mpx result{'s' if mpx_errors != 1 else ''} errored (below)"


def _findings(data: dict) -> list[dict]:
    if "findings" not in data:
        data["findings"] = F.findings(data)
    return data["findings"]


def _backend_line(backend: str, meta: dict) -> str:
    if meta.get("skipped"):
        return meta["skipped"]
    line = f"{meta.get('version')} on {meta.get('device')}, {meta.get('seconds')}s"
    if meta.get("mpx_free") is True:
        line += "; native ran with nothing of mpx loaded"
    elif meta.get("mpx_free") is False:
        line += "; native run LOADED mpx: see report.json"
    return line


def terminal(data: dict) -> str:
    """The matrix, one line per finding (most severe first) and the mpx failures."""
    cols = _columns(data)
    table = counts(data)
    width = max(12, *(len(g) for g in _groups(data)))
    col = max(16, *(len(b) + len(m) + 1 for b, m in cols)) if cols else 16
    head = f"{'group':<{width}} " + " ".join(f"{b + ' ' + m:>{col}}" for b, m in cols)
    lines = ["", "conformance (✓ pass, ≠ differs from the mpx spec, ✗ fail, N skip: not applicable, N error: "
             "the adapter crashed)", head,
             "-" * len(head)]  # fmt: skip
    for g in _groups(data):
        lines.append(f"{g:<{width}} " + " ".join(f"{_cell(table[(g, b, m)]):>{col}}" for b, m in cols))
    for backend, meta in data["backends"].items():
        lines.append(f"  {backend}: {_backend_line(backend, meta)}")
    agreement = keras_traces(data)
    if agreement:
        lines.append(f"  {keras_traces_line(agreement)}")
    name = max(5, *(len(b) for b in data["backends"])) if data["backends"] else 5
    found = _findings(data)
    lines += ["", f"findings: {len(divergences(data))} native divergences in {len(found)} findings "
              "(severity, backend, finding; the cases and what each means are in the reports)"]  # fmt: skip
    for f in found:
        lines.append(f"  {f['severity']:<6} {f['backend']:<{name}} {f['title']}")
    fails = failures(data)
    lines.append("")
    lines.append(f"mpx failures: {len(fails)}" + ("" if fails else f" ({_none_failed(data)})"))
    for r in fails:
        lines.append(f"  {r['backend']:<{name}} {r['case']}: {r['detail'] or _observed(r)}")
    crashed = errors(data)
    if crashed:
        lines += ["", f"adapter errors: {len(crashed)} (the adapter crashed; not judged)"]
        lines += [f"  {r['backend']:<{name}} {r['mode']:<6} {r['case']}: {_observed(r)}" for r in crashed]
    return "\n".join(lines)


# -- data the HTML and Markdown share --------------------------------------------------------------


def _by_case(data: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in data["results"]:
        out[r["group"]].setdefault(r["case"], {})[(r["backend"], r["mode"])] = r
    return out


def _numerics_rows(data: dict, backend: str) -> list[tuple[str, float, float | None, float | None]]:
    rows = []
    for case, row in _by_case(data).get("numerics", {}).items():
        native, mine = row.get((backend, "native")), row.get((backend, "mpx"))
        ref = native or mine
        if ref is None:
            continue
        tol = ref["expected"].get("max_rel_error_at_most")

        def err(r: dict | None) -> float | None:
            obs = (r or {}).get("observed")
            return obs.get("max_rel_error") if isinstance(obs, dict) else None

        if tol is not None and (err(native) is not None or err(mine) is not None):
            rows.append((case, tol, err(native), err(mine)))
    return rows


def _trace_rows(data: dict, backend: str) -> list[tuple[str, list[float], list[float] | None]]:
    rows = []
    for g in TRACE_GROUPS:
        for case, row in _by_case(data).get(g, {}).items():
            r = row.get((backend, "native"))
            spec = (row.get((backend, "mpx")) or r or {}).get("expected", {})
            if not isinstance(spec, dict) or "scales" not in spec:
                continue
            obs = (r or {}).get("observed")
            native = (
                obs.get("scales") if isinstance(obs, dict) and isinstance(obs.get("scales"), list) else None
            )
            if native is not None or (r and r["status"] != "skip"):
                rows.append((case, spec["scales"], native))
    return rows


def _plot_svgs(data: dict) -> list[tuple[str, str, str]]:
    """(file name, caption, svg) of every plot."""
    out = []
    for b, meta in data["backends"].items():
        if meta.get("skipped"):
            continue
        rows = _numerics_rows(data, b)
        if rows:
            out.append(
                (f"numerics-{b}.svg", f"{b}: numerics error against tolerance", plots.numerics_svg(b, rows))
            )
    for b, meta in data["backends"].items():
        if meta.get("skipped"):
            continue
        rows = _trace_rows(data, b)
        if rows:
            out.append((f"traces-{b}.svg", f"{b}: scale traces, native vs spec", plots.traces_svg(b, rows)))
    return out


def _aligned_traces(data: dict) -> list[tuple[str, list[str], list[list[str]], list[list[bool]]]]:
    """Per trace case with a native divergence: (case, header, rows, diverging flags) aligned by step."""
    specs = data.get("cases", {})
    out = []
    for g in TRACE_GROUPS:
        for case, row in _by_case(data).get(g, {}).items():
            natives = {b: row.get((b, "native")) for b in data["backends"]}
            traces = {b: r["observed"]["scales"] for b, r in natives.items()
                      if r and isinstance(r.get("observed"), dict) and isinstance(r["observed"].get("scales"), list)}  # fmt: skip
            ref = next(
                (
                    r
                    for r in row.values()
                    if isinstance(r.get("expected"), dict) and "scales" in r["expected"]
                ),
                None,
            )
            if ref is None or not any(natives[b] and natives[b]["status"] == "differs" for b in traces):
                continue
            spec = ref["expected"]["scales"]
            params = specs.get(case, {}).get("params") or {}
            flags = params.get("flags")
            if flags and params.get("steps"):  # accumulation: one row per optimizer step (window)
                k = params["steps"]
                flags = [all(flags[i : i + k]) for i in range(0, len(flags), k)]
            n = max(len(spec), *(len(t) for t in traces.values()))
            head = ["step", "finite", "spec", *(f"{b} native" for b in traces)]
            rows, marks = [], []
            for i in range(n):
                cells = [str(i + 1), "-" if not flags or i >= len(flags) else ("yes" if flags[i] else "NO"),
                         _scale(spec[i]) if i < len(spec) else "-"]  # fmt: skip
                flagged = [False, False, False]
                for t in traces.values():
                    v = t[i] if i < len(t) else None
                    cells.append("-" if v is None else _scale(v))
                    flagged.append(i >= len(spec) or v != spec[i])
                rows.append(cells)
                marks.append(flagged)
            out.append((case, head, rows, marks))
    return out


# -- Markdown --------------------------------------------------------------------------------------


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(data: dict, plot_dir: str = "plots") -> str:
    """``report.md``: the sections of the HTML; plots are linked from ``plot_dir``."""
    cols = _columns(data)
    table = counts(data)
    found = _findings(data)
    out = ["# mpx conformance report", "",
           f"mpx {data['mpx_version']}, Python {data['python']} on {data['machine']}, {data['seconds']}s.", "",
           "## Summary per framework", ""]  # fmt: skip
    for backend, s in F.summary(data, found).items():
        meta = data["backends"][backend]
        out.append(f"### {backend}: {_backend_line(backend, meta)}")
        out.append("")
        out.append(f"Native means {s['native']}. Native: {_cell(Counter(s['counts']['native']))}; "
                   f"mpx: {_cell(Counter(s['counts']['mpx']))}. Findings: "
                   + ", ".join(f"{n} {sev}" for sev, n in s["by_severity"].items()) + ".")  # fmt: skip
        out.append("")
        out += [f"- {t}" for t in s["findings"]] or ["- no native divergence"]
        out.append("")
    if keras_traces(data):
        out += [keras_traces_line(keras_traces(data)) + ".", ""]
    out += ["## Legend", ""]
    out += [f"- `{_legend_key(k)}`: {v}" for k, v in _LEGEND.items()]
    out += [f"- severity **{k}**: {v}" for k, v in F.SEVERITY_HELP.items()]
    out += [f"- kind **{k}**: {v}" for k, v in F.KIND_HELP.items()]
    out += ["- **native**: the framework's own mixed-precision machinery and defaults; **mpx**: the same case "
            "through mpx.", ""]  # fmt: skip
    out += ["## Results", "", "| group | " + " | ".join(f"{b} {m}" for b, m in cols) + " |"]
    out.append("|---|" + "---|" * len(cols))
    for g in _groups(data):
        out.append(f"| {g} | " + " | ".join(_cell(table[(g, b, m)]) for b, m in cols) + " |")
    fails = failures(data)
    out += ["", f"## mpx failures ({len(fails)})", ""]
    out += [f"- `{r['backend']}` `{r['case']}`: {r['detail']}" for r in fails] or [_none_failed(data) + "."]
    crashed = errors(data)
    out += ["", f"## Adapter errors ({len(crashed)})", ""]
    out += [f"- `{r['backend']}` {r['mode']} `{r['case']}`: {_md_escape(_observed(r))}" for r in crashed] or [
        "none: every adapter ran every case."
    ]
    out += ["", f"## Findings ({len(found)}, covering {len(divergences(data))} native divergences)", "",
            "| severity | kind | backend | finding | what it means | cases |", "|---|---|---|---|---|---|"]  # fmt: skip
    for f in found:
        out.append(f"| {f['severity']} | {f['kind']} | {f['backend']} | {_md_escape(f['title'])} | "
                   f"{_md_escape(f['explanation'])} | {', '.join(f'`{c}`' for c in f['cases'])} |")  # fmt: skip
    out += ["", "## Plots", ""]
    out += [f"![{caption}]({plot_dir}/{name})" for name, caption, _ in _plot_svgs(data)]
    out += ["", "## Scale traces, aligned by step", "",
            "Each row is one step; cells that differ from the spec are **bold**."]  # fmt: skip
    for case, head, rows, marks in _aligned_traces(data):
        out += ["", f"### `{case}`", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for cells, flags in zip(rows, marks, strict=True):
            out.append(
                "| " + " | ".join(f"**{c}**" if m else c for c, m in zip(cells, flags, strict=True)) + " |"
            )
    specs = data.get("cases", {})
    out += ["", "## Cases", "", "Each cell: status and what was observed."]
    for g, rows_ in _by_case(data).items():
        out += [
            "",
            f"### {g}",
            "",
            "| case | spec | expected | " + " | ".join(f"{b} {m}" for b, m in cols) + " |",
        ]
        out.append("|---|---|---|" + "---|" * len(cols))
        for case, row in rows_.items():
            ref = next(iter(row.values()))
            cells = [f"{_SYMBOL.get(r['status'], '')} {_observed(r)}".strip() if (r := row.get(c)) else "-"
                     for c in cols]  # fmt: skip
            out.append(f"| `{case}` | {_md_escape(specs.get(case, {}).get('spec', ''))} | "
                       f"{_md_escape(_fmt(ref['expected']))} | " + " | ".join(map(_md_escape, cells)) + " |")  # fmt: skip
    return "\n".join(out) + "\n"


# -- HTML ------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1280px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.pass{background:#e6f4ea}.differs{background:#fff4d6}.fail{background:#fbe0e0;font-weight:bold}
.error{background:#e9d8fd;font-weight:bold}
.skip{color:#777}code{font-size:12px}details{margin:.3em 0}summary{cursor:pointer;font-weight:600}
.cards{display:flex;gap:1em;flex-wrap:wrap}.card{border:1px solid #ccc;border-radius:6px;padding:.6em 1em;flex:1 1 360px}
.card h3{margin:.1em 0 .3em}.card ul{margin:.3em 0;padding-left:1.2em}.sev{font-weight:600;padding:0 .4em;border-radius:3px}
.sev-high{background:#c53030;color:#fff}.sev-medium{background:#dd6b20;color:#fff}.sev-low{background:#cbd5e0}
td.diverge{background:#fbd38d;font-weight:600}.plot{display:block;margin:.5em 0 1em;max-width:100%;height:auto}
dl.legend{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dl.legend dt{font-weight:600}
"""


def _sev(s: str) -> str:
    return f"<span class='sev sev-{s}'>{s}</span>"


def html_report(data: dict) -> str:
    """``report.html``: self-contained (inline CSS and SVG; no script)."""

    def e(text: Any) -> str:
        return html.escape(str(text), quote=False)

    cols = _columns(data)
    table = counts(data)
    found = _findings(data)
    p = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>mpx conformance</title>"
         f"<style>{_CSS}</style></head><body>", "<h1>mpx conformance report</h1>",
         f"<p>mpx {e(data['mpx_version'])}, Python {e(data['python'])} on {e(data['machine'])}, "
         f"{data['seconds']}s.</p>"]  # fmt: skip
    p.append("<section id='summary'><h2>Summary per framework</h2><div class='cards'>")
    for backend, s in F.summary(data, found).items():
        meta = data["backends"][backend]
        sev = " ".join(f"{_sev(k)} {n}" for k, n in s["by_severity"].items())
        p.append(f"<div class='card' id='summary-{e(backend)}'><h3>{e(backend)}</h3>"
                 f"<p>{e(_backend_line(backend, meta))}<br><b>native</b> means {e(s['native'])}.<br>"
                 f"native: {e(_cell(Counter(s['counts']['native'])))}; mpx: {e(_cell(Counter(s['counts']['mpx'])))}"
                 f"<br>findings: {sev}</p><ul>"
                 + "".join(f"<li>{_sev(f['severity'])} {e(f['title'])}</li>" for f in found if f["backend"] == backend)
                 + ("" if s["findings"] else "<li>no native divergence</li>") + "</ul></div>")  # fmt: skip
    p.append("</div>")
    if keras_traces(data):
        p.append(f"<p id='keras-traces'>{e(keras_traces_line(keras_traces(data)))}.</p>")
    p.append("</section>")
    p.append("<section id='legend'><h2>Legend</h2><dl class='legend'>")
    for k, v in _LEGEND.items():
        p.append(f"<dt class='{k}'>{e(_legend_key(k))}</dt><dd>{e(v)}</dd>")
    for k, v in F.SEVERITY_HELP.items():
        p.append(f"<dt>{_sev(k)}</dt><dd>{e(v)}</dd>")
    for k, v in F.KIND_HELP.items():
        p.append(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>")
    p.append("<dt>native / mpx</dt><dd>native: the framework's own mixed-precision machinery and defaults "
             "(per framework above); mpx: the same case through mpx</dd></dl></section>")  # fmt: skip
    p.append("<section id='results'><h2>Results</h2><table><tr><th>group</th>"
             + "".join(f"<th>{e(b)} {m}</th>" for b, m in cols) + "</tr>")  # fmt: skip
    for g in _groups(data):
        cells = []
        for b, m in cols:
            c = table[(g, b, m)]
            cls = next((s for s in ("fail", "error", "differs", "pass") if c[s]), "skip")
            cells.append(f"<td class='{cls}'>{e(_cell(c))}</td>")
        p.append(f"<tr><td>{e(g)}</td>{''.join(cells)}</tr>")
    p.append("</table></section>")
    fails = failures(data)
    p.append(f"<section id='failures'><h2>mpx failures ({len(fails)})</h2>")
    p.append("<ul>" + "".join(f"<li class='fail'>{e(r['backend'])} <code>{e(r['case'])}</code>: {e(r['detail'])}</li>"
                              for r in fails) + "</ul>" if fails else f"<p>{e(_none_failed(data))}.</p>")  # fmt: skip
    p.append("</section>")
    crashed = errors(data)
    p.append(f"<section id='errors'><h2>Adapter errors ({len(crashed)})</h2>")
    p.append("<ul>" + "".join(f"<li class='error'>{e(r['backend'])} {r['mode']} <code>{e(r['case'])}</code>: "
                              f"{e(_observed(r))}</li>" for r in crashed) + "</ul>"
             if crashed else "<p>none: every adapter ran every case.</p>")  # fmt: skip
    p.append("</section>")
    p.append(f"<section id='findings'><h2>Findings ({len(found)}, covering {len(divergences(data))} native "
             "divergences)</h2><table><tr><th>severity</th><th>kind</th><th>backend</th><th>finding</th>"
             "<th>what it means for training</th><th>cases</th></tr>")  # fmt: skip
    for f in found:
        cases = "".join(f"<code>{e(c)}</code><br>" for c in f["cases"])
        p.append(f"<tr class='finding'><td>{_sev(f['severity'])}</td><td>{e(f['kind'])}</td><td>{e(f['backend'])}</td>"
                 f"<td>{e(f['title'])}</td><td>{e(f['explanation'])}</td><td><details><summary>{len(f['cases'])} "
                 f"case{'s' if len(f['cases']) != 1 else ''}</summary>{cases}</details></td></tr>")  # fmt: skip
    p.append("</table></section>")
    p.append("<section id='plots'><h2>Plots</h2>")
    for name, caption, svg in _plot_svgs(data):
        p.append(
            f"<figure id='plot-{e(name.removesuffix('.svg'))}'>{svg}<figcaption>{e(caption)}</figcaption></figure>"
        )
    p.append("</section>")
    p.append("<section id='traces'><h2>Scale traces, aligned by step</h2><p>One row per step; highlighted cells "
             "differ from the spec.</p>")  # fmt: skip
    for case, head, rows, marks in _aligned_traces(data):
        p.append(f"<details open><summary><code>{e(case)}</code></summary><table><tr>"
                 + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")  # fmt: skip
        for cells, flags in zip(rows, marks, strict=True):
            p.append("<tr>" + "".join(f"<td{' class=diverge' if m else ''}>{e(c)}</td>"
                                      for c, m in zip(cells, flags, strict=True)) + "</tr>")  # fmt: skip
        p.append("</table></details>")
    p.append("</section>")
    specs = data.get("cases", {})
    p.append("<section id='cases'><h2>Cases</h2><p>Each cell: status and what was observed.</p>")
    for g, rows_ in _by_case(data).items():
        p.append(f"<details open><summary>{e(g)} ({len(rows_)} cases)</summary><table><tr><th>case</th><th>spec</th>"
                 "<th>expected</th>" + "".join(f"<th>{e(b)} {m}</th>" for b, m in cols) + "</tr>")  # fmt: skip
        for case, row in rows_.items():
            ref = next(iter(row.values()))
            cells = []
            for c in cols:
                r = row.get(c)
                if r is None:
                    cells.append("<td>-</td>")
                    continue
                cells.append(
                    f"<td class='{r['status']}'>{e(_SYMBOL.get(r['status'], ''))} {e(_observed(r))}</td>"
                )
            p.append(f"<tr><td><code>{e(case)}</code></td><td>{e(specs.get(case, {}).get('spec', ''))}</td>"
                     f"<td>{e(_fmt(ref['expected']))}</td>{''.join(cells)}</tr>")  # fmt: skip
        p.append("</table></details>")
    p.append("</section></body></html>")
    return "\n".join(p)


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
        for name, _, svg in _plot_svgs(data):
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
