"""``report.html`` of a conformance run: one self-contained page (inline CSS and SVG, no script).

Its sections are report.md's (:mod:`conformance.report`), from the same :mod:`conformance.results`.
"""

from __future__ import annotations

import html
from collections import Counter
from typing import Any

from conformance import findings as F
from conformance import results as R
from conformance.agreement import keras_traces, keras_traces_line

__all__ = ["html_report"]

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

    cols = R.columns(data)
    table = R.counts(data)
    found = R.run_findings(data)
    p = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>mpx conformance</title>"
         f"<style>{_CSS}</style></head><body>", "<h1>mpx conformance report</h1>",
         f"<p>mpx {e(data['mpx_version'])}, Python {e(data['python'])} on {e(data['machine'])}, "
         f"{data['seconds']}s.</p>"]  # fmt: skip
    p.append("<section id='summary'><h2>Summary per framework</h2><div class='cards'>")
    for backend, s in F.summary(data, found).items():
        meta = data["backends"][backend]
        sev = " ".join(f"{_sev(k)} {n}" for k, n in s["by_severity"].items())
        p.append(f"<div class='card' id='summary-{e(backend)}'><h3>{e(backend)}</h3>"
                 f"<p>{e(R.backend_line(backend, meta))}<br><b>native</b> means {e(s['native'])}.<br>"
                 f"native: {e(R.cell(Counter(s['counts']['native'])))}; mpx: {e(R.cell(Counter(s['counts']['mpx'])))}"
                 f"<br>findings: {sev}</p><ul>"
                 + "".join(f"<li>{_sev(f['severity'])} {e(f['title'])}</li>" for f in found if f["backend"] == backend)
                 + ("" if s["findings"] else "<li>no native divergence</li>") + "</ul></div>")  # fmt: skip
    p.append("</div>")
    if keras_traces(data):
        p.append(f"<p id='keras-traces'>{e(keras_traces_line(keras_traces(data)))}.</p>")
    p.append("</section>")
    p.append("<section id='legend'><h2>Legend</h2><dl class='legend'>")
    for k, v in R.LEGEND.items():
        p.append(f"<dt class='{k}'>{e(R.legend_key(k))}</dt><dd>{e(v)}</dd>")
    for k, v in F.SEVERITY_HELP.items():
        p.append(f"<dt>{_sev(k)}</dt><dd>{e(v)}</dd>")
    for k, v in F.KIND_HELP.items():
        p.append(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>")
    p.append("<dt>native / mpx</dt><dd>native: the framework's own mixed-precision machinery and defaults "
             "(per framework above); mpx: the same case through mpx</dd></dl></section>")  # fmt: skip
    p.append("<section id='results'><h2>Results</h2><table><tr><th>group</th>"
             + "".join(f"<th>{e(b)} {m}</th>" for b, m in cols) + "</tr>")  # fmt: skip
    for g in R.groups(data):
        cells = []
        for b, m in cols:
            c = table[(g, b, m)]
            cls = next((s for s in ("fail", "error", "differs", "pass") if c[s]), "skip")
            cells.append(f"<td class='{cls}'>{e(R.cell(c))}</td>")
        p.append(f"<tr><td>{e(g)}</td>{''.join(cells)}</tr>")
    p.append("</table></section>")
    fails = R.failures(data)
    p.append(f"<section id='failures'><h2>mpx failures ({len(fails)})</h2>")
    p.append("<ul>" + "".join(f"<li class='fail'>{e(r['backend'])} <code>{e(r['case'])}</code>: {e(r['detail'])}</li>"
                              for r in fails) + "</ul>" if fails else f"<p>{e(R.none_failed(data))}.</p>")  # fmt: skip
    p.append("</section>")
    crashed = R.errors(data)
    p.append(f"<section id='errors'><h2>Adapter errors ({len(crashed)})</h2>")
    p.append("<ul>" + "".join(f"<li class='error'>{e(r['backend'])} {r['mode']} <code>{e(r['case'])}</code>: "
                              f"{e(R.observed(r))}</li>" for r in crashed) + "</ul>"
             if crashed else "<p>none: every adapter ran every case.</p>")  # fmt: skip
    p.append("</section>")
    p.append(f"<section id='findings'><h2>Findings ({len(found)}, covering {len(R.divergences(data))} native "
             "divergences)</h2><table><tr><th>severity</th><th>kind</th><th>backend</th><th>finding</th>"
             "<th>what it means for training</th><th>cases</th></tr>")  # fmt: skip
    for f in found:
        cases = "".join(f"<code>{e(c)}</code><br>" for c in f["cases"])
        p.append(f"<tr class='finding'><td>{_sev(f['severity'])}</td><td>{e(f['kind'])}</td><td>{e(f['backend'])}</td>"
                 f"<td>{e(f['title'])}</td><td>{e(f['explanation'])}</td><td><details><summary>{len(f['cases'])} "
                 f"case{'s' if len(f['cases']) != 1 else ''}</summary>{cases}</details></td></tr>")  # fmt: skip
    p.append("</table></section>")
    p.append("<section id='plots'><h2>Plots</h2>")
    for name, caption, svg in R.plot_svgs(data):
        p.append(
            f"<figure id='plot-{e(name.removesuffix('.svg'))}'>{svg}<figcaption>{e(caption)}</figcaption></figure>"
        )
    p.append("</section>")
    p.append("<section id='traces'><h2>Scale traces, aligned by step</h2><p>One row per step; highlighted cells "
             "differ from the spec.</p>")  # fmt: skip
    for case, head, rows, marks in R.aligned_traces(data):
        p.append(f"<details open><summary><code>{e(case)}</code></summary><table><tr>"
                 + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")  # fmt: skip
        for cells, flags in zip(rows, marks, strict=True):
            p.append("<tr>" + "".join(f"<td{' class=diverge' if m else ''}>{e(c)}</td>"
                                      for c, m in zip(cells, flags, strict=True)) + "</tr>")  # fmt: skip
        p.append("</table></details>")
    p.append("</section>")
    specs = data.get("cases", {})
    p.append("<section id='cases'><h2>Cases</h2><p>Each cell: status and what was observed.</p>")
    for g, rows_ in R.by_case(data).items():
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
                    f"<td class='{r['status']}'>{e(R.SYMBOL.get(r['status'], ''))} {e(R.observed(r))}</td>"
                )
            p.append(f"<tr><td><code>{e(case)}</code></td><td>{e(specs.get(case, {}).get('spec', ''))}</td>"
                     f"<td>{e(R.fmt(ref['expected']))}</td>{''.join(cells)}</tr>")  # fmt: skip
        p.append("</table></details>")
    p.append("</section></body></html>")
    return "\n".join(p)
