"""Fixtures shared by the tests: real-process swarms, and the database URLs (SQLite and a real
PostgreSQL) the coordinator's storage is tested against."""

import os

import pytest

from crowdtrain.launch import LocalSwarm


def pytest_configure(config):
    """With workers (``make test TEST_WORKERS=2``, pytest-xdist): one torch thread each, so the
    workers and the swarms they start share the cores instead of oversubscribing them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
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
