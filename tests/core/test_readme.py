"""The README: what it starts with, its core examples (run as written; they import mpx only), its links,
and the packaging facts it states."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The docs pages this project's own README and docs examples live in (others' pages have their own tests).
DOCS = [README, ROOT / "docs" / "conformance.md", ROOT / "docs" / "performance.md", ROOT / "docs" / "design.md"]
#: Every marked example and the suite that runs it.
EXAMPLES = {
    "torch": "tests/torch/test_readme.py", "torch-quickstart": "tests/torch/test_readme.py",
    "keras-fit": "tests/tf/test_readme.py", "keras-custom-loop": "tests/tf/test_readme.py",
    "keras-quickstart": "tests/tf/test_readme.py",
    "flax-nnx": "tests/jax/test_readme.py", "flax-linen": "tests/jax/test_readme.py",
    "jax-autocast": "tests/jax/test_readme.py", "jax-quickstart": "tests/jax/test_readme.py",
    "slow-policy-warning": "tests/bench/test_readme.py",
    "torch-ddp": "tests/torch/test_readme.py", "keras-distributed": "tests/tf/test_readme.py",
    "jax-shard-map": "tests/jax/test_readme.py", "keras-jax": "tests/keras/test_readme.py",
}  # fmt: skip


def _core_section(text: str) -> str:
    return text[text.index("## Policies") : text.index("## PyTorch")]


def test_core_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", _core_section(README.read_text()), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_readme_starts_with_what_it_is_then_the_two_commands_then_a_quickstart():
    text = README.read_text()
    assert text.startswith("# mpx\n\nOne mixed-precision vocabulary for PyTorch, Keras/TensorFlow and JAX")
    main = text.split("<!-- main-command -->", 1)[1].split("```")[1]
    tests = text.split("<!-- test-command -->", 1)[1].split("```")[1]
    assert "mpx conformance" in main and "pip install" in main
    assert "tests/run.py" in tests and "pip install" in tests
    order = ["<!-- main-command -->", "<!-- test-command -->", "## Quickstart", "## Install", "## Documentation",
             "## Policies"]  # fmt: skip
    assert [text.index(h) for h in order] == sorted(text.index(h) for h in order)
    quick = text[text.index("## Quickstart") : text.index("## Install")]
    for name in ("torch-quickstart", "keras-quickstart", "jax-quickstart"):
        (block,) = re.findall(r"```python\n# readme-example: " + name + r"\n(.*?)```", quick, re.S)
        assert len(block.strip().splitlines()) <= 4, name  # imports and three lines


def test_every_python_block_is_run_by_a_test():
    for path in DOCS:
        text = path.read_text()
        if path == README:
            text = text.replace(_core_section(text), "")
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            first = block.splitlines()[0]
            assert first.startswith("# readme-example: "), f"{path.name}: an untested block: {first}"
            name = first.removeprefix("# readme-example: ").strip()
            assert name in EXAMPLES, f"{path.name}: {name} is run by no test"
            assert f'"{name}"' in (ROOT / EXAMPLES[name]).read_text(), name


def test_links_point_at_files_in_the_repository():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (path.parent / target).exists(), f"{path.name} links {target}, which is not in the repository"


def test_no_citation_of_files_that_are_not_in_the_repository():
    texts = [*DOCS, ROOT / "mpx" / "advice.py", ROOT / "tools" / "mpx_bench" / "doctor.py"]
    for path in texts:
        assert "REFERENCES" not in path.read_text(), path
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in (ROOT / "LICENSE").read_text()


def test_distribution_name_and_extras():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "mpx-precision"
    assert project["optional-dependencies"]["all"] == ["mpx-precision[torch,tf,jax,fp8,tools,integrations]"]  # tools: mpx-tools
    assert project["license"] == {"text": "Apache-2.0"}
    text = README.read_text()
    install_lines = [line for line in text.splitlines() if "pip install" in line]
    assert install_lines and not [line for line in install_lines if re.search(r"\bmpx\[", line)]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
