"""The package graph reads as the architecture (crowdtrain/runspec/__init__.py): the volunteer's
side (``crowdtrain.swarm``) and the coordinator's (``crowdtrain.coordinator``) never import each
other, the shared run spec imports neither, no library module imports the tests, and no modules
import each other in a circle, directly or through others."""

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


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Module -> {module of the same package tree it imports: line of the first such import}, for
    every .py file under ``root``, counting imports at the top and inside functions.

    Relative imports resolve against the file's package; ``from package import name`` is an edge
    to ``package.name`` when that is a module, else to ``package``. The parent packages Python
    runs on the way in are not edges: a module depends on its package's ``__init__`` only when it
    imports a name from it. Modules loaded by a name in a string (the CLI's subcommands, the
    judges' registry) are not seen."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(path, root) for path in files}
    graph = {}
    for path in files:
        here = module_name(path, root)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        targets: list[tuple[str, int]] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [(alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: package.count(".") + 2 - node.level]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append((submodule if submodule in modules else base, node.lineno))
        edges: dict[str, int] = {}
        for name, line in targets:
            while name and name not in modules:  # outside the tree, or an attribute path
                name = name.rpartition(".")[0]
            if name and name != here:
                edges.setdefault(name, line)
        graph[here] = edges
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm), as
    ``"a -> b (line n)"`` edges inside it, so a failure names the modules and where to cut."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                members = set(component)
                components.append(sorted(
                    f"{a} -> {b} (line {line})"
                    for a in sorted(members) for b, line in graph[a].items() if b in members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def test_no_import_cycles_among_crowdtrain_modules():
    # A circle hides in a function-level import until someone moves it to the top and the package
    # fails to import; cut it by moving what both sides need into a module below both.
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n\n".join("\n".join(edges) for edges in cycles)


def test_the_cycle_check_sees_relative_and_function_level_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n")
    (package / "c.py").write_text("import os\nimport pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")  # imports the circle, is not in it
    assert import_cycles(import_graph(package)) == [[
        "pkg.a -> pkg.sub.b (line 1)", "pkg.c -> pkg.a (line 2)", "pkg.sub.b -> pkg.c (line 2)"]]
