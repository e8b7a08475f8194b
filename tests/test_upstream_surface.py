"""tests/upstream_surface.py, the list of transformers and peft names the package touches, stays honest: every test it
names exists, and every name the package imports from transformers or peft, or reads off their top-level modules, is
in a row (a new one fails here until it is listed with the tests that pin it)."""

from __future__ import annotations

import ast
from pathlib import Path

import upstream_surface as surface

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ("transformers", "peft")


def _functions(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


def test_every_test_named_exists():
    for node_id in surface.node_ids():
        path, _, name = node_id.partition("::")
        assert (ROOT / path).is_file(), node_id
        assert not name or name.partition("[")[0] in _functions(ROOT / path), node_id


def _upstream_names(tree: ast.AST) -> set[str]:
    """Names imported from transformers/peft, and attributes read off the modules ``import transformers`` binds."""
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] in UPSTREAM:
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name for alias in node.names if alias.name in UPSTREAM}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(node.attr)
    return names


def test_every_upstream_name_the_package_reads_is_a_row():
    listed = " ".join(name for name, *_ in surface.ROWS)
    for path in sorted((ROOT / "verl_longstraw").rglob("*.py")):
        for name in _upstream_names(ast.parse(path.read_text())):
            assert name in listed, (
                f"{path.relative_to(ROOT)} uses {name} from transformers/peft: add a row to tests/upstream_surface.py "
                "with the tests that pin it")


def test_the_scan_sees_imports_and_module_attributes():
    source = "import transformers\nfrom peft import LoraConfig\nx = transformers.AutoConfig\n"
    assert _upstream_names(ast.parse(source)) == {"LoraConfig", "AutoConfig"}
