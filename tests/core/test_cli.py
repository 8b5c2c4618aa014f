import json
import subprocess
import sys

import pytest

from mpx.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "mpx", *args], capture_output=True, text=True)


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
        (["frobnicate"], "invalid choice: 'frobnicate'"),
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


def test_conformance_unknown_backend_exits_2_naming_the_known_ones():
    out = run("conformance", "--backend", "mxnet")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == "mpx conformance: unknown backend 'mxnet'; available: torch, tf, jax"


def test_help_lists_every_command():
    out = run("--help")
    for command in ("policy", "conformance", "bench", "doctor"):
        assert command in out.stdout
