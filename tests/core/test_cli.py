"""The ``mpx`` command line of the library: ``policy``, and how it finds the commands other packages register.

The tools' own commands (conformance, bench, doctor, compare, history) are tested with the tools, in
tests/bench/test_cli_tools.py; this suite runs without them (and without any framework).
"""

import ast
import json
import os
import subprocess
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import mpx.cli
from mpx.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(*args, **kwargs):
    # the bound only catches a hang: these commands stop before any framework loads (seconds)
    return subprocess.run([sys.executable, "-m", "mpx", *args], capture_output=True, text=True, timeout=600,
                          **kwargs)  # fmt: skip


def test_version():
    import mpx

    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mpx {mpx.__version__}"


def test_policy_show_text(capsys):
    assert main(["policy", "show", "mixed_float16"]) == 0
    out = capsys.readouterr().out
    assert "params=float32,compute=float16,output=float32  (mixed_float16)" in out
    assert "category:normalization" in out and "loss scaling (default) dynamic" in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert lines["matmul"] == ["lower", "float16"]
    assert lines["softmax"] == ["float32", "float32"]
    assert lines["relu"] == ["passthrough", "float32"]


def test_policy_show_json(capsys):
    assert main(["policy", "show", "--json", "p=bf16"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "bfloat16" and info["loss_scaling"] == "none"
    assert info["ops"]["linear"] == {"class": "lower", "result_dtype": "bfloat16"}
    assert info["ops"]["layer_norm"] == {"class": "float32", "result_dtype": "float32"}


def test_policy_list(capsys):
    assert main(["policy", "list"]) == 0
    out = capsys.readouterr().out
    assert "mixed_bfloat16" in out and "bf16-mixed" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["policy", "show", "compute=int8"], "mpx policy show: compute: 'int8' is not a floating dtype"),
        (["frobnicate"], "mpx: unknown command 'frobnicate': the installed commands are policy"),
        ([], "a command is required"),
        (["policy"], "a subcommand is required"),
        (["policy", "show"], "the following arguments are required: spec"),
    ],
)
def test_bad_usage_exits_2_with_one_line(args, message):
    out = run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr
    assert "Traceback" not in out.stderr


def test_an_unknown_command_names_the_installed_ones_and_where_others_come_from():
    out = run("frobnicate", "--flag")
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    message = out.stderr.strip()
    assert message.startswith("mpx: unknown command 'frobnicate': the installed commands are policy")
    assert message.endswith(
        "further commands come from packages that register 'mpx.commands' entry points, such as the mpx tools "
        "(pip install -e ./tools in a checkout of mpx)"
    )
    for entry in mpx.cli.registered_commands():  # whatever is installed here is named
        assert entry.name in message


# -- commands registered by other packages (fake ones here: the tools' are tested in tests/bench) ------------


def _fake_command(name: str = "mpx_fake_tool") -> types.ModuleType:
    """A module providing the command protocol: help, add_arguments(parser), run(args) -> int."""
    module = types.ModuleType(name)
    module.help = "a command registered by another package"

    def add_arguments(parser):
        parser.add_argument("--times", type=int, default=1)

    def run(args):
        print("ran " * args.times)
        return 3

    module.add_arguments, module.run = add_arguments, run
    return module


@pytest.fixture
def registered(monkeypatch):
    """Replace the installed ``mpx.commands`` entry points with ``{name: "module:attr"}``."""

    def register(**commands):
        entries = [EntryPoint(name, value, mpx.cli.COMMANDS_GROUP) for name, value in commands.items()]
        monkeypatch.setattr(mpx.cli, "entry_points", lambda group: [e for e in entries if e.group == group])

    return register


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps long help lines


