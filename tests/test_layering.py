"""The package's import graph: no unit (a top-level module or subpackage of ``verl_longstraw``) imports one that
imports it back, directly or through others, so the units stack in layers with no upward import; and the
framework-free core imports neither veRL nor the units built on top of it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "verl_longstraw"
# the units above the core: the veRL integration, the test and CPU tooling, the scale tools
ABOVE_CORE = {"integration", "testing", "tiny", "profile", "dryrun", "timemodel", "gpu_table", "models", "configs"}


def _unit(path: Path) -> str:
    first = path.relative_to(PACKAGE).parts[0]
    return first.removesuffix(".py")


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports (``__init__``: the package root, ``from verl_longstraw import X``)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit, depth = _unit(path), len(path.relative_to(PACKAGE).parts) - 1
        targets = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level <= depth:
                    continue  # within the unit
                names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl_longstraw"):
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else ["__init__"]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("verl_longstraw.")]
            else:
                continue
            targets |= {name for name in names if name != unit}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its units, the first repeated at the end), None where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> list[str] | None:
        state[unit] = 1
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[unit] = 2
        return None

    return next((found for unit in sorted(graph) if unit not in state and (found := visit(unit, [unit]))), None)


def test_the_units_import_no_cycle():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_imports_nothing_above_it():
    """The core (plan, state, adapters, mixers, ops, parallel, the estimate, the walk) reads neither veRL nor the
    integration and tools built on it."""
    graph = import_graph()
    for unit in sorted(set(graph) - ABOVE_CORE - {"__init__"}):
        assert not graph[unit] & ABOVE_CORE, (unit, sorted(graph[unit] & ABOVE_CORE))
        for path in [PACKAGE / f"{unit}.py"] if (PACKAGE / f"{unit}.py").exists() else (PACKAGE / unit).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                assert not any(m == "verl" or m.startswith("verl.") for m in modules), path
