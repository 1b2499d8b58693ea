"""The hivemind seam (crowdtrain/swarm/hivemind_seam): every internal of hivemind crowdtrain relies
on is registered with its canary, the upstream code is what each entry was written against, and
nothing outside the seam reaches into hivemind."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import hivemind
import pytest

import crowdtrain
from crowdtrain.swarm import hivemind_seam
from crowdtrain.swarm.hivemind_seam import HIVEMIND_VERSION, KINDS, SEAMS, changed_upstream, resolve

ROOT = Path(crowdtrain.__file__).parent
REPO = ROOT.parent
SEAM_DIR = Path(hivemind_seam.__file__).parent
HIVEMIND_DIR = Path(hivemind.__file__).parent
# hivemind's DHT key layouts: only the seam spells them.
LAYOUTS = (".all_averagers",)


def test_hivemind_is_pinned_to_the_version_the_seam_was_written_against():
    assert hivemind.__version__ == HIVEMIND_VERSION
    assert f'"hivemind=={HIVEMIND_VERSION}"' in (REPO / "pyproject.toml").read_text()


def test_the_upstream_code_of_every_seam_is_what_it_was_written_against():
    changed = changed_upstream()
    assert not changed, "hivemind changed code crowdtrain relies on; for each: re-read it, adapt ours, run the " \
        "canary, then record the new digest:\n" + "\n".join(
            f"  {s.upstream} ({s.kind} by {s.ours}): {s.why}\n    canary {s.canary}; digest {s.digest} -> {d}"
            for s, d in changed)


@pytest.mark.parametrize("seam", SEAMS, ids=lambda s: s.ours.partition(":")[2])
def test_every_seam_names_our_code_the_upstream_code_and_a_canary_that_exist(seam):
    assert seam.kind in KINDS
    resolve(seam.upstream)
    resolve(seam.ours)
    if seam.kind != "public-override":
        assert seam.ours.startswith("crowdtrain.swarm.hivemind_seam."), "overrides of internals live in the seam"
    path, _, name = seam.canary.partition("::")
    assert re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M), f"no canary {seam.canary}"


def seam_modules():
    return [importlib.import_module(f"crowdtrain.swarm.hivemind_seam.{m.name}")
            for m in pkgutil.iter_modules([str(SEAM_DIR)])]


def hivemind_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] == "hivemind"]


def test_every_override_of_a_hivemind_internal_in_the_seam_is_registered():
    registered = {s.ours for s in SEAMS}
    missing = []
    for module in seam_modules():
        # By the module's name for the class: some keep hivemind's class name (RPC names follow it).
        for class_name, cls in vars(module).items():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            bases = hivemind_bases(cls)
            for name in cls.__dict__:
                private = name.startswith("_") and not name.startswith("__") and name != "_abc_impl"
                if private and any(hasattr(base, name) for base in bases):
                    if f"{module.__name__}:{class_name}.{name}" not in registered:
                        missing.append(f"{module.__name__}:{class_name}.{name}")
    assert not missing, f"overrides of hivemind internals without a SEAMS entry: {missing}"


def test_every_upstream_fix_is_listed_in_the_doc():
    doc = (REPO / "docs" / "hivemind-fixes.md").read_text()
    fixes = [s for s in SEAMS if s.upstream_fix]
    assert fixes
    for seam in fixes:
        assert seam.upstream.partition(":")[2] in doc, f"{seam.upstream} missing from docs/hivemind-fixes.md"


# -- nothing outside the seam reaches into hivemind


def private_names_defined(paths) -> set[str]:
    """``_name``s a body of code defines: functions, classes, attributes of self/cls, module globals."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") \
                    and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reaches(source: str, hivemind_private: set[str], own: set[str]) -> list[str]:
    """Where ``source`` touches a hivemind internal: imports a ``_`` name from hivemind, reads an
    attribute (or names one in a string, as for getattr) that hivemind defines and crowdtrain does
    not, or spells one of hivemind's DHT key layouts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            found += [f"{line}: imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in hivemind_private and node.attr not in own:
            found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in hivemind_private and node.value not in own:
                found.append(f"{line}: {node.value!r}")
            found += [f"{line}: {layout!r}" for layout in LAYOUTS if layout in node.value]
    return found


@pytest.fixture(scope="module")
def hivemind_private():
    return private_names_defined(HIVEMIND_DIR.rglob("*.py"))


def outside_the_seam():
    return [p for p in sorted(ROOT.rglob("*.py")) if SEAM_DIR not in p.parents]


def test_no_module_outside_the_seam_touches_a_hivemind_internal(hivemind_private):
    own = private_names_defined(outside_the_seam())
    found = {str(p.relative_to(REPO)): hits for p in outside_the_seam()
             if (hits := reaches(p.read_text(), hivemind_private, own))}
    assert not found, f"move these into crowdtrain/swarm/hivemind_seam (with a SEAMS entry): {found}"


def test_no_class_outside_the_seam_overrides_a_hivemind_internal():
    offenders = []
    for name in ("crowdtrain.swarm.optimizer", "crowdtrain.swarm.diloco", "crowdtrain.swarm.auth",
                 "crowdtrain.swarm.compression", "crowdtrain.swarm.metrics", "crowdtrain.swarm.peer",
                 "crowdtrain.swarm.reconnect", "crowdtrain.auxpeer"):
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == name:
                bases = [b for b in hivemind_bases(cls) if not b.__module__.startswith("crowdtrain")]
                offenders += [f"{name}:{cls.__qualname__}.{attr}" for attr in cls.__dict__
                              if attr.startswith("_") and not attr.startswith("__") and attr != "_abc_impl"
                              and any(hasattr(b, attr) for b in bases)]
    assert not offenders, f"overrides of hivemind internals outside the seam: {offenders}"


def test_the_check_finds_a_reach_into_hivemind(hivemind_private):
    source = ("from hivemind.compression.serialization import _BASE_COMPRESSION_TYPES\n"
              "def f(averager, key):\n"
              "    averager._matchmaking.group_key_manager\n"
              "    getattr(averager, '_running_groups')\n"
              "    return f'{key}.all_averagers'\n")
    assert len(reaches(source, hivemind_private, own=set())) == 4
    assert reaches("def f(x):\n    return x._matchmaking\n", hivemind_private, own={"_matchmaking"}) == []


# -- canaries that no other test covers


def test_a_state_keeper_labelled_with_an_epoch_moves_its_scheduler_there():
    import torch
    from hivemind.optim.state_averager import TrainingStateAverager

    from crowdtrain.swarm.hivemind_seam.state import set_state_epoch

    dht = hivemind.DHT(start=True)
    try:
        param = torch.nn.Parameter(torch.zeros(3))
        averager = TrainingStateAverager(
            dht=dht, prefix="seam_canary", params=[param], optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
            scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
            start=False)
        set_state_epoch(averager, 4)
        assert averager.local_epoch == 4
        assert averager.optimizer.param_groups[0]["lr"] == pytest.approx(1.0 / 5)
    finally:
        dht.shutdown()


def test_another_hivemind_version_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    with pytest.raises(RuntimeError, match=rf"found 1.2.0: pip install hivemind=={re.escape(HIVEMIND_VERSION)}"):
        hivemind_seam.check_hivemind_version()
