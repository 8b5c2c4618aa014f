"""The house rules, read from the sources (AST), so a change that breaks one fails here.

* The arithmetic is written once, in mpx/kernels: no backend module holds float-bit constants or
  bit casts (only its ``_array_ops.py`` table does), and a backend function named like a kernel
  (a quantize, a scale update, a ring buffer...) must call into ``mpx.kernels``.
* No package has an import circle, function-level imports included.
* ``import mpx`` loads numpy, ml_dtypes and the standard library only, and no tool.
* No module of the library or the tools is longer than 600 lines.

Nothing here imports a framework: the backends are parsed, not imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("mpx_torch", "mpx_keras", "mpx_tf", "mpx_jax")
LIBRARY = ("mpx", *BACKENDS)
#: every folder holding importable packages: the library at the root, the tools under tools/
TOOL_ROOT = ROOT / "tools" if (ROOT / "tools").is_dir() else ROOT
TOOLS = tuple(p for p in ("mpx_tools", "conformance", "mpx_bench", "mpx_compare") if (TOOL_ROOT / p).is_dir())

#: int constants that only float-bit arithmetic needs
BIT_CONSTANTS = {0x7F800000, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7FFFFFFF, 0x7FC00000, 0x80000000}
#: calls that read a float's bits (the attribute or function name)
BITCASTS = {"bitcast_convert_type", "bitcast"}
#: names of the core kernels: a backend function of one of these names must call mpx.kernels
KERNEL_NAMES = {
    "quantize", "compute_scale", "product_bits", "scale_product_bits", "next_scale", "next_state",
    "update_tensor", "record", "window", "window_max", "amax", "abs_max", "from_mantissa",
    "product", "order_key", "to_bits", "from_bits", "bits",
}  # fmt: skip


def _modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_view_as_int(node: ast.Call) -> bool:
    """``x.view(torch.int32)`` / ``ops.view(x, "int32")`` / ``x.view(np.int32)``: a bit cast."""
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == "view"):
        return False
    for arg in node.args:
        text = ast.unparse(arg)
        if "int32" in text or "uint32" in text or "float32" in text:
            return True
    return False


def _bit_arithmetic(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) in BIT_CONSTANTS:
            found.append(f"line {node.lineno}: constant {hex(node.value)}")
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in BITCASTS or _is_view_as_int(node):
                found.append(f"line {node.lineno}: bit cast {ast.unparse(node.func)}(...)")
    return found


@pytest.mark.parametrize("package", BACKENDS)
def test_no_backend_writes_float_bit_arithmetic(package):
    problems = []
    for name, path in _modules(package).items():
        if path.name == "_array_ops.py":
            continue  # the one table a backend supplies
        problems += [f"{name} {hit}" for hit in _bit_arithmetic(ast.parse(path.read_text()))]
    assert not problems, (
        "float-bit arithmetic outside the backend's _array_ops.py table (write it once in mpx/kernels):\n"
        + "\n".join(problems)
    )


def _calls_kernels(fn: ast.AST, kernel_aliases: set[str]) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in kernel_aliases:
                return True
            if "kernels" in ast.unparse(node):
                return True
        if isinstance(node, ast.Name) and node.id in kernel_aliases:
            return True
    return False


def _kernel_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to mpx.kernels or anything in it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpx.kernels"):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "mpx":
            names.update(a.asname or a.name for a in node.names if a.name == "kernels")
        elif isinstance(node, ast.Import):
            names.update(a.asname or a.name for a in node.names if a.name.startswith("mpx.kernels"))
    return names


@pytest.mark.parametrize("package", BACKENDS)
def test_backend_functions_named_like_kernels_delegate_to_them(package):
    problems = []
    for name, path in _modules(package).items():
        if path.name == "_array_ops.py":
            continue
        tree = ast.parse(path.read_text())
        aliases = _kernel_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bare = node.name.lstrip("_")
                if bare in KERNEL_NAMES and not _calls_kernels(node, aliases):
                    problems.append(f"{name}.{node.name} (line {node.lineno})")
    assert not problems, "functions named like a core kernel that do not call mpx.kernels:\n" + "\n".join(
        problems
    )


def _root_of(package: str) -> Path:
    return ROOT if (ROOT / package).is_dir() else TOOL_ROOT


def _graph(packages: tuple[str, ...], root: Path | None = None) -> dict[str, set[str]]:
    mods = {}
    for package in packages:
        mods.update(_modules(package, root or _root_of(package)))

    def resolve(module: str, node: ast.AST) -> list[str]:
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if mods[module].name == "__init__.py" else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        found = []
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target:
                found.append(target)
        return found

    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):  # every import, at any depth
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(d for d in resolve(module, node) if d != module)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_in_the_library():
    assert _cycles(_graph(LIBRARY)) == []


def test_no_import_circle_in_the_tools():
    assert _cycles(_graph(TOOLS)) == []


def test_the_cycle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert _cycles(_graph(("pkg",), tmp_path)) == [["pkg.a", "pkg.b"]]


def test_the_library_never_imports_a_tool():
    for name, deps in _graph((*LIBRARY, *TOOLS)).items():
        if name.split(".")[0] in LIBRARY:
            tools = sorted(d for d in deps if d.split(".")[0] in TOOLS)
            assert not tools, f"{name} imports {tools}"


def test_import_mpx_loads_numpy_and_ml_dtypes_only():
    code = (
        "import sys; before = set(sys.modules); import mpx, mpx.kernels; "
        "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout.split())  # fmt: skip
    third_party = {m for m in loaded if m not in sys.stdlib_module_names and not m.startswith("_")}
    assert third_party - {"mpx"} <= {"numpy", "ml_dtypes"}, sorted(third_party)
    assert not loaded & {"conformance", "mpx_bench", "mpx_compare", "mpx_tools"}


@pytest.mark.parametrize("package", LIBRARY + TOOLS)
def test_no_module_over_600_lines(package):
    root = ROOT if package in LIBRARY else TOOL_ROOT
    long = {
        name: n
        for name, path in _modules(package, root).items()
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines (split them by concept): {long}"
