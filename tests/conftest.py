"""Fixtures shared by the tests: real-process swarms, and the database URLs (SQLite and a real
PostgreSQL) the coordinator's storage is tested against."""

import ast
import json
import os
from pathlib import Path

import pytest

from crowdtrain.launch import LocalSwarm


def pytest_configure(config):
    """With workers (``make test TEST_WORKERS=2``, pytest-xdist): one torch thread each, so the
    workers and the swarms they start share the cores instead of oversubscribing them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


# Seconds each multi-second test took on a 2-core machine (set-up included; ``pytest
# --store-durations`` rewrites it). Workers take the longest first, so the run does not end on one
# worker finishing a long swarm test alone; a test missing here counts as a second.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's duration (>= 2 s) to {DURATIONS.name}, for the workers' order")


def modules_sharing_fixtures() -> set[str]:
    """Test modules (as node ids name them) with a module-scoped fixture: a trained run, a fresh
    venv, a browser. Their tests run on one worker, so the fixture is built once."""
    shared = set()
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and any(k.arg == "scope" and getattr(k.value, "value", None) == "module"
                                                  for k in node.keywords):
                shared.add(f"{path.parent.name}/{path.name}")
    return shared


def work_unit(nodeid: str, shared: set[str]) -> str:
    module = nodeid.split("::")[0]
    return module if module in shared else nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (``--dist load``, the default with workers): units of work are single tests, or a
    whole module sharing a fixture, handed out in the workers' order (longest first, below)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shared = modules_sharing_fixtures()

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, shared)

    config.option.loadscopereorder = False  # keep the longest-first order
    return LongestFirst(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_cuda_without_a_gpu(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order_longest_first(items)


def order_longest_first(items):
    """Each unit of work (``work_unit``) by its known duration (``durations.json``), longest first."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    shared = modules_sharing_fixtures()
    weight: dict[str, float] = {}
    for item in items:
        unit = work_unit(item.nodeid, shared)
        weight[unit] = weight.get(unit, 0.0) + known.get(item.nodeid, 1.0)
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[work_unit(item.nodeid, shared)], order[item.nodeid]))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("store_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {k: round(v, 1) for k, v in sorted(_durations.items()) if v >= 2.0}
        DURATIONS.write_text(json.dumps(slow, indent=0) + "\n")


def skip_cuda_without_a_gpu(items):
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no CUDA device: a
    CPU-only machine reports them as SKIPPED, never as passed (benchmarks/gpu_check.sh runs them)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: torch {torch.__version__} sees none "
                                   f"(built with CUDA {torch.version.cuda or 'none'})")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def swarm_factory(tmp_path):
    """Make swarms (a coordinator plus volunteers) in this test's folder; all are cleaned up."""
    created = []

    def make(**kwargs):
        swarm = LocalSwarm(tmp_path, **kwargs)
        created.append(swarm)
        return swarm

    yield make
    for swarm in created:
        swarm.close()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL cluster for the whole test run (started once: a few seconds)."""
    from tests.postgres import Cluster

    cluster = Cluster()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """An empty database of each kind docs/dashboard.md promises: a SQLite file, a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.sqlite'}"
    return request.getfixturevalue("postgres").new_database()
