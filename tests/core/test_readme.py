"""The README's core examples (Policies, Loss scaling) run as written; they import mpx only."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_core_examples_run():
    text = README.read_text()
    core = text[text.index("## Policies") : text.index("## PyTorch")]
    blocks = re.findall(r"```python\n(.*?)```", core, re.S)
    assert len(blocks) >= 2
    for code in blocks:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    main = text.split("<!-- main-command -->", 1)[1].split("```")[1]
    tests = text.split("<!-- test-command -->", 1)[1].split("```")[1]
    assert "mpx conformance" in main and "pip install" in main
    assert "tests/run.py" in tests and "pip install" in tests
    assert text.index("<!-- main-command -->") < text.index("<!-- test-command -->") < text.index("## Policies")
