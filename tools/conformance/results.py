"""What the reports of a conformance run show, computed from its data (``report.json``'s dict).

The terminal summary and report.md (:mod:`conformance.report`) and report.html
(:mod:`conformance.report_html`) show the same things: the result matrix (:func:`counts`, one
:func:`cell` per group and column), the text of an observed or expected value (:func:`fmt`,
:func:`observed`), the mpx failures, adapter errors and native divergences, the findings
(:func:`run_findings`, classified by :mod:`conformance.findings`), the plots (:func:`plot_svgs`,
drawn by :mod:`conformance.plots`) and the scale traces aligned step by step (:func:`aligned_traces`).
"""

from __future__ import annotations

import struct
from collections import Counter, defaultdict
from typing import Any

from conformance import findings as F
from conformance import plots
from conformance.agreement import TRACE_GROUPS
from conformance.cases import GROUPS

__all__ = [
    "LEGEND",
    "STATUSES",
    "SYMBOL",
    "aligned_traces",
    "backend_line",
    "by_case",
    "cell",
    "columns",
    "counts",
    "divergences",
    "errors",
    "failures",
    "fmt",
    "groups",
    "legend_key",
    "mpx_passes",
    "none_failed",
    "observed",
    "plot_svgs",
    "run_findings",
]

STATUSES = ("pass", "differs", "fail", "skip", "error")
SYMBOL = {"pass": "✓", "differs": "≠", "fail": "✗"}
LEGEND = {
    "pass": "meets the mpx spec",
    "differs": "natively only: the framework does not do what the spec says (a finding, not an error)",
    "fail": "under mpx only: mpx does not meet its own spec (a bug; the exit status is 1)",
    "skip": "not applicable (the reason is in the case table)",
    "error": "the adapter running the case crashed, so nothing was judged: not a finding against the "
    "framework; under mpx the exit status is 1 (the exception is in the case table)",
}


def legend_key(status: str) -> str:
    return f"{SYMBOL[status]} {status}" if status in SYMBOL else f"N {status}"


def columns(data: dict) -> list[tuple[str, str]]:
    return [(b, m) for b in data["backends"] for m in ("native", "mpx")]


def counts(data: dict) -> dict[tuple[str, str, str], Counter]:
    """(group, backend, mode) -> Counter of statuses."""
    out: dict[tuple[str, str, str], Counter] = defaultdict(Counter)
    for r in data["results"]:
        out[(r["group"], r["backend"], r["mode"])][r["status"]] += 1
    return out


def cell(c: Counter) -> str:
    """``136✓ 42≠ 15 skip 1 error``: only the counts that are not zero; skips and errors spelled out."""
    if not c:
        return "-"
    parts = [f"{c[s]}{SYMBOL[s]}" for s in ("pass", "differs", "fail") if c[s]]
    parts += [f"{c[s]} {s}" for s in ("skip", "error") if c[s]]
    return " ".join(parts)


def groups(data: dict) -> list[str]:
    present = {r["group"] for r in data["results"]}
    return [g for g in (*GROUPS, "worker") if g in present]


def fmt(value: Any) -> str:
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
            return f"error {fmt(value['max_rel_error'])}"
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
        if "codes" in value and "scales" in value:  # blocks: sha256 digests of the codes and the scales
            ts = value.get("tensor_scale")
            return f"codes {value['codes'][:8]}, scales {value['scales'][:8]}" + (
                ""
                if ts is None
                else f", tensor scale {_scale(struct.unpack('<f', struct.pack('<I', ts & 0xFFFFFFFF))[0])}"
            )
        if "missing" in value:
            return f"none: {value['missing']}"
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
        return "; ".join(f"{k} {fmt(v)}" for k, v in value.items())
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
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


def observed(r: dict | None) -> str:
    if r is None:
        return "-"
    if r["status"] == "skip":
        return "skip: " + (r.get("detail") or "")
    if r["status"] == "error":
        return "error: " + (r.get("detail") or "") + (f" (at {r['at']})" if r.get("at") else "")
    text = fmt(r.get("observed"))
    grouped = r.get("group") in (
        "distributed",
        "accumulation",
        "blocks",
    )  # their text says it all (blocks: digests)
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


def none_failed(data: dict) -> str:
    mpx_errors = sum(1 for r in errors(data) if r["mode"] == "mpx")
    if not mpx_errors:
        return "none: every mpx result passes"
    return f"none, but {mpx_errors} mpx result{'s' if mpx_errors != 1 else ''} errored (below)"


def run_findings(data: dict) -> list[dict]:
    if "findings" not in data:
        data["findings"] = F.findings(data)
    return data["findings"]


def backend_line(backend: str, meta: dict) -> str:
    if meta.get("skipped"):
        return meta["skipped"]
    line = f"{meta.get('version')} on {meta.get('device')}, {meta.get('seconds')}s"
    if meta.get("mpx_free") is True:
        line += "; native ran with nothing of mpx loaded"
    elif meta.get("mpx_free") is False:
        line += "; native run LOADED mpx: see report.json"
    return line


def by_case(data: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in data["results"]:
        out[r["group"]].setdefault(r["case"], {})[(r["backend"], r["mode"])] = r
    return out


def _numerics_rows(data: dict, backend: str) -> list[tuple[str, float, float | None, float | None]]:
    rows = []
    for case, row in by_case(data).get("numerics", {}).items():
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
        for case, row in by_case(data).get(g, {}).items():
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


def plot_svgs(data: dict) -> list[tuple[str, str, str]]:
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


def aligned_traces(data: dict) -> list[tuple[str, list[str], list[list[str]], list[list[bool]]]]:
    """Per trace case with a native divergence: (case, header, rows, diverging flags) aligned by step."""
    specs = data.get("cases", {})
    out = []
    for g in TRACE_GROUPS:
        for case, row in by_case(data).get(g, {}).items():
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
