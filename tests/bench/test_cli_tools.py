"""The tools' commands on the ``mpx`` command line (``conformance``, ``bench``, ``doctor``, ``compare``,
``history``): registered as ``mpx.commands`` entry points by tools/pyproject.toml, found by ``mpx.cli``.

User errors exit 2 with one line and no traceback; reports are never clobbered.  This process imports
no framework (the commands' workers run in processes of their own).
"""

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import mpx
from mpx.cli import main

ROOT = Path(__file__).resolve().parents[2]
#: The commands the tools register, and the object each entry point names.
TOOL_COMMANDS = {
    "bench": "mpx_bench.cli:BENCH",
    "compare": "mpx_compare.cli:COMMAND",
    "conformance": "conformance.runner:COMMAND",
    "doctor": "mpx_bench.cli:DOCTOR",
    "history": "mpx_compare.history_cli:COMMAND",
}
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "optax", "torchao", "transformers")


def run(*args, **kwargs):
    # the bound only catches a hang: these commands stop before any framework loads (seconds)
    return subprocess.run([sys.executable, "-m", "mpx", *args], capture_output=True, text=True, timeout=600,
                          **kwargs)  # fmt: skip


def test_the_tools_register_their_commands_as_entry_points():
    from mpx_tools.command import Command

    found = {e.name: e.value for e in entry_points(group="mpx.commands")}
    assert found == TOOL_COMMANDS
    for entry in entry_points(group="mpx.commands"):
        command = entry.load()
        assert isinstance(command, Command) and command.help, entry


def test_listing_the_commands_imports_no_framework(loaded_by):
    assert loaded_by("import mpx.cli; mpx.cli.build_parser()", FRAMEWORKS) == []


def test_an_unknown_command_names_every_tool_command():
    out = run("frobnicate")
    assert out.returncode == 2 and out.stdout == ""
    assert (
        "the installed commands are policy, bench, compare, conformance, doctor and history; " in out.stderr
    )


def test_a_tool_command_runs_from_any_folder(tmp_path):
    """The workers start in the tools' folder, whatever the caller's (here an empty one)."""
    out = run("doctor", "--backend", "torch", "--probe-seconds", "0", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mpx_version"] == mpx.__version__


def test_conformance_unknown_backend_exits_2_naming_the_known_ones():
    out = run("conformance", "--backend", "mxnet")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "mpx conformance: unknown backend 'mxnet'; available: torch, tf, jax, keras-jax, keras-torch"
    )


def test_conformance_help_lists_the_keras_columns_and_bench_only_the_frameworks():
    conformance = " ".join(run("conformance", "--help").stdout.split())  # argparse wraps the help text
    assert "torch, tf, jax, keras-jax, keras-torch" in conformance
    for command in ("bench", "compare"):
        out = run(command, "--backend", "keras-jax")
        assert out.returncode == 2 and "unknown backend 'keras-jax'; available: torch, tf, jax" in out.stderr


def test_help_lists_every_command():
    out = run("--help")
    for command in ("policy", "conformance", "bench", "doctor", "compare", "history"):
        assert command in out.stdout
    assert "unavailable" not in out.stdout