def test_a_registered_command_is_listed_parsed_and_run(registered, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mpx_fake_tool", _fake_command())
    registered(fake="mpx_fake_tool", policy="mpx_fake_tool")  # policy is the library's own: never replaced
    assert "fake a command registered by another package" in _help(capsys)
    assert [e.name for e in mpx.cli.registered_commands()] == ["fake"]
    assert main(["fake", "--times", "2"]) == 3
    assert capsys.readouterr().out == "ran ran \n"
    assert main(["policy", "list"]) == 0
    assert main(["fake", "--bogus"]) == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_command_whose_import_fails_is_listed_with_the_reason(registered, monkeypatch, capsys):
    # None in sys.modules is how Python itself blocks an import: importing it raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "mpx_fake_tool", None)
    registered(fake="mpx_fake_tool:COMMAND")
    reason = "importing mpx_fake_tool failed: ModuleNotFoundError: import of mpx_fake_tool halted; None in sys.modules"
    assert f"fake unavailable: {reason}" in _help(capsys)
    for args in (["fake"], ["fake", "--backend", "torch", "--bogus"], ["fake", "--help"]):
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"mpx fake: unavailable: {reason}\n", args
    assert main(["policy", "list"]) == 0  # the other commands still run
    assert "unavailable" not in _help(capsys).replace("fake unavailable", "")


def test_an_entry_point_that_is_no_command_is_listed_with_the_reason(registered, monkeypatch, capsys):
    broken = _fake_command()
    del broken.run
    monkeypatch.setitem(sys.modules, "mpx_fake_tool", broken)
    monkeypatch.setitem(sys.modules, "mpx_other_tool", types.ModuleType("mpx_other_tool"))
    registered(norun="mpx_fake_tool", missing="mpx_other_tool:COMMAND")
    text = _help(capsys)
    assert (
        "norun unavailable: mpx_fake_tool is not an mpx command: it needs help, add_arguments and run" in text
    )
    assert "missing unavailable: loading mpx_other_tool:COMMAND failed: AttributeError: " in text
    assert main(["norun"]) == 2
    assert capsys.readouterr().err.startswith("mpx norun: unavailable: mpx_fake_tool is not an mpx command")


def _fake_distribution(folder: Path, module_source: str) -> dict[str, str]:
    """An installed distribution on ``folder`` (a dist-info and a module) registering ``mpx hello``;
    returns an environment that puts it on the path."""
    (folder / "mpx_hello_tool.py").write_text(module_source)
    info = folder / "mpx_hello_tool-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mpx-hello-tool\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mpx.commands]\nhello = mpx_hello_tool:COMMAND\n")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
    }


HELLO = """
import types
def _add(parser):
    parser.add_argument("who")
def _run(args):
    print(f"hello {args.who}")
    return 0
COMMAND = types.SimpleNamespace(help="say hello", add_arguments=_add, run=_run)
"""


def test_an_installed_distribution_adds_a_command_through_its_entry_point(tmp_path):
    """Real discovery, in a process of its own: a distribution on the path registers ``mpx.commands``."""
    env = _fake_distribution(tmp_path, HELLO)
    listing = run("--help", env=env)
    assert listing.returncode == 0 and "hello" in listing.stdout and "say hello" in listing.stdout
    out = run("hello", "world", env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "hello world\n", "")
    out = run("hello", env=env)
    assert out.returncode == 2 and "the following arguments are required: who" in out.stderr


def test_a_missing_dependency_of_a_registered_command_is_named(tmp_path):
    """A real failed import in a fresh process: a command whose package needs something not installed."""
    env = _fake_distribution(tmp_path, "import mpx_no_such_dependency\n" + HELLO)
    why = "importing mpx_hello_tool failed: ModuleNotFoundError: No module named 'mpx_no_such_dependency'"
    listing = run("--help", env=env)
    assert listing.returncode == 0 and listing.stderr == ""
    assert f"hello unavailable: {why}" in " ".join(listing.stdout.split())
    out = run("hello", "world", env=env)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"mpx hello: unavailable: {why}\n")


# -- the library names no tool ---------------------------------------------------------------------------

#: The tools' packages (tools/ in the repository): the library imports none and names none.
TOOL_PACKAGES = ("conformance", "mpx_bench", "mpx_compare", "mpx_tools")


def test_the_library_names_no_tool_module():
    """No import of a tool in any module of the library, at any level, and no string naming a tool module
    (an importlib call or an entry point written into the core)."""
    packages = ["mpx", *sorted(p.name for p in ROOT.glob("mpx_*") if (p / "__init__.py").exists())]
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            named = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            named += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
            named += [
                n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            ]
            tools = [m for m in named if m.split(".")[0].split(":")[0] in TOOL_PACKAGES]
            assert tools == [], f"{path.relative_to(ROOT)} names {tools}"


def test_import_mpx_and_its_command_line_load_no_tool(loaded_by):
    assert loaded_by("import mpx, mpx.cli", TOOL_PACKAGES) == []
