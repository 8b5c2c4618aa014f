"""Reports of a conformance run: the terminal matrix, report.json, report.md, report.html."""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from conformance.cases import GROUPS

STATUSES = ("pass", "differs", "fail", "skip")


def _columns(data: dict) -> list[tuple[str, str]]:
    return [(b, m) for b in data["backends"] for m in ("native", "mpx")]


def counts(data: dict) -> dict[tuple[str, str, str], Counter]:
    """(group, backend, mode) -> Counter of statuses."""
    out: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for r in data["results"]:
        out[(r["group"], r["backend"], r["mode"])][r["status"]] += 1
    return out


def _cell(c: Counter) -> str:
    if not c:
        return "-"
    parts = [f"{c['pass']}✓"]
    if c["differs"]:
        parts.append(f"{c['differs']}≠")
    if c["fail"]:
        parts.append(f"{c['fail']}✗")
    if c["skip"]:
        parts.append(f"{c['skip']}s")
    return " ".join(parts)


def _groups(data: dict) -> list[str]:
    present = {r["group"] for r in data["results"]}
    return [g for g in (*GROUPS, "worker") if g in present]


def _describe(r: dict) -> str:
    exp, obs = r["expected"], r["observed"]
    if isinstance(exp, dict) and isinstance(obs, dict) and len(exp) == 1 and set(exp) == set(obs):
        (key,) = exp
        return f"spec {key}={_short(exp[key])}, observed {_short(obs[key])}"
    return f"spec {_short(exp)}, observed {_short(obs)}"


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


def divergences(data: dict) -> list[dict]:
    return [r for r in data["results"] if r["mode"] == "native" and r["status"] == "differs"]


def failures(data: dict) -> list[dict]:
    return [r for r in data["results"] if r["mode"] == "mpx" and r["status"] == "fail"]


def terminal(data: dict) -> str:
    cols = _columns(data)
    table = counts(data)
    width = max(12, *(len(g) for g in _groups(data)))
    head = f"{'group':<{width}} " + " ".join(f"{b + ' ' + m:>16}" for b, m in cols)
    lines = ["", "conformance (✓ pass, ≠ differs from the mpx spec, ✗ fail, s skip)", head, "-" * len(head)]
    for g in _groups(data):
        lines.append(f"{g:<{width}} " + " ".join(f"{_cell(table[(g, b, m)]):>16}" for b, m in cols))
    for backend, meta in data["backends"].items():
        info = meta.get("skipped") or f"{meta.get('version')} on {meta.get('device')}, {meta.get('seconds')}s"
        lines.append(f"  {backend}: {info}")
    divs = divergences(data)
    lines.append("")
    lines.append(f"native divergences from the mpx spec: {len(divs)}")
    for r in divs:
        lines.append(f"  {r['backend']:<5} {r['case']}: {_describe(r)}")
    fails = failures(data)
    lines.append("")
    lines.append(f"mpx failures: {len(fails)}" + ("" if fails else " (every mpx result passes)"))
    for r in fails:
        lines.append(f"  {r['backend']:<5} {r['case']}: {r['detail'] or _describe(r)}")
    return "\n".join(lines)


def markdown(data: dict) -> str:
    cols = _columns(data)
    table = counts(data)
    out = ["# mpx conformance report", ""]
    out.append(
        f"mpx {data['mpx_version']}, Python {data['python']} on {data['machine']}, {data['seconds']}s."
    )
    out.append("")
    for backend, meta in data["backends"].items():
        out.append(
            f"- **{backend}**: " + (meta.get("skipped") or f"{meta.get('version')} on {meta.get('device')}")
        )
    out += ["", "## Summary", "", "| group | " + " | ".join(f"{b} {m}" for b, m in cols) + " |"]
    out.append("|---|" + "---|" * len(cols))
    for g in _groups(data):
        out.append(f"| {g} | " + " | ".join(_cell(table[(g, b, m)]) for b, m in cols) + " |")
    divs = divergences(data)
    out += ["", f"## Native divergences ({len(divs)})", ""]
    out += [f"- `{r['backend']}` `{r['case']}`: {_describe(r)}" for r in divs] or ["none"]
    fails = failures(data)
    out += ["", f"## mpx failures ({len(fails)})", ""]
    out += [f"- `{r['backend']}` `{r['case']}`: {r['detail']}" for r in fails] or ["none"]
    by_case = _by_case(data)
    for g in _groups(data):
        out += ["", f"## {g}", "", "| case | " + " | ".join(f"{b} {m}" for b, m in cols) + " |"]
        out.append("|---|" + "---|" * len(cols))
        for case, row in by_case[g].items():
            out.append(
                f"| `{case}` | " + " | ".join(row.get((b, m), {}).get("status", "-") for b, m in cols) + " |"
            )
    return "\n".join(out) + "\n"


