"""Source layout rules of issue 17: no import cycle among the modules of src/lily, and no source file over
800 lines (in src/lily, csrc, metal and tests).

Every import counts as an edge: one inside a function (a lazy import only hides a cycle, it does not remove it)
and one under `if TYPE_CHECKING:` (it never runs, but it says the module knows the one above it: data that should
flow down as values flows up as an object, issue 37).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "lily"
MAX_LINES = 800
# compiled modules: they import no lily module, so they close no cycle
EXTENSION_MODULES = {"lily._lily"}
SOURCE_SUFFIXES = {".py", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".m", ".mm", ".metal"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST):
    """Import nodes anywhere in the tree: functions and `if TYPE_CHECKING:` bodies included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    """module -> the lily modules it imports (a `from pkg import name` names the submodule pkg.name when
    one exists, else pkg itself)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in files.keys() | EXTENSION_MODULES else pkg
                           for a in node.names]
            for t in targets:
                if t in EXTENSION_MODULES:
                    continue
                while t and t not in files:  # `import lily.x.y` of a non-module name: its module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the DFS path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_import_graph_sees_lily_modules():
    graph = import_graph()
    assert "lily.session" in graph["lily.model"]
    assert "lily.snapshot" in graph["lily.session"]


def test_import_graph_counts_type_checking_imports(tmp_path, monkeypatch):
    """An import under `if TYPE_CHECKING:` is an edge: here it closes the circle a -> b -> a."""
    pkg = tmp_path / "lily"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = import_graph()
    assert graph["lily.b"] == {"lily.a"}
    assert find_cycle(graph) == ["lily.a", "lily.b", "lily.a"]


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_lily():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among the modules of src/lily: " + " -> ".join(cycle)


def test_no_source_file_over_800_lines():
    too_long = []
    for folder in ("src/lily", "csrc", "metal", "tests"):
        for p in sorted((ROOT / folder).rglob("*")):
            if p.is_file() and p.suffix in SOURCE_SUFFIXES:
                n = len(p.read_bytes().splitlines())
                if n > MAX_LINES:
                    too_long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not too_long, f"files over {MAX_LINES} lines: " + ", ".join(too_long)
