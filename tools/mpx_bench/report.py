"""The reports of ``mpx bench``: a terminal table, ``bench.json``, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpx_tools.reports import md_table, pyplot, save_figure, text_table, write_files

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
    mark = "" if c["meets_target"] is None else (" met" if c["meets_target"] else " missed")
    noisy = ", too noisy to tell" if c.get("warning") else ""
    target = "" if c["target"] is None else f" (target <= {c['target']:g}{mark}{noisy})"
    if c["kind"] == "activations":
        return f"{c['median']:.3f}x{target}"
    return f"{c['median']:.3f}x [{c['min']:.3f}-{c['max']:.3f}]{target}"


def _fp8_label(c: dict[str, Any]) -> str | None:
    """``FP8 (N layers, CPU emulation)`` for a configuration that ran FP8 GEMMs, else None."""
    if not c.get("fp8_layers"):
        return None
    where = "CPU emulation" if (c.get("fp8_note") or "").startswith("CPU emulation") else "FP8 hardware"
    return f"FP8 ({c['fp8_layers']} layers, {where})"


def _config_table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "configuration", "step ms median [min-max]", "first call ms", "activations", "traces/step",
            "note"]  # fmt: skip
    rows = []
    for c in data["configs"]:
        traces = c.get("traces_per_step")
        traced = "-" if traces is None else f"{traces:g}"
        if c.get("graphs") is not None:  # --compile: compiles, graphs, breaks (all steps)
            traced += f" ({c['frames_compiled']} compiles, {c['graphs']} graphs, {c['graph_breaks']} breaks)"
        rows.append([c["backend"], c["id"], _ms(c["step_ms"]) if c["status"] == "ok" else "skipped",
                     "-" if c["first_call_ms"] is None else f"{c['first_call_ms']:.0f}",
                     _bytes(c.get("activation_bytes")), traced,
                     "; ".join(n for n in (c.get("note"), _fp8_label(c)) if n)[:90]])  # fmt: skip
    return head, rows


def _comparison_table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["backend", "policy", "ratio", "median [min-max] of per-round pairs"]
    rows = [[c["backend"], c["policy"], c["name"], _ratio(c)] for c in data["comparisons"]]
    return head, rows


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
    load = m.get("load_average")
    load_text = (
        ""
        if not load
        else f"; load average {load[0]:g} at the start"
        + (f", {m['load_average_end'][0]:g} at the end" if m.get("load_average_end") else "")
    )
    return (f"{m['cpu_model']}, {m['cpu_count']} cores{mem}, flags: {' '.join(m['cpu_flags']) or 'none'}; "
            f"{m['platform']}, Python {m['python']}{load_text}")  # fmt: skip


def _targets(data: dict[str, Any]) -> list[str]:
    """What each target in the ratio table means (only those present)."""
    from mpx_bench.stats import TARGET_HELP

    used = dict.fromkeys(c["name"] for c in data["comparisons"] if c.get("target") is not None)
    return [f"{name} <= {c:g}: {TARGET_HELP[name]}" for name in used if name in TARGET_HELP
            for c in [next(x["target"] for x in data["comparisons"] if x["name"] == name)]]  # fmt: skip


def terminal(data: dict[str, Any]) -> str:
    """The two tables (configurations, ratios) as plain text."""
    s = data["settings"]
    parts = [
        f"mpx bench: model {s['model']} ({s['size']}), {s['steps']} interleaved steps per configuration, "
        f"{s['warmup']} warm-up",
        "machine: " + _machine_line(data),
        *_versions(data),
        "",
        text_table(*_config_table(data)),
        "",
        text_table(*_comparison_table(data)),
    ]
    if _targets(data):
        parts += ["", "targets (mpx's performance goals; a ratio's median must be at most this):"]
        parts += [f"  {line}" for line in _targets(data)]
    noisy: dict[str, list[str]] = {}
    for c in data["comparisons"]:
        if c.get("warning"):
            noisy.setdefault(c["backend"], []).append(f"{c['policy']} {c['name']}")
    busy = [w for w in data.get("warnings") or [] if w.startswith("load average")]
    if busy or noisy:
        parts += ["", "warnings:", *[f"  {w}" for w in busy]]
    if noisy:
        parts.append("  too noisy to tell (the pairs' interquartile spread is wider than the difference the ratio "
                     "shows; rerun with more --steps on a quieter machine; details in bench.md):")  # fmt: skip
        parts += [f"    {b}: {', '.join(names)}" for b, names in noisy.items()]
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
        md_table(*_config_table(data)),
        "",
        "## Ratios",
        "",
        "Each ratio is taken per round (the two configurations ran back to back) and summarized by its "
        "median, min and max. `scaling/X` is the cost of loss scaling on top of the same float16 step "
        "without it; `activations/X` compares the bytes kept for the backward pass with fp32's.",
        "",
        md_table(*_comparison_table(data)),
        "",
        *(
            [
                "Targets (mpx's performance goals; a ratio's median must be at most this):",
                "",
                *[f"- {line}" for line in _targets(data)],
                "",
            ]
            if _targets(data)
            else []
        ),
        *(
            ["Warnings:", "", *[f"- {w}" for w in data.get("warnings") or []], ""]
            if data.get("warnings")
            else []
        ),
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
    """``bench.png``: per backend, the median step time of each configuration (min-max whiskers) on its own
    axis, and below it every time ratio (median, min-max whiskers) on a log axis around 1; None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [c for c in data["configs"] if c["status"] == "ok"]
    backends = list(dict.fromkeys(c["backend"] for c in rows)) or ["-"]
    fig, axes = plt.subplots(2, len(backends), figsize=(4.6 * len(backends) + 0.8, 8.0), squeeze=False)
    cmap = plt.get_cmap("tab10")
    ids = list(dict.fromkeys(c["id"] for c in rows))
    for i, b in enumerate(backends):
        ax = axes[0][i]
        mine = [c for c in rows if c["backend"] == b]
        for j, c in enumerate(mine):
            st = c["step_ms"]
            ax.bar(j, st["median"], 0.7, yerr=[[st["median"] - st["min"]], [st["max"] - st["median"]]], capsize=2,
                   color=cmap(ids.index(c["id"]) % 10))  # fmt: skip
        ax.set_xticks(range(len(mine)), [c["id"] for c in mine], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("step time, ms (median, min-max)")
        ax.set_title(f"{b}: step time", fontsize=10)
        ax2 = axes[1][i]
        ratios = [c for c in data["comparisons"] if c["backend"] == b and c["kind"] == "time"]
        for j, c in enumerate(ratios):
            color = "#c53030" if c.get("meets_target") is False else "#2b6cb0"
            ax2.barh(j, c["median"] - 1.0, left=1.0, height=0.6, color=color, alpha=0.8)
            ax2.plot([c["min"], c["max"]], [j, j], color="#333", lw=1)
            if c.get("target"):
                ax2.plot([c["target"]], [j], marker="|", color="#c53030", markersize=12)
        ax2.axvline(1.0, color="#555", lw=1)
        ax2.set_xscale("log")
        ax2.set_yticks(range(len(ratios)), [f"{c['policy']} {c['name']}" for c in ratios], fontsize=7)
        ax2.invert_yaxis()
        ax2.set_xlabel("ratio, log scale (bar: median, line: min-max, |: target)", fontsize=8)
        ax2.set_title(f"{b}: ratios of per-round pairs", fontsize=10)
    s = data["settings"]
    fig.suptitle(f"mpx bench: {s['model']} ({s['size']}) on {data['machine']['cpu_model']}", fontsize=11)
    return save_figure(fig, path, dpi=100)


def write_all(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out``; returns their paths."""
    return write_files(data, out, "bench", markdown, write_chart)