def test_a_missing_dependency_of_a_command_is_named(tmp_path):
    """A real failed import in a fresh process: an ``mpx_bench`` whose dependency is not installed."""
    (tmp_path / "mpx_bench").mkdir()
    (tmp_path / "mpx_bench" / "__init__.py").write_text("import mpx_no_such_dependency\n")
    (tmp_path / "mpx_bench" / "cli.py").write_text("")
    listing = subprocess.run([sys.executable, "-m", "mpx", "--help"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    why = "importing mpx_bench.cli failed: ModuleNotFoundError: No module named 'mpx_no_such_dependency'"
    assert listing.returncode == 0 and listing.stderr == ""
    help_text = " ".join(listing.stdout.split())
    assert f"bench unavailable: {why}" in help_text and f"doctor unavailable: {why}" in help_text
    assert "conformance run the conformance suite" in help_text
    out = subprocess.run([sys.executable, "-m", "mpx", "doctor", "--json"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"mpx doctor: unavailable: {why}\n")


# -- every command: user errors exit 2 with one line and no traceback; reports are never clobbered ---------


def _good_report(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text('{"results": ["an earlier, good run"]}')
    (folder / "report.html").write_text("<!doctype html>earlier")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "args,message",
    [
        (["conformance", "--only", "nosuchcase"], "--only 'nosuchcase' matches no case"),
        (["conformance", "--only", ","], "matches no case"),
        (["conformance", "--out", "/proc/nope"], "--out /proc/nope: cannot write there"),
        (["conformance", "--out", "{file}"], "exists and is not a folder"),
        (["conformance", "--out", "{other}"], "a folder with other files (no report.json)"),
        (["bench", "--out", "/proc/nope"], "mpx bench: --out: cannot write /proc/nope"),
        (["bench", "--out", "{file}"], "mpx bench: --out: "),
        (["bench", "--steps", "two"], "mpx bench: --steps: expected an integer, got 'two'"),
        (["bench", "--policy", "compute=int8"], "mpx bench: compute: 'int8' is not a floating dtype"),
        (["bench", "--model", "resnet"], "mpx bench: unknown model 'resnet'"),
        (["bench", "--backend", "mxnet"], "mpx bench: unknown backend 'mxnet'"),
        (["doctor", "--probe-seconds", "-1"], "mpx doctor: --probe-seconds: must be at least 0"),
        (["doctor", "--backend", "mxnet"], "mpx doctor: unknown backend 'mxnet'"),
        (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
        (["policy", "list", "extra"], "unrecognized arguments: extra"),
    ],
)
def test_user_errors_exit_2_without_traceback(args, message, tmp_path):
    if "/proc/nope" in args and not (tmp_path.anchor and __import__("os").path.isdir("/proc/self")):
        pytest.skip("no /proc here")
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    args = [a.format(file=tmp_path / "file", other=tmp_path / "other") for a in args]
    out = run(*args)
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_only_matching_nothing_stops_before_any_worker_and_keeps_the_report(tmp_path, monkeypatch, capsys):
    from conformance import runner

    def no_worker(*args, **kwargs):
        raise AssertionError(f"a worker was started: {args}")

    monkeypatch.setattr(runner.subprocess, "Popen", no_worker)
    monkeypatch.setattr(runner.subprocess, "run", no_worker)
    before = _good_report(tmp_path / "rep")
    assert main(["conformance", "--only", "nosuchcase", "--out", str(tmp_path / "rep")]) == 2
    assert "'nosuchcase'" in capsys.readouterr().err
    assert _snapshot(tmp_path / "rep") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # no staging folder left


def test_a_crashed_worker_never_replaces_a_good_report(tmp_path, monkeypatch):
    """A real worker process that dies (here: a backend name its argument parser refuses, so no framework loads)."""
    from conformance import report, runner

    monkeypatch.setattr(runner, "is_installed", lambda backend: True)
    before = _good_report(tmp_path / "rep")
    data = runner.run(["bogus"], tmp_path / "rep", only="scaler.defaults", quiet=True)
    assert _snapshot(tmp_path / "rep") == before
    assert data["out"] == str(tmp_path / "rep.failed")
    saved = json.loads((tmp_path / "rep.failed" / "report.json").read_text())
    (crash,) = [r for r in saved["results"] if r["case"] == "worker"]
    assert crash["status"] == "error" and crash["observed"].startswith("exit 2 after 0 results")
    assert "invalid choice: 'bogus'" in crash["detail"]
    assert not report.mpx_passes(data)  # a crashed worker cannot pass: exit status 1
    assert "adapter errors: 1" in report.terminal(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep", "rep.failed"]


def test_a_new_report_replaces_the_old_one_whole(tmp_path, monkeypatch):
    from conformance import report

    out = tmp_path / "rep"
    _good_report(out)
    (out / "stale.svg").write_text("from an older version")
    data = {"mpx_version": "0", "python": "3", "machine": "x", "seconds": 0.0, "backends": {}, "cases": {},
            "results": []}  # fmt: skip
    report.write_all(data, out)
    assert sorted(p.name for p in out.iterdir()) == ["plots", "report.html", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["findings"] == []


def test_every_command_refuses_an_unknown_option_with_exit_2():
    from mpx.cli import _command_names, build_parser

    commands = _command_names(build_parser())
    assert {"policy", "conformance", "bench", "doctor"} <= set(commands)
    for command in commands:
        out = run(command, "--no-such-option")
        assert out.returncode == 2, (command, out.stderr)
        assert out.stdout == "" and "Traceback" not in out.stderr, command
        assert len(out.stderr.strip().splitlines()) == 1 and "--no-such-option" in out.stderr, command


# -- mpx history plot ---------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path, capsys) -> None:
    path = mpx.ScalerHistory.reference(mpx.ScalerConfig(growth_interval=2), [True, True, False]).save(
        tmp_path / "h.json"
    )
    assert main(["history", "plot", str(path), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "3 steps, 1 skipped" in capsys.readouterr().out


@pytest.mark.parametrize("content", [None, "not json", '{"format": "mpx.scaler_history/1"}'])
def test_plot_bad_file_exits_2_without_traceback(tmp_path, content) -> None:
    path = tmp_path / "h.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mpx", "history", "plot", str(path)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith("mpx history: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not path.with_suffix(".png").exists()
