"""The package graph reads as the architecture (crowdtrain/runspec/__init__.py): the volunteer's
side (``crowdtrain.swarm``) and the coordinator's (``crowdtrain.coordinator``) never import each
other, the shared run spec imports neither, and no library module imports the tests."""

import ast
from pathlib import Path

import crowdtrain

ROOT = Path(crowdtrain.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m.startswith(forbidden))
        if bad:
            out[str(path.relative_to(ROOT.parent))] = bad
    return out


def test_the_volunteers_side_never_imports_the_coordinator():
    assert offenders("swarm", ("crowdtrain.coordinator", "crowdtrain.auxpeer")) == {}


def test_the_coordinator_never_imports_the_volunteers_side():
    assert offenders("coordinator", ("crowdtrain.swarm", "crowdtrain.auxpeer")) == {}


def test_the_run_spec_imports_neither_side():
    assert offenders("runspec", ("crowdtrain.coordinator", "crowdtrain.swarm")) == {}


def test_no_library_module_imports_the_tests():
    assert offenders(".", ("tests",)) == {}


def test_the_check_finds_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from crowdtrain.coordinator.db import Store\n")
    assert imported_modules(module) == {"crowdtrain.coordinator.db"}
