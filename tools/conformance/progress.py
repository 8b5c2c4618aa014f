"""What ``mpx conformance`` shows while it runs: per column, a progress bar with an estimate on a terminal.

On a terminal (the stream's ``isatty()``) each column (backend) gets one line, rewritten in place as its
results arrive: a bar, ``done/total``, the percentage, the elapsed time and an estimate of what is left,
and the case now reported.  The estimate is the column's measured rate so far (seconds per result since
the column started) times the results still to come; it reads ``ETA ?`` until the first result.  When a
column ends its line stays, with the column's time.  Off a terminal (a log, CI) it prints the plain lines
``[done/total] backend mode case`` (over every column) at most every ``interval_s`` seconds and on the
last result, as before.  Nothing when quiet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

#: Width of the bar in characters, and of a terminal line (the line is cut there).
BAR = 24
WIDTH = 110


def duration(seconds: float) -> str:
    """``seconds`` as ``42s``, ``3m05s`` or ``1h02m`` (rounded down to whole seconds)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ColumnProgress:
    """Progress of a conformance run, column by column (see the module docstring).

    Args:
        total: results of the whole run (every column and mode).
        stream: where it writes (default ``sys.stderr``); a terminal when its ``isatty()`` says so.
        quiet: write nothing.
        clock: seconds, monotonic (default ``time.monotonic``).
        interval_s: off a terminal, the least time between two plain lines (default 5 s).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        quiet: bool = False,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 5.0,
    ) -> None:
        self.total, self.quiet, self.clock, self.interval_s = total, quiet, clock, interval_s
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self.done = 0
        self.column: str | None = None
        self.column_total = self.column_done = 0
        self.column_start = 0.0
        self.last_plain: float | None = None
        self.open_line = False

    def start(self, column: str, total: int) -> None:
        """Column ``column`` begins; ``total`` results are to come from it."""
        self.column, self.column_total, self.column_done = column, total, 0
        self.column_start = self.clock()
        if self.tty and not self.quiet:
            self._draw("")

    def advance(self, mode: str, case: str) -> None:
        """One result of the current column arrived (``mode``, ``case``)."""
        self.done += 1
        self.column_done += 1
        if self.quiet:
            return
        if self.tty:
            self._draw(f"{mode} {case}")
            return
        now = self.clock()
        if self.done == self.total or self.last_plain is None or now - self.last_plain > self.interval_s:
            width = len(str(self.total))
            self._write(f"[{self.done:{width}d}/{self.total}] {self.column:<11} {mode:<6} {case}\n")
            self.last_plain = now

    def eta(self) -> float | None:
        """Seconds the current column still needs at its rate so far (None before its first result)."""
        if self.column_done == 0:
            return None
        rate = (self.clock() - self.column_start) / self.column_done
        return rate * max(0, self.column_total - self.column_done)

    def line(self, what: str = "", cut: bool = True) -> str:
        """The terminal line of the current column (without the carriage return), ``what`` after the bar;
        cut to :data:`WIDTH` characters when ``cut``."""
        total = max(1, self.column_total)
        filled = min(BAR, BAR * self.column_done // total)
        eta = self.eta()
        text = (f"{self.column:<11} [{'#' * filled}{'.' * (BAR - filled)}] {self.column_done}/{self.column_total} "
                f"{100 * self.column_done // total:3d}% {duration(self.clock() - self.column_start)} "
                f"ETA {'?' if eta is None else duration(eta)}")  # fmt: skip
        text = f"{text}  {what}" if what else text
        return text[:WIDTH] if cut else text

    def note(self, text: str) -> None:
        """A line that stays: on a terminal it ends the column's bar line first (``text`` after it)."""
        if self.quiet:
            return
        if self.tty and self.open_line:
            self._write("\r" + self.line(text, cut=False).ljust(WIDTH) + "\n")
            self.open_line = False
            return
        self._write(text + "\n")

    def _draw(self, what: str) -> None:
        self._write("\r" + self.line(what).ljust(WIDTH))
        self.open_line = True

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