def _by_case(data: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in data["results"]:
        out[r["group"]].setdefault(r["case"], {})[(r["backend"], r["mode"])] = r
    return out


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}.pass{background:#e6f4ea}.differs{background:#fff4d6}.fail{background:#fbe0e0;font-weight:bold}
.skip{color:#888}code{font-size:12px}details{margin:.3em 0}summary{cursor:pointer;font-weight:600}
"""


def html_report(data: dict) -> str:
    e = html.escape
    cols = _columns(data)
    table = counts(data)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>mpx conformance</title><style>{_CSS}</style></head><body>"
    ]
    parts.append("<h1>mpx conformance report</h1>")
    parts.append(
        f"<p>mpx {e(data['mpx_version'])}, Python {e(data['python'])} on {e(data['machine'])}, {data['seconds']}s.</p><ul>"
    )
    for backend, meta in data["backends"].items():
        parts.append(
            f"<li><b>{e(backend)}</b>: {e(str(meta.get('skipped') or str(meta.get('version')) + ' on ' + str(meta.get('device'))))}</li>"
        )
    parts.append(
        "</ul><h2>Summary</h2><table><tr><th>group</th>"
        + "".join(f"<th>{e(b)} {m}</th>" for b, m in cols)
        + "</tr>"
    )
    for g in _groups(data):
        cells = []
        for b, m in cols:
            c = table[(g, b, m)]
            cls = "fail" if c["fail"] else "differs" if c["differs"] else "pass" if c["pass"] else "skip"
            cells.append(f"<td class='{cls}'>{e(_cell(c))}</td>")
        parts.append(f"<tr><td>{e(g)}</td>{''.join(cells)}</tr>")
    parts.append("</table>")
    fails = failures(data)
    parts.append(f"<h2>mpx failures ({len(fails)})</h2>")
    parts.append(
        "<ul>"
        + "".join(
            f"<li class='fail'>{e(r['backend'])} <code>{e(r['case'])}</code>: {e(r['detail'])}</li>"
            for r in fails
        )
        + "</ul>"
        if fails
        else "<p>none: every mpx result passes.</p>"
    )
    divs = divergences(data)
    parts.append(
        f"<h2>Native divergences from the mpx spec ({len(divs)})</h2><table><tr><th>backend</th><th>case</th><th>spec vs observed</th></tr>"
    )
    parts += [
        f"<tr class='differs'><td>{e(r['backend'])}</td><td><code>{e(r['case'])}</code></td><td>{e(_describe(r))}</td></tr>"
        for r in divs
    ]
    parts.append("</table>")
    specs = data.get("cases", {})
    for g, rows in _by_case(data).items():
        parts.append(
            f"<details open><summary>{e(g)} ({len(rows)} cases)</summary><table><tr><th>case</th><th>spec</th>"
            + "".join(f"<th>{e(b)} {m}</th>" for b, m in cols)
            + "</tr>"
        )
        for case, row in rows.items():
            cells = []
            for b, m in cols:
                r = row.get((b, m))
                if r is None:
                    cells.append("<td>-</td>")
                    continue
                title = e(r.get("detail") or _describe(r))
                cells.append(f"<td class='{r['status']}' title='{title}'>{r['status']}</td>")
            parts.append(
                f"<tr><td><code>{e(case)}</code></td><td>{e(specs.get(case, {}).get('spec', ''))}</td>{''.join(cells)}</tr>"
            )
        parts.append("</table></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_all(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "report.md").write_text(markdown(data))
    (out / "report.html").write_text(html_report(data))
