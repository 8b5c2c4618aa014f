"""The reports of ``mpx compare``: a terminal table, ``compare.json``, ``compare.md`` and ``compare.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpx.history import ScalerHistory
from mpx_tools.reports import md_table, pyplot, save_figure, text_table, write_files

__all__ = ["draw_timeline", "markdown", "plot_history", "terminal", "write_all", "write_chart"]


def draw_timeline(ax: Any, history: ScalerHistory, label: str | None = None) -> None:
    """Draw a scaler history on a matplotlib axis: the scale per step (log2), skipped steps as red x."""
    line = ax.step(history.steps, history.scale, where="post", label=label)[0]
    skipped = [i for i, s in enumerate(history.skipped) if s]
    if skipped:
        ax.plot([history.steps[i] for i in skipped], [history.scale[i] for i in skipped], "x", color="red",
                markersize=4, label=None if label is None else f"{label}: skipped", zorder=3)  # fmt: skip
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    line.set_linewidth(1.2)


def plot_history(history: ScalerHistory, path: Path, title: str | None = None) -> Path:
    """Write a PNG of ``history``'s timeline (scale per step; skipped steps marked); returns ``path``."""
    plt = pyplot()
    if plt is None:
        raise ImportError("drawing a scaler history needs matplotlib (pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    draw_timeline(ax, history, "scale")
    n = len(history)
    growths, backoffs, skips = sum(history.growth), sum(history.backoff), sum(history.skipped)
    ax.set_title(title or f"loss scale: {n} steps, {skips} skipped, {growths} growths, {backoffs} backoffs")
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=90)


def _table(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    crit = data["settings"]["criterion_points"]
    head = ["backend", "policy", "val accuracy %", "val loss", "delta points mean [min, max] (std)",
            f"within {crit:g} pt", "skipped steps", "final scale", "FP8 layers (delta vs no FP8)"]  # fmt: skip
    rows = []
    for s in data["summary"]:
        d = s["delta_points"]
        delta = "-" if d is None else f"{d['mean']:+.2f} [{d['min']:+.2f}, {d['max']:+.2f}] ({d['std']:.2f})"
        passed = "-" if s["passed"] is None else ("pass" if s["passed"] else "FAIL")
        scale = "-" if s["final_scale"] is None else f"{s['final_scale']:g}"
        fp8 = "-" if not s.get("fp8_layers") else str(s["fp8_layers"])
        if s.get("vs_without_fp8"):
            fp8 += f" ({s['vs_without_fp8']['mean']:+.2f} vs {s['vs_without_fp8']['policy']})"
        rows.append([s["backend"], s["policy"], f"{100 * s['val_accuracy']:.2f}", f"{s['val_loss']:.4f}", delta,
                     passed, f"{s['skipped_steps']:g}", scale, fp8])  # fmt: skip
    return head, rows


def _backends(data: dict[str, Any]) -> list[str]:
    out = []
    for name, meta in data["backends"].items():
        versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
        state = "" if meta["status"] == "ok" else f" -- {meta['status'].upper()}: {meta.get('error')}"
        out.append(f"{name}: {versions or '-'} on {meta.get('device')}, {meta.get('seconds')} s{state}")
    return out


def _settings_line(data: dict[str, Any]) -> str:
    s = data["settings"]
    steps = f", at most {s['max_steps']} steps" if s.get("max_steps") else ""
    return (f"model {s['model']} on {s['dataset']}; policies {', '.join(s['policies'])} against float32; "
            f"{s['seeds']} seed(s); {s['epochs']} epoch(s) of Adam (lr {s['lr']:g}, batch {s['batch_size']}){steps}")  # fmt: skip


def terminal(data: dict[str, Any]) -> str:
    """The summary table as plain text."""
    return "\n".join(
        ["mpx compare: " + _settings_line(data), *_backends(data), "", text_table(*_table(data))]
    )


def markdown(data: dict[str, Any]) -> str:
    """``compare.md``: settings, versions, the table and the chart."""
    crit = data["settings"]["criterion_points"]
    return "\n".join([
        "# mpx compare", "",
        f"- command: `{' '.join(data.get('command') or ['mpx', 'compare'])}`",
        f"- created: {data['created']}, mpx {data['mpx_version']}, {data.get('seconds')} s",
        f"- {_settings_line(data)}", *[f"- {line}" for line in _backends(data)], "",
        "Each policy trains from the same initialization and batch order as float32 (per seed). The delta is "
        f"the validation accuracy minus float32's, in percentage points, paired by seed; a policy passes when "
        f"the mean delta is within {crit:g} points. FP8 layers: the layers that ran FP8 GEMMs (CPU: "
        "emulated), with the accuracy delta to the same policy without FP8 where it ran too.", "",
        md_table(*_table(data)), "",
        "![loss curves and loss-scale timeline](compare.png)", "",
    ])  # fmt: skip


def write_chart(data: dict[str, Any], path: Path) -> Path | None:
    """Per backend: the training loss (seed 0) of float32 and each policy, and the loss scale per step."""
    plt = pyplot()
    if plt is None:
        return None
    backends = [b for b in data["backends"] if any(r["backend"] == b for r in data["runs"])]
    if not backends:
        return None
    fig, axes = plt.subplots(2, len(backends), figsize=(5 * len(backends), 6), squeeze=False)
    for j, backend in enumerate(backends):
        runs = [r for r in data["runs"] if r["backend"] == backend and r["seed"] == 0]
        for r in runs:
            steps = range(1, len(r["losses"]) + 1)
            axes[0][j].plot(steps, [float("nan") if x is None else x for x in r["losses"]], label=r["policy"],
                            linewidth=1.5 if r["policy"] == "float32" else 1.0)  # fmt: skip
            if r["policy"] != "float32":
                if r.get("history"):
                    draw_timeline(axes[1][j], ScalerHistory.from_dict(r["history"]), r["policy"])
                else:
                    axes[1][j].step(steps, r["scales"], where="post", label=r["policy"])
        axes[0][j].set_title(f"{backend}: training loss (seed 0)")
        axes[0][j].set_xlabel("step")
        axes[0][j].legend(fontsize=7)
        axes[1][j].set_title(f"{backend}: loss scale")
        axes[1][j].set_xlabel("step")
        axes[1][j].set_yscale("log", base=2)
        if axes[1][j].lines:
            axes[1][j].legend(fontsize=7)
    return save_figure(fig, path, dpi=90)


def write_all(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``compare.json``, ``compare.md`` and ``compare.png`` into ``out``; returns their paths."""
    return write_files(data, out, "compare", markdown, write_chart)
