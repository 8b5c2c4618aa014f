"""The README's JAX examples run as written (each in a fresh interpreter)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["flax-nnx", "flax-linen", "jax-autocast", "jax-quickstart", "jax-shard-map"]
#: what an example's output must contain, where it says so
EXPECT = {"jax-quickstart": "float32 65536.0", "jax-shard-map": "4 2"}  # 4 host devices, 2 optimizer steps


def example(name):
    for source in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        if not source.exists():
            continue
        for block in re.findall(r"```python\n(.*?)```", source.read_text(), flags=re.S):
            if block.splitlines()[0].strip() == f"# readme-example: {name}":
                return block
    raise AssertionError(f"no README.md or docs/ block marked '# readme-example: {name}'")


@pytest.mark.parametrize("name", NAMES)
def test_readme_example_runs(name):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example picks its own devices
    proc = subprocess.run(
        [sys.executable, "-c", example(name)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert EXPECT.get(name, "") in proc.stdout
