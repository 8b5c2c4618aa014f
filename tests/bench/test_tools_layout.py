"""How the repository is laid out: the library and the tools as two distributions, the tools side by side.

- tools/ (distribution ``mpx-tools``) holds ``mpx_tools`` (what the tools share), ``conformance``,
  ``mpx_bench`` and ``mpx_compare``; no tool imports another tool's modules (not even inside a
  function), only the library, third parties and ``mpx_tools``;
- the library's wheel ships the library's packages only;
- the README's two commands install the same library extras (the test command without ``tools``, whose
  editable copy it installs itself).

Read from the files (nothing is imported).  No import circles and no module over 600 lines, in the
library and the tools alike: tests/core/test_structure.py.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
#: The tools' packages, and the one they share.
TOOL_PACKAGES = ("conformance", "mpx_bench", "mpx_compare")
SHARED = "mpx_tools"


def _packages(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file())


LIBRARY_PACKAGES = [p for p in _packages(ROOT) if p == "mpx" or p.startswith("mpx_")]


def _imported(path: Path, package: list[str]) -> set[str]:
    """The top-level packages a module of ``package`` (its dotted parts) imports, at any level of the file
    (inside functions too); relative imports are its own package's."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    found |= {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level
    }
    if any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree)):
        found.add(package[0])
    return {m.split(".")[0] for m in found}


def test_the_tools_are_the_packages_of_tools():
    assert _packages(TOOLS) == sorted([*TOOL_PACKAGES, SHARED])
    assert not set(LIBRARY_PACKAGES) & {*TOOL_PACKAGES, SHARED}
    assert not [p for p in TOOL_PACKAGES if (ROOT / p).exists()], "a tool is still beside the library"


@pytest.mark.parametrize("package", [*TOOL_PACKAGES, SHARED])
def test_a_tool_imports_no_other_tool(package):
    """Each tool imports the library, third parties and mpx_tools; mpx_tools imports no tool."""
    others = {*TOOL_PACKAGES, SHARED} - {package} - ({SHARED} if package != SHARED else set())
    for path in sorted((TOOLS / package).rglob("*.py")):
        wrong = sorted(_imported(path, [package]) & others)
        assert wrong == [], f"{path.relative_to(ROOT)} imports {wrong}"


# -- packaging: two distributions, the README's two commands ------------------------------------------------


def _pyproject(folder: Path) -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    return tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))


def _readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split(f"<!-- {marker} -->", 1)[1].split("```")[1].removeprefix("bash\n").strip()


def _extras_installed(command: str, target: str) -> set[str]:
    """The extras of ``target`` (``.`` or ``./tools``) that ``pip install -e "TARGET[...]"`` names in ``command``."""
    found = re.findall(r'-e\s+"?' + re.escape(target) + r'(?:\[([^\]]*)\])?"?(?=\s)', command)
    assert found, f"the command installs no {target}: {command}"
    return {e.strip() for group in found for e in group.split(",") if e.strip()}


def _closure(extras: set[str]) -> set[str]:
    """``extras`` and every library extra they name in turn (``test`` names ``mpx-precision[integrations]``)."""
    table, out, todo = _pyproject(ROOT)["project"]["optional-dependencies"], set(), list(extras)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            for req in table.get(name, []):
                if req.startswith("mpx-precision["):
                    todo.extend(e.strip() for e in req.split("[", 1)[1].split("]", 1)[0].split(","))
    return out


def test_the_library_wheel_ships_the_library_only():
    library = _pyproject(ROOT)
    assert library["project"]["name"] == "mpx-precision"
    assert sorted(library["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]) == LIBRARY_PACKAGES
    assert library["project"]["scripts"] == {"mpx": "mpx.cli:main"}
    tools = _pyproject(TOOLS)
    assert tools["project"]["name"] == "mpx-tools" and tools["project"]["dependencies"] == ["mpx-precision"]
    assert sorted(tools["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]) == _packages(TOOLS)
    assert tools["tool"]["hatch"]["version"] == {"path": "../mpx/_version.py"}  # one version for both
    assert set(tools["project"]["entry-points"]["mpx.commands"]) == {"conformance", "bench", "doctor", "compare",
                                                                     "history"}  # fmt: skip


def test_the_library_extras_install_the_tools_from_the_checkout():
    extras = _pyproject(ROOT)["project"]["optional-dependencies"]
    tools_extras = _pyproject(TOOLS)["project"]["optional-dependencies"]
    assert extras["tools"] == ["mpx-tools[bench,compare] @ {root:uri}/tools"]
    for name in ("bench", "compare"):
        assert name in tools_extras and extras[name] == [f"mpx-tools[{name}] @ {{root:uri}}/tools"]
    (everything,) = extras["all"]
    assert everything.startswith("mpx-precision[") and "tools" in everything


def test_the_readme_test_command_installs_what_the_main_command_does():
    """The test command installs every library extra that ``all`` names except ``tools`` (pip refuses the
    tools twice, once from ``.[all]`` and once editable), and the tools themselves, editable, with theirs."""
    (everything,) = _pyproject(ROOT)["project"]["optional-dependencies"]["all"]
    in_all = set(everything.split("[", 1)[1].rstrip("]").split(","))
    main, tests = _readme_command("main-command"), _readme_command("test-command")
    assert _extras_installed(main, ".") == {"all"} and "mpx conformance" in main
    library = _extras_installed(tests, ".")
    assert _closure(library) >= in_all - {"tools"} and "test" in library
    assert not library & {"all", "tools", "bench", "compare"}, library
    tools_extras = set(_pyproject(TOOLS)["project"]["optional-dependencies"])
    assert _extras_installed(tests, "./tools") == tools_extras
    assert "python tests/run.py" in tests
    if sys.platform.startswith("linux"):
        assert "-c ci/constraints.txt" in tests and "-c ci/constraints.txt" in main
