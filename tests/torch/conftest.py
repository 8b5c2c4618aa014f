import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# two_ranks (the 2-process launcher and the workers' main), shared by the multi-rank tests and their
# workers, imports as a top-level module (the workers run as scripts from this folder)
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

# The slow-policy warning (torch float16 on CPU) is tested on its own in test_slow_warning.py.
os.environ.setdefault("MPX_NO_SLOW_WARNING", "1")

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()

#: the torch calls that copy a value to the host (a sync on an accelerator)
HOST_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy"}


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every torch call inside the ``with`` block that copies a value to the host (``.syncs``)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads():
    """:class:`HostReads`, the recorder of host reads: ``with host_reads() as rec: ...; assert rec.syncs == []``."""
    return HostReads


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            [
                "cpu",
                pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device")),
            ],
        )


ROOT = Path(__file__).resolve().parents[2]


def example(name: str) -> str:
    """The ```python block whose first line is `# readme-example: NAME`, from README.md or docs/."""
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if block.splitlines()[0].strip() == f"# readme-example: {name}":
                return block
    raise AssertionError(f"no ```python block marked '# readme-example: {name}' in README.md or docs/")


@pytest.fixture
def run_example(tmp_path):
    """``run_example(NAME)``: run the example block NAME (README.md or docs/) in a fresh interpreter, from the
    repository root; returns its stdout, failing with its output when it exits non-zero.  The time bound only
    catches a hang."""

    def run(name: str) -> str:
        # a file, not -c (torch.multiprocessing.spawn re-imports __main__), named so it shadows no module
        script = tmp_path / f"example_{name.replace('-', '_')}.py"
        script.write_text(example(name))
        attempts = 0
        while True:
            attempts += 1
            out = subprocess.run(
                [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=1800
            )
            # gloo sometimes aborts a spawned rank while its threads shut down, after the example's work and
            # output ("terminate called without an active exception"; CI saw it at stop 37 and here once in
            # about ten runs of the DDP example): run it once more then, and only then
            teardown = "terminate called without an active exception" in out.stderr
            if out.returncode == 0 or not teardown or attempts == 2:
                break
        assert out.returncode == 0, f"{name} (attempt {attempts}):\n{out.stdout}\n{out.stderr}"
        return out.stdout

    return run
