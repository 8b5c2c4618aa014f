"""The reports of ``mpx bench``: a terminal table, ``bench.json``, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["markdown", "terminal", "write_all", "write_chart"]


def _ms(step: dict[str, Any] | None) -> str:
    if not step:
        return "-"
    return f"{step['median']:.1f} [{step['min']:.1f}-{step['max']:.1f}]"


def _bytes(n: Any) -> str:
    if n is None:
        return "-"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def _ratio(c: dict[str, Any]) -> str:
    mark = "" if c["meets_target"] is None else (" ok" if c["meets_target"] else " MISSED")
    target = "" if c["target"] is None else f" (target <= {c['target']:g}{mark})"
    if c["kind"] == "activations":
        return f"{c['median']:.3f}x{target}"
    return f"{c['median']:.3f}x [{c['min']:.3f}-{c['max']:.3f}]{target}"


def _config_table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "configuration", "step ms median [min-max]", "first call ms", "activations", "traces/step",
            "note"]  # fmt: skip
    rows = []
    for c in data["configs"]:
        traces = c.get("traces_per_step")
        rows.append([c["backend"], c["id"], _ms(c["step_ms"]) if c["status"] == "ok" else "skipped",
                     "-" if c["first_call_ms"] is None else f"{c['first_call_ms']:.0f}",
                     _bytes(c.get("activation_bytes")), "-" if traces is None else f"{traces:g}",
                     (c.get("note") or "")[:90]])  # fmt: skip
    return head, rows


def _comparison_table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "policy", "ratio", "median [min-max] of per-round pairs"]
    rows = [[c["backend"], c["policy"], c["name"], _ratio(c)] for c in data["comparisons"]]
    return head, rows


def _text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = (
        [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
        if rows
        else [len(h) for h in head]
    )
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _versions(data: dict[str, Any]) -> list[str]:
    out = []
    for name, meta in data["backends"].items():
        if meta["status"] == "not installed":
            out.append(f"{name}: not installed")
            continue
        versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
        state = "" if meta["status"] == "ok" else f" -- FAILED: {meta.get('error')}"
        out.append(f"{name}: {versions} on {meta.get('device')} ({meta.get('device_name')}), "
                   f"{meta.get('seconds')} s{state}")  # fmt: skip
    return out


def _machine_line(data: dict[str, Any]) -> str:
    m = data["machine"]
    mem = f", {m['memory_bytes'] / (1 << 30):.0f} GiB" if m.get("memory_bytes") else ""
    return (f"{m['cpu_model']}, {m['cpu_count']} cores{mem}, flags: {' '.join(m['cpu_flags']) or 'none'}; "
            f"{m['platform']}, Python {m['python']}")  # fmt: skip


def terminal(data: dict[str, Any]) -> str:
    """The two tables (configurations, ratios) as plain text."""
    s = data["settings"]
    parts = [
        f"mpx bench: model {s['model']} ({s['size']}), {s['steps']} interleaved steps per configuration, "
        f"{s['warmup']} warm-up",
        "machine: " + _machine_line(data),
        *_versions(data),
        "",
        _text_table(*_config_table(data)),
        "",
        _text_table(*_comparison_table(data)),
    ]
    return "\n".join(parts)


def markdown(data: dict[str, Any]) -> str:
    """``bench.md``: the machine, the versions, both tables and how the figures were taken."""
    s = data["settings"]
    parts = [
        "# mpx bench",
        "",
        f"- command: `{' '.join(data.get('command') or ['mpx', 'bench'])}`",
        f"- created: {data['created']}, mpx {data['mpx_version']}, {data['seconds']} s",
        f"- machine: {_machine_line(data)}",
        *[f"- {line}" for line in _versions(data)],
        f"- model: {s['model']} ({s['size']}); policies: {', '.join(s['policies'])}; {s['steps']} timed steps "
        f"per configuration, interleaved one step each per round, after {s['warmup']} warm-up steps "
        f"(the first, with tracing and compilation, is the 'first call' column); per-configuration budget "
        f"{s['budget_s']:g} s",
        "",
        "## Step time per configuration",
        "",
        _md_table(*_config_table(data)),
        "",
        "## Ratios",
        "",
        "Each ratio is taken per round (the two configurations ran back to back) and summarized by its "
        "median, min and max. `scaling/X` is the cost of loss scaling on top of the same float16 step "
        "without it; `activations/X` compares the bytes kept for the backward pass with fp32's.",
        "",
        _md_table(*_comparison_table(data)),
        "",
        *_profile_section(data),
        "![step time per backend and configuration](bench.png)",
        "",
    ]
    return "\n".join(parts)


def _profile_section(data: dict[str, Any]) -> list[str]:
    """Where the activation bytes go, for every configuration that reports a profile."""
    rows = [c for c in data["configs"] if c.get("activation_profile")]
    if not rows:
        return []
    out = ["## Where the activation bytes go", "",
           "The tensors autograd keeps for the backward pass, grouped by the op that made them and their dtype "
           "(torch: the tensor's `grad_fn`, `input` for data; JAX: the primitive that `saved_residuals` names).",
           ""]  # fmt: skip
    for c in rows:
        total = c.get("activation_bytes") or 0
        cells = ", ".join(f"{r['producer']} {r['dtype']} {_bytes(r['bytes'])}" + (f" ({r['bytes'] / total:.0%})" if total else "")
                          for r in c["activation_profile"])  # fmt: skip
        out.append(f"- {c['backend']} `{c['id']}` ({_bytes(total)}): {cells}")
    out.append("")
    return out


def write_chart(data: dict[str, Any], path: Path) -> Path | None:
    """A bar chart of the median step time (min-max whiskers) per backend and configuration; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [c for c in data["configs"] if c["status"] == "ok"]
    backends = list(dict.fromkeys(c["backend"] for c in rows))
    ids = list(dict.fromkeys(c["id"] for c in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(backends) * max(1, len(ids)) * 0.35 + 2), 4.5))
    width = 0.8 / max(1, len(ids))
    cmap = plt.get_cmap("tab10")
    for j, cid in enumerate(ids):
        xs, ys, lo, hi = [], [], [], []
        for i, b in enumerate(backends):
            c = next((c for c in rows if c["backend"] == b and c["id"] == cid), None)
            if c is None:
                continue
            st = c["step_ms"]
            xs.append(i + (j - (len(ids) - 1) / 2) * width)
            ys.append(st["median"])
            lo.append(st["median"] - st["min"])
            hi.append(st["max"] - st["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=cid, color=cmap(j % 10))
    ax.set_xticks(range(len(backends)), backends)
    ax.set_ylabel("step time, ms (median, min-max)")
    s = data["settings"]
    ax.set_title(f"mpx bench: {s['model']} ({s['size']}) on {data['machine']['cpu_model']}")
    if ids:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_all(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(data), encoding="utf-8")
    png = write_chart(data, out / "bench.png")
    if png is not None:
        paths["png"] = png
    return paths
