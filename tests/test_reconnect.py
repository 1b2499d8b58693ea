"""A volunteer alone with the coordinator finds it again after the coordinator restarts.

Real hivemind DHT peers (each a process with its p2p daemon) on 127.0.0.1: the run's first peer
with a fixed identity and port, and a client-mode volunteer (nobody can dial it) that knows only
that peer.
"""

import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from crowdtrain.swarm.reconnect import BootstrapWatch, bootstrap_peers
from crowdtrain.launch import free_port


def _first_peer(identity, port) -> hivemind.DHT:
    return hivemind.DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=str(identity))


def _can_read(dht: hivemind.DHT, key: str) -> bool:
    return dht.get(key, latest=True) is not None


def _check_until_found(watch: BootstrapWatch, timeout_s: float = 60.0) -> list[str]:
    """What the watch's loop does every ``every_s``: the first dials after an outage may meet the
    p2p daemon's back-off from the failed ones during it (seconds)."""
    deadline = time.monotonic() + timeout_s
    while not (found := watch.check()) and time.monotonic() < deadline:
        time.sleep(1.0)
    return found


def test_bootstrap_peers_groups_addresses_by_peer():
    a, b = "/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/5.6.7.8/tcp/2/p2p/QmA"
    assert bootstrap_peers([a, b, "/ip4/9.9.9.9/tcp/3/p2p/QmB", "/ip4/1.1.1.1/tcp/4"]) == \
        {"QmA": [a, b], "QmB": ["/ip4/9.9.9.9/tcp/3/p2p/QmB"]}


@pytest.mark.timeout(180)
def test_a_client_mode_volunteer_finds_the_restarted_first_peer_again(tmp_path):
    identity, port = tmp_path / "identity.key", free_port()
    first = _first_peer(identity, port)
    maddrs, first_id = [str(m) for m in first.get_visible_maddrs()], str(first.peer_id)
    volunteer = hivemind.DHT(start=True, client_mode=True, initial_peers=maddrs)
    restarted = None
    try:
        assert volunteer.store("before", 1, get_dht_time() + 600)
        first.shutdown()
        # The volunteer asks the gone peer, which fails: hivemind drops it from the routing table.
        volunteer.get("probe", latest=True)
        restarted = _first_peer(identity, port)
        restarted.store("after", 1, get_dht_time() + 600)
        time.sleep(2)
        assert not _can_read(volunteer, "after"), "hivemind alone should not find the restarted peer here"

        watch = BootstrapWatch(volunteer, maddrs)
        assert _check_until_found(watch) == [first_id]
        assert watch.reconnects == 1
        assert _can_read(volunteer, "after")
        assert watch.check() == [], "a peer in the routing table is not pinged again"
    finally:
        volunteer.shutdown()
        if restarted is not None:
            restarted.shutdown()


@pytest.mark.timeout(120)
def test_a_peer_whose_daemon_never_had_the_address_dials_it(tmp_path):
    """After a long outage the p2p daemon has forgotten the first peer's address; the watch dials
    the address it was given. A volunteer started with no initial peers is that case from the start."""
    first = _first_peer(tmp_path / "identity.key", free_port())
    volunteer = hivemind.DHT(start=True, client_mode=True)
    try:
        first.store("key", 1, get_dht_time() + 600)
        assert not _can_read(volunteer, "key")
        watch = BootstrapWatch(volunteer, [str(m) for m in first.get_visible_maddrs()])
        assert _check_until_found(watch) == [str(first.peer_id)]
        assert _can_read(volunteer, "key")
    finally:
        volunteer.shutdown()
        first.shutdown()
