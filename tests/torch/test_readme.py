"""The README's PyTorch examples run as written (each in a fresh interpreter)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: example name -> what its output must contain
NAMES = {"torch": "accuracy", "torch-quickstart": "torch.float32 65536.0", "torch-ddp": "[(65536.0, 3), (65536.0, 3)]"}


def example(name: str) -> str:
    """The ```python block whose first line is `# readme-example: NAME`, from README.md or docs/."""
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            if block.splitlines()[0].strip() == f"# readme-example: {name}":
                return block
    raise AssertionError(f"no ```python block marked '# readme-example: {name}' in README.md or docs/")


@pytest.mark.parametrize("name", list(NAMES))
def test_readme_example_runs(name, tmp_path):
    script = tmp_path / "example.py"  # a file, not -c: torch.multiprocessing.spawn re-imports __main__
    script.write_text(example(name))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{name}:\n{out.stdout}\n{out.stderr}"
    assert NAMES[name] in out.stdout
