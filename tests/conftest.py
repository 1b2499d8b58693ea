"""Fixtures shared by the real-process swarm tests."""

import pytest

from tests.swarm_harness import Swarm


@pytest.fixture
def swarm_factory(tmp_path):
    """Make swarms (a coordinator plus volunteers) in this test's folder; all are cleaned up."""
    created = []

    def make(**kwargs):
        swarm = Swarm(tmp_path, **kwargs)
        created.append(swarm)
        return swarm

    yield make
    for swarm in created:
        swarm.close()
