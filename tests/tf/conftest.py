"""Keras 3 / TensorFlow backend tests: skipped where TensorFlow is not installed."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
# The slow-policy warning (float16 on CPU) is tested on its own in test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
tf.get_logger().setLevel("ERROR")  # the property tests trace one small function per example


@pytest.fixture(autouse=True)
def _float32_global_policy():
    """Every test starts and ends with Keras's default float32 global policy (and mpx's, when loaded).

    Resetting mpx's global policy too gives back the op table's hold a mixed
    ``set_global_policy`` took, so no test leaves the dispatch installed for the next.
    """
    _reset_global_policy()
    yield
    _reset_global_policy()


def _reset_global_policy():
    if "mpx_keras" in sys.modules:
        sys.modules["mpx_keras"].set_global_policy("float32")
    keras.config.set_dtype_policy("float32")


# -- subprocesses: a hang detector, not a wall-clock limit ------------------------------------------
#: A child that neither writes output nor uses CPU time for this long is hung (a loaded machine slows a
#: child down, it does not stop it: importing TensorFlow alone uses CPU time all along).
STALL_S = 300.0
#: The bound on a child's whole run, only so that a child busy-looping forever still ends.
CAP_S = 3600.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc; 0.0 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_children(commands, *, env=None, cwd=None, stall_s=STALL_S, cap_s=CAP_S):
    """Run the ``commands`` (argv lists) at once; [(returncode, stdout, stderr)] when all have ended.

    Fails the test, after killing every child, when none of them has made progress (written output
    or used a second of CPU time) for ``stall_s`` seconds, or all together ran past ``cap_s``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        files = [(Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err")) for i in range(len(commands))]
        procs = []
        for command, (out, err) in zip(commands, files, strict=True):
            with out.open("w") as fo, err.open("w") as fe:
                procs.append(subprocess.Popen(command, env=env, cwd=cwd, stdout=fo, stderr=fe, text=True))
        start = seen = time.monotonic()
        last = None
        try:
            while any(p.poll() is None for p in procs):
                time.sleep(0.5)
                mark = [
                    (o.stat().st_size, e.stat().st_size, int(_cpu_seconds(p.pid)))
                    for p, (o, e) in zip(procs, files, strict=True)
                ]
                now = time.monotonic()
                if mark != last:
                    last, seen = mark, now
                if now - seen > stall_s or now - start > cap_s:
                    why = (
                        f"no output and no CPU time for {stall_s:.0f} s"
                        if now - seen > stall_s
                        else f"{cap_s:.0f} s"
                    )
                    tails = [e.read_text()[-2000:] for _, e in files]
                    pytest.fail(f"child processes hung ({why}); their stderr tails: {tails}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [(p.returncode, o.read_text(), e.read_text()) for p, (o, e) in zip(procs, files, strict=True)]


@pytest.fixture
def run_python():
    """:func:`run_children` for tests (a fixture, as test modules import no sibling module)."""
    return run_children
