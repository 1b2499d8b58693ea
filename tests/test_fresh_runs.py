"""A new organizer's first minutes: a coordinator and two `crowdtrain join` typed at a shell, with
the guide's flags and the defaults a person gets (every interface, threads per machine), in fresh
run folders. Every averaging round of both volunteers must hold both, from the first.

The harness the other swarm tests use pins every address to 127.0.0.1 and every volunteer to one
thread; a fresh run typed at the shell differed there and never averaged in most runs (the
coordinator's DHT listened on every interface, and a volunteer that reached it through this
machine's 192.0.2.2 could not look up its groupmates: ``crowdtrain.swarm.reconnect.
choose_bootstrap_peers``). The matrix of such runs: benchmarks/fresh_runs.py, docs/scale.md.
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from crowdtrain.swarm.hivemind_seam.p2p import probe
from crowdtrain.swarm.reconnect import choose_bootstrap_peers, libp2p_routes_through

_spec = importlib.util.spec_from_file_location("fresh_runs",
                                               Path(__file__).parent.parent / "benchmarks" / "fresh_runs.py")
fresh_runs = sys.modules.setdefault("fresh_runs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fresh_runs)


# The report's two configurations, each volunteer until the swarm's epoch 2 (`--max-epochs 2`,
# at most 3 minutes): two rounds each, the first being the one that failed. By rounds, not by
# `--minutes`: the first epoch takes 25-35 s on this machine when it is quiet and twice that on a
# slow day, past a fixed minute. One run of each in the suite, one after the other
# (the swarm lane's time bounds the suite's); benchmarks/fresh_runs.py runs each ten times. Before
# the fix, most runs of these failed every round (9 of 10 in the report; here, of the two runs on
# the code before the fix, config 2's failed and config 1's passed: the coordinator's address a
# volunteer reaches first is a race). The cause itself is checked deterministically below.
@pytest.mark.swarm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", ["config_1", "config_2"])
def test_a_coordinator_and_two_joins_typed_at_the_shell_average_every_round_from_the_first(tmp_path, config):
    cell = dataclasses.replace(fresh_runs.CONFIG_1 if config == "config_1" else fresh_runs.CONFIG_2, minutes=3,
                               max_epochs=2)
    for k in range(1):
        result = fresh_runs.fresh_run(cell, tmp_path / f"run{k}")
        logs = {p.name: p.read_text(errors="replace")[-3000:] for p in (tmp_path / f"run{k}").glob("v*.log")}
        assert all(v["summary"] for v in result["volunteers"]), (result, logs)
        assert result["rounds"] >= cell.volunteers, (result, logs)  # a round each at least: the first
        assert result["whole"] == result["rounds"], (result["short"], result, logs)
        for v in result["volunteers"]:
            assert v["joined_epoch"] == 0, result
            assert v["no_group"] == 0 and v["states_thrown_away"] == 0, result


def test_the_join_uses_the_coordinators_addresses_that_libp2p_routes_through_at_the_url_host():
    everywhere = ["/ip4/127.0.0.1/tcp/31337/p2p/QmC", "/ip4/192.0.2.2/tcp/31337/p2p/QmC",
                  "/ip4/192.168.1.5/tcp/31337/p2p/QmC", "/ip4/198.18.0.7/tcp/31337/p2p/QmC"]
    assert choose_bootstrap_peers(everywhere, "127.0.0.1") == ["/ip4/127.0.0.1/tcp/31337/p2p/QmC"]
    assert choose_bootstrap_peers(everywhere, "localhost") == ["/ip4/127.0.0.1/tcp/31337/p2p/QmC"]
    # A volunteer on another machine of the LAN: the LAN address, never its own loopback.
    assert choose_bootstrap_peers(everywhere, "192.168.1.5") == ["/ip4/192.168.1.5/tcp/31337/p2p/QmC"]
    # A host name that does not resolve here: every routable one but loopback.
    assert choose_bootstrap_peers(everywhere, "run.invalid") == ["/ip4/192.168.1.5/tcp/31337/p2p/QmC"]
    # Nothing routable: all of them (and a warning saying so), rather than none.
    odd = ["/ip4/192.0.2.2/tcp/1/p2p/QmC", "/ip4/203.0.113.9/tcp/1/p2p/QmC"]
    assert choose_bootstrap_peers(odd, "192.0.2.2") == ["/ip4/192.0.2.2/tcp/1/p2p/QmC"]
    assert choose_bootstrap_peers(odd, "run.invalid") == odd
    assert [libp2p_routes_through(ip) for ip in ("127.0.0.1", "10.1.2.3", "100.64.0.1", "8.8.8.8", "::1",
                                                 "192.0.2.2", "198.51.100.1", "198.18.0.1", "not an ip")] == \
        [True, True, True, True, True, False, False, False, False]


def _dial_results(dhts, *, tries: int = 3) -> list[str]:
    """For each ordered pair of ``dhts`` (not the first, the run's first peer): whether its p2p
    daemon can open a stream to the other, found by peer ID as matchmaking does ("ok", or the error)."""
    import asyncio
    import time

    async def probe_all():
        p2ps = [await dht.replicate_p2p() for dht in dhts]
        out = []
        for (i, a), (j, b) in ((x, y) for x in enumerate(dhts[1:], 1) for y in enumerate(dhts[1:], 1) if x[0] != y[0]):
            for _ in range(tries):  # the first lookup may come before the routing tables are filled
                verdict = await probe(p2ps[i], b.peer_id) or "ok"
                if verdict == "ok":
                    break
                await asyncio.sleep(1.0)
            out.append(verdict)
        return out

    time.sleep(1.0)
    return asyncio.run(probe_all())


@pytest.mark.timeout(120)
def test_volunteers_bootstrapped_through_the_chosen_address_can_dial_each_other_and_through_an_unroutable_one_cannot():
    """The libp2p behaviour choose_bootstrap_peers relies on, with real hivemind peers listening on
    every interface as `join` does: joined through the machine's unroutable address (a canary: if
    a hivemind or p2pd upgrade starts routing through it, this part fails and the choice can be
    revisited), no volunteer can reach another; joined through the chosen address, each can."""
    import hivemind

    coordinator = hivemind.DHT(start=True, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    visible = [str(m) for m in coordinator.get_visible_maddrs()]
    odd = [m for m in visible if not libp2p_routes_through(m.split("/")[2])]
    started = [coordinator]
    try:
        if not odd:
            pytest.skip(f"this machine has no interface address libp2p does not route through ({visible})")
        for bootstrap, expect_ok in ((odd, False), (choose_bootstrap_peers(visible, "127.0.0.1"), True)):
            peers = [hivemind.DHT(start=True, initial_peers=bootstrap, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
                     for _ in range(2)]
            started += peers
            results = _dial_results([coordinator, *peers], tries=3 if expect_ok else 1)
            assert results == (["ok", "ok"] if expect_ok else ["routing: not found"] * 2), (bootstrap, results)
    finally:
        for dht in started:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_after_a_round_without_a_group_a_volunteer_names_the_peers_it_cannot_reach(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import hivemind
    from hivemind.p2p import PeerID

    from crowdtrain.swarm import rounds

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    me, other = (hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(),
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2))
    gone = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")  # nobody has this identity
    records = [{"peer_id": p, "epoch": 3} for p in (me.peer_id.to_bytes(), other.peer_id.to_bytes(), gone.to_bytes())]
    monkeypatch.setattr(rounds, "progress_records", lambda tracker: records)
    try:
        check = rounds.LonelyRoundCheck(me, SimpleNamespace(dht=me), every_s=60.0)
        assert check.after(3, group_size=2, swarm_peers=3) is None, "a round with a group needs no check"
        assert check.after(3, group_size=1, swarm_peers=1) is None, "nobody else was training"
        with caplog.at_level(logging.WARNING, logger="crowdtrain.swarm.rounds"):
            check.after(3, group_size=1, swarm_peers=3).join(60)
        verdict = check.verdicts[-1]
        assert verdict[other.peer_id.to_base58()] is None, verdict
        assert verdict[gone.to_base58()], verdict
        assert f"cannot reach 1 of the 2 other peers ({gone.to_base58()[-8:]}: " in caplog.text, caplog.text
        assert check.after(4, group_size=1, swarm_peers=3) is None, "at most once per every_s"
    finally:
        for dht in (me, other, first):
            dht.shutdown()
