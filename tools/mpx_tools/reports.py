"""The tables, charts and report files ``mpx bench`` and ``mpx compare`` write (stdlib only; matplotlib
is imported when a chart is drawn).

>>> print(text_table(["backend", "ms"], [["torch", "1.5"], ["jax", "12.0"]]))
backend  ms
-------  ----
torch    1.5
jax      12.0
>>> print(md_table(["case", "note"], [["a", "x|y"]]))
| case | note |
|---|---|
| a | x\\|y |
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["md_table", "pyplot", "save_figure", "text_table", "write_files"]


def text_table(head: list[str], rows: list[list[str]]) -> str:
    """``head`` and ``rows`` as left-aligned columns for a terminal, a dashed line under the head."""
    widths = (
        [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
        if rows
        else [len(h) for h in head]
    )
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    """``head`` and ``rows`` as a Markdown table (``|`` in a cell escaped)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |" for r in rows]
    return "\n".join(lines)


def write_files(
    data: dict[str, Any],
    out: Path,
    stem: str,
    markdown: Callable[[dict[str, Any]], str],
    write_chart: Callable[[dict[str, Any], Path], Path | None],
) -> dict[str, Path]:
    """Write ``STEM.json``, ``STEM.md`` and (where ``write_chart`` draws one) ``STEM.png`` into ``out``.

    Shared by ``mpx bench`` and ``mpx compare``; returns the paths written, keyed json/md/png.
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(data), encoding="utf-8")
    png = write_chart(data, out / f"{stem}.png")
    if png is not None:
        paths["png"] = png
    return paths


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` drawing to files only (the Agg backend), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG) and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
