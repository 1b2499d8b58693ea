"""Fixtures shared by the tests: real-process swarms, and the database URLs (SQLite and a real
PostgreSQL) the coordinator's storage is tested against."""

import ast
import json
import os
import threading
import time
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


def _marks_swarm(expr: ast.expr) -> bool:
    """``pytest.mark.swarm`` (called or not), alone or in a list of marks."""
    if isinstance(expr, (ast.List, ast.Tuple)):
        return any(_marks_swarm(e) for e in expr.elts)
    if isinstance(expr, ast.Call):
        expr = expr.func
    return isinstance(expr, ast.Attribute) and expr.attr == "swarm" and ast.unparse(expr.value) == "pytest.mark"


def tests_marked_swarm(folder: Path = Path(__file__).parent) -> set[str]:
    """Node ids (without parameters) of the tests marked ``swarm``, and modules marked whole. Read
    from the source: with workers, the controller that hands out tests never imports them."""
    marked = set()
    for path in sorted(folder.glob("test_*.py")):
        module = f"{path.parent.name}/{path.name}"
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                if _marks_swarm(node.value):
                    marked.add(module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(_marks_swarm,
                                                                                      node.decorator_list)):
                marked.add(f"{module}::{node.name}")
    return marked


# With workers, every test marked ``swarm`` is one unit of work: they run one after another on
# one worker while the other workers take everything else. Two such swarms at once starve each
# other's peers of CPU on a 2-core machine, and their timing-bound checks (booked rounds, a storm
# newcomer's first rounds, DiLoCo's samples per round) then fail without any feature broken.
SWARM_LANE = "swarm lane"


def work_unit(nodeid: str, shared: set[str], swarm: frozenset[str] | set[str] = frozenset()) -> str:
    module = nodeid.split("::")[0]
    if module in swarm or nodeid.split("[")[0] in swarm:
        return SWARM_LANE
    return module if module in shared else nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (``--dist load``, the default with workers): units of work are single tests, a
    whole module sharing a fixture, or the swarm lane, handed out in the workers' order (the
    swarm lane first, then longest first; below). A worker gets its next unit only as it starts
    the last test of its current one, so the worker on the swarm lane takes no other unit
    until the lane is done."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shared, swarm = modules_sharing_fixtures(), tests_marked_swarm()

    class LongestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, shared, swarm)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # One pending test: a worker holds its last test until it knows the next (or
            # that there is none), for the fixtures' teardown.
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False  # keep the workers' order
    return LongestFirst(config, log)


# What a worker off the swarm lane runs yields the CPU to the lane: nice 5 for the worker and
# every process its tests start (CFS gives it about a third of the share of a lane's process or
# session at 0). The lane's swarms then run about as fast as alone, and the rest of the
# suite fills the time their peers wait on rounds. Those other tests' timing margins are wide
# (seconds against minutes); the lane's are not.
#
# A process started in its own session (a swarm's coordinator and volunteers, a Jupyter kernel,
# the browser) is in its own autogroup where the kernel has them (CONFIG_SCHED_AUTOGROUP), which
# shares the CPU with the lane's at equal weight whatever its nice value: measured here, a nice 10
# process in its own session took half a core from a nice 0 one, not a tenth. crowdtrain's own
# launches carry their niceness into their session (``crowdtrain.lifecycle.own_session_child``);
# for the others (kernels, the browser, a test's own Popen) the worker looks over its processes
# every NICE_SESSIONS_EVERY_S and does the same. Not 10: a swarm's session beside the lane's five
# or six then gets about 2% of the CPU while they are busy (6% at 5), and a volunteer's first DHT
# ping to its coordinator went unanswered within hivemind's 3 s.
YIELD_TO_THE_LANE = 5
NICE_SESSIONS_EVERY_S = 1.0
_sessions_watched = threading.Event()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (a process that ends while being read is left out)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _nice_sessions_of_descendants():
    from crowdtrain.lifecycle import niceness_to_session

    own = os.getsid(0)  # the suite's session, the lane's worker's too: left as it is
    while True:
        for pid in descendants(os.getpid()):
            try:
                if os.getsid(pid) != own:
                    niceness_to_session(pid)
            except OSError:
                pass  # it ended
        time.sleep(NICE_SESSIONS_EVERY_S)


def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and item.get_closest_marker("swarm") is None:
        if os.getpriority(os.PRIO_PROCESS, 0) < YIELD_TO_THE_LANE:
            os.setpriority(os.PRIO_PROCESS, 0, YIELD_TO_THE_LANE)
        if not _sessions_watched.is_set():
            _sessions_watched.set()
            threading.Thread(target=_nice_sessions_of_descendants, name="nice-sessions", daemon=True).start()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_cuda_without_a_gpu(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order_longest_first(items)


def order_longest_first(items):
    """The swarm lane first (the longest unit: the other workers fill the time around it), then
    each unit of work (``work_unit``) by its known duration (``durations.json``), longest first."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    shared, swarm = modules_sharing_fixtures(), tests_marked_swarm()
    weight: dict[str, float] = {}
    for item in items:
        unit = work_unit(item.nodeid, shared, swarm)
        weight[unit] = weight.get(unit, 0.0) + known.get(item.nodeid, 1.0)
    order = {item.nodeid: i for i, item in enumerate(items)}

    def key(item):
        unit = work_unit(item.nodeid, shared, swarm)
        return unit != SWARM_LANE, -weight[unit], order[item.nodeid]

    items.sort(key=key)


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
