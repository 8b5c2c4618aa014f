"""The README's main command installs everything ``mpx conformance`` needs (issue 33, item 4).

Both sides are read from the files: the "X is not installed" skip reasons the conformance suite can
emit (string literals and f-strings of ``tools/conformance`` and ``tools/mpx_tools``, with
``{BACKENDS[...]}`` expanded to every backend's module), and what the main command installs (``[all]``
with the extras it names in turn, the tools' extras it pulls, and the command's other ``pip install``
lines).  A skip whose package is not among them would show up in a fresh clone's report.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest

from mpx_tools import workers

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tools" / "conformance", ROOT / "tools" / "mpx_tools"]
TABLES = {"BACKENDS": workers.BACKENDS, "FRAMEWORKS": workers.FRAMEWORKS}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(req: str) -> tuple[str, list[str]]:
    """(normalized name, extras) of a requirement string such as ``mpx-tools[bench] @ URL`` or ``jax>=0.10``."""
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", req)
    assert m, req
    return _norm(m.group(1)), [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]


def _installed_by_main_command() -> tuple[set[str], set[tuple[str, str]]]:
    """The normalized distribution names the main command installs (what the metadata says, not pip's run)
    and the (distribution, extra) pairs it pulls on the way."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    projects = {
        _norm(t["project"]["name"]): t["project"]
        for t in (tomllib.loads((f / "pyproject.toml").read_text()) for f in (ROOT, ROOT / "tools"))
    }
    text = (ROOT / "README.md").read_text()
    command = text.split("<!-- main-command -->", 1)[1].split("```")[1].removeprefix("bash\n").strip()
    todo: list[tuple[str, list[str]]] = []
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] != ["pip", "install"]:
            continue
        skip_next = False
        for word in words[2:]:
            if skip_next or word in ("-c", "--constraint"):
                skip_next = word in ("-c", "--constraint")
                continue
            if word.startswith("-"):
                continue
            todo.append(("mpx-precision", _requirement(word)[1]) if word.startswith(".") else _requirement(word))
    assert todo, f"the main command installs nothing: {command}"
    out: set[str] = set()
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extras = todo.pop()
        out.add(name)
        project = projects.get(name)
        if project is None:
            continue
        for req in project.get("dependencies", []):
            todo.append(_requirement(req))
        for extra in extras:
            if (name, extra) not in seen:
                seen.add((name, extra))
                todo.extend(_requirement(r) for r in project["optional-dependencies"][extra])
    return out, seen


def _skip_packages() -> dict[str, str]:
    """module -> the source line of an "X is not installed" reason the suite can emit."""
    found: dict[str, str] = {}
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            if path.name.startswith(("test_", "conftest")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.JoinedStr | ast.Constant):
                    continue
                parts = node.values if isinstance(node, ast.JoinedStr) else [node]
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                for i, part in enumerate(parts):
                    text = part.value if isinstance(part, ast.Constant) else None
                    if not isinstance(text, str) or "is not installed" not in text:
                        continue
                    if text.startswith(" is not installed") and i > 0:  # f"{TABLE[key]} is not installed"
                        value = parts[i - 1]
                        assert isinstance(value, ast.FormattedValue), where
                        table = ast.unparse(value.value).split("[", 1)[0]
                        assert table in TABLES, f"{where}: cannot tell which package {table} names"
                        found.update(dict.fromkeys(TABLES[table].values(), where))
                    for name in re.findall(r"([A-Za-z0-9_.-]+) is not installed", text):
                        found[name] = where
    return found


def test_the_suite_says_not_installed_somewhere():
    """The scan finds the reasons it guards (the backends' and the models group's): it cannot pass empty."""
    found = _skip_packages()
    assert set(workers.BACKENDS.values()) <= set(found) and {"transformers", "deepspeed"} <= set(found), found


def test_the_main_command_installs_every_package_a_not_installed_skip_names():
    installed, _ = _installed_by_main_command()
    known = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in _skip_packages().items():
        dists = {_norm(d) for d in known.get(module, [])} | {_norm(module)}
        if not dists & installed:
            missing[module] = where
    assert not missing, f"skips name packages the README's main command does not install: {missing}"


def test_every_extra_a_skip_suggests_is_pulled_by_the_main_command():
    """A hint such as ``pip install 'mpx-precision[integrations]'`` names an extra that ``[all]`` pulls."""
    _, extras = _installed_by_main_command()
    hints = {
        (name.strip(), str(path.relative_to(ROOT)))
        for folder in SOURCES
        for path in folder.rglob("*.py")
        if not path.name.startswith("test_")
        for group in re.findall(r"pip install '?mpx-precision\[([a-z0-9_,-]+)\]", path.read_text())
        for name in group.split(",")
    }
    assert hints, "no skip hints an extra: the scan is broken"
    missing = {(name, where) for name, where in hints if ("mpx-precision", name) not in extras}
    assert not missing, f"skips suggest extras the main command does not install: {missing}"
