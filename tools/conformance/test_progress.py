"""``mpx conformance``'s progress display (conformance/progress.py): a bar per column with an estimate from
the measured rate on a terminal, the plain lines off one.  A fake terminal (a StringIO whose isatty() says
True) and a fake clock: nothing here waits."""

from __future__ import annotations

import io

import pytest

from conformance.progress import BAR, WIDTH, ColumnProgress, duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(stream: io.StringIO) -> list[str]:
    """What a terminal shows: each carriage return rewrites the line."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in stream.getvalue().split("\n")]


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.9, "59s"), (61, "1m01s"), (3599, "59m59s"),
                                               (3720, "1h02m"), (-3, "0s")])  # fmt: skip
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_a_terminal_gets_one_bar_line_per_column_with_done_total_and_an_eta_from_the_rate():
    out, clock = Terminal(), Clock()
    p = ColumnProgress(8, stream=out, clock=clock)
    p.start("tf", 4)
    assert _lines(out)[-1] == f"tf          [{'.' * BAR}] 0/4   0% 0s ETA ?"
    clock.now += 3.0
    p.advance("native", "scaler.a")  # 3 s per result so far: 3 to come, 9 s
    assert _lines(out)[-1] == f"tf          [{'#' * (BAR // 4)}{'.' * (BAR - BAR // 4)}] 1/4  25% 3s ETA 9s  native scaler.a"
    clock.now += 1.0
    p.advance("native", "scaler.b")  # 2 s per result: 2 to come, 4 s
    assert _lines(out)[-1].endswith("2/4  50% 4s ETA 4s  native scaler.b")
    clock.now += 116.0
    p.advance("mpx", "scaler.a")  # 40 s per result: 1 to come
    assert "3/4  75% 2m00s ETA 40s  mpx scaler.a" in _lines(out)[-1]
    p.advance("mpx", "scaler.b")
    p.note("tf: 4 results in 120.0s")
    assert _lines(out)[-2] == f"tf          [{'#' * BAR}] 4/4 100% 2m00s ETA 0s  tf: 4 results in 120.0s"
    assert out.getvalue().count("\n") == 1  # one line stays per column; the rest rewrote it in place
    p.start("jax", 4)  # the next column starts its own bar, with its own rate
    clock.now += 1.0
    p.advance("native", "ops.x")
    assert _lines(out)[-1].startswith("jax         [") and "1/4  25% 1s ETA 3s  native ops.x" in _lines(out)[-1]
    assert all(len(line) <= WIDTH for line in _lines(out)[-1:])


def test_a_long_case_name_is_cut_to_the_terminal_width():
    out, clock = Terminal(), Clock()
    p = ColumnProgress(2, stream=out, clock=clock)
    p.start("keras-torch", 2)
    p.advance("native", "numerics." + "x" * 200)
    assert len(_lines(out)[-1]) == WIDTH


def test_off_a_terminal_plain_lines_at_intervals_and_the_last_result():
    out, clock = io.StringIO(), Clock()
    p = ColumnProgress(6, stream=out, clock=clock, interval_s=5.0)
    p.start("tf", 3)
    for case in ("a", "b", "c"):
        clock.now += 2.0
        p.advance("native", case)
    p.note("tf: 3 results")
    p.start("jax", 3)
    for case in ("a", "b", "c"):
        clock.now += 2.0
        p.advance("mpx", case)
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "[1/6] tf          native a",  # the first result
        "tf: 3 results",  # b and c came within 5 s of it
        "[4/6] jax         mpx    a",  # 6 s after the last line
        "[6/6] jax         mpx    c",  # the last result, whatever the interval
    ]


def test_quiet_writes_nothing():
    out = Terminal()
    p = ColumnProgress(2, stream=out, quiet=True, clock=Clock())
    p.start("tf", 2)
    p.advance("native", "a")
    p.note("tf: done")
    assert out.getvalue() == ""
