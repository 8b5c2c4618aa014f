"""``mpx history plot FILE --out PNG``: draw a saved scaler history (``mpx.ScalerHistory.save``).

A missing, unreadable or malformed FILE is a user error: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mpx.history import ScalerHistory
from mpx_tools.command import Command

__all__ = ["COMMAND", "add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``mpx history``'s subcommands."""
    sub = parser.add_subparsers(dest="history_command", metavar="SUBCOMMAND", parser_class=type(parser))
    plot = sub.add_parser("plot", help="draw a saved scaler history (JSON) as a PNG timeline")
    plot.add_argument(
        "file", help="a history JSON file (mpx.ScalerHistory.save, format mpx.scaler_history/1)"
    )
    plot.add_argument("--out", default=None, help="the PNG to write (default: FILE with .png)")
    plot.add_argument("--title", default=None, help="the chart's title")


def main(args: argparse.Namespace) -> int:
    """Run ``mpx history plot``; MPXError (a bad file) is reported by mpx.cli with exit 2."""
    from mpx.cli import UsageError

    if getattr(args, "history_command", None) != "plot":
        raise UsageError("mpx history: a subcommand is required: plot FILE [--out PNG]")
    history = ScalerHistory.load(args.file)
    out = Path(args.out) if args.out else Path(args.file).with_suffix(".png")
    if out.parent and not out.parent.is_dir():
        raise UsageError(f"mpx history plot: --out: the folder {str(out.parent)!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("mpx history plot: needs matplotlib (pip install matplotlib)") from None
    from mpx_compare.report import plot_history

    plot_history(history, out, args.title)
    print(f"wrote {out} ({len(history)} steps, {sum(history.skipped)} skipped)")
    return 0


#: ``mpx history`` (the ``mpx.commands`` entry point, tools/pyproject.toml).
COMMAND = Command("draw a saved loss-scaler history: mpx history plot FILE --out PNG", add_arguments, main)
