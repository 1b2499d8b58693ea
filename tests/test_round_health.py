"""Failed rounds reach the status page: peers count their rounds in signed records, the
auxiliary peer sums what grew in the last minutes, and /api/status names the problem and its fix."""

from __future__ import annotations

import json
import time

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.status import rounds_failing, rounds_short, run_status
from crowdtrain.swarm.metrics import (Ledger, PeerMetrics, RoundCounts, RoundHealth, StoredRecord,
                                     round_counts_of)


def record(peer: str, t: float, rounds: int, apart: int, *, session: str = "s1", user: str = "alice") -> PeerMetrics:
    return PeerMetrics(peer_id=peer, epoch=rounds, samples=100, samples_per_second=5.0, loss=3.0, steps=10, time=t,
                       client_mode=False, last_round_peers=2, swarm_peers=2, fingerprint="f", user=user,
                       session=session)


def counts(t: float, rounds: int, apart: int, *, session: str = "s1") -> RoundCounts:
    return RoundCounts(session=session, time=t, rounds=rounds, rounds_apart=apart)


def test_a_peer_counts_the_rounds_it_averaged_with_nobody_while_others_trained():
    ledger = Ledger()
    ledger.credit(epoch=0, samples=64, group_size=1, swarm_peers=1)  # alone in the swarm: not a failure
    ledger.credit(epoch=1, samples=64, group_size=2, swarm_peers=2)
    ledger.credit(epoch=2, samples=64, group_size=1, swarm_peers=2)  # "could not find a group"
    c = ledger.round_counts(5.0)
    assert (c.rounds, c.rounds_apart, c.session, c.time) == (3, 1, ledger.session, 5.0)


def test_the_metrics_record_keeps_the_fields_every_version_of_crowdtrain_accepts():
    """hivemind's schema check refuses a record with a field more or less than the reader's
    PeerMetrics, defaults or not: a peer of another version would refuse all of this one's metrics
    (and the coordinator all of its). New per-peer facts go under a DHT key of their own, as
    RoundCounts and LeavingRecord do."""
    assert set(PeerMetrics.__fields__) == {
        "peer_id", "epoch", "samples", "samples_per_second", "loss", "steps", "time", "client_mode",
        "last_round_peers", "swarm_peers", "fingerprint", "user", "maddrs", "identity", "identity_proof",
        "session", "credited_samples", "credited_steps"}


def test_round_counts_count_only_under_the_key_that_signed_a_screened_record_of_the_same_session(monkeypatch):
    import crowdtrain.swarm.metrics as m

    monkeypatch.setattr(m, "signer_peer_id", lambda record, subkey, run_id: {b"ka": "a", b"kb": "b"}.get(subkey))
    a, b = record("a", 1.0, 0, 0), record("b", 1.0, 0, 0)
    stored = [StoredRecord(b"ka", a.dict(), 60.0), StoredRecord(b"kb", b.dict(), 60.0)]
    found = round_counts_of(stored, {b"ka": counts(1.0, 4, 3), b"kb": counts(1.0, 9, 9, session="old")},
                            [a, b], "run")
    assert found == {"a": counts(1.0, 4, 3)}, "b's counts are of another session"
    assert round_counts_of(stored, {b"ka": counts(1.0, 4, 3)}, [b], "run") == {}, "a's record did not pass screen"
    # Counts under a key whose record claims to be another peer's: not that peer's.
    forged = [StoredRecord(b"kb", a.dict(), 60.0)]
    assert round_counts_of(forged, {b"kb": counts(1.0, 4, 3)}, [a], "run") == {}


def test_round_health_counts_what_grew_in_the_window_per_session():
    health = RoundHealth(window_s=300)
    now = 10_000.0
    users = {"a": "alice", "b": "bob"}
    # Seen first long after it started (a restarted coordinator): its old rounds are not this window's.
    health.add({"a": counts(now - 100, 40, 30)}, users=users, now=now - 100)
    health.add({"a": counts(now - 50, 44, 34), "b": counts(now - 50, 3, 0)}, users=users, now=now - 50)
    health.add({"a": counts(now, 48, 38), "b": counts(now, 7, 0)}, users=users, now=now)
    no_groups = {"grouped": 0, "short": 0, "short_median": None, "short_largest_swarm": 0}
    assert health.summary() == {"window_s": 300, "rounds": 12, "apart": 8, "users": ["alice"], **no_groups}
    # A restarted peer is a new session: its counts start again from its first record.
    health.add({"a": counts(now + 10, 2, 2, session="s2")}, users=users, now=now + 10)
    health.add({"a": counts(now + 20, 3, 2, session="s2")}, users=users, now=now + 20)
    assert health.summary()["rounds"] == 13
    # Past the window, only what grew since its last earlier point counts.
    health.add({"a": counts(now + 400, 3, 2, session="s2"), "b": counts(now + 400, 9, 0)}, users=users, now=now + 400)
    assert health.summary() == {"window_s": 300, "rounds": 2, "apart": 0, "users": [], **no_groups}


def test_the_status_page_names_failing_rounds_and_the_fix_only_while_peers_train(tmp_path):
    assert rounds_failing({"rounds": 10, "apart": 1, "window_s": 300, "users": ["a"]}) is None
    assert rounds_failing({"rounds": 3, "apart": 3}) is None  # too few to tell
    assert rounds_failing({"rounds": "x"}) is None and rounds_failing({}) is None
    failing = {"rounds": 8, "apart": 6, "window_s": 300, "users": ["alice", "bob"]}
    line = rounds_failing(failing)
    assert "6 of the 8 rounds" in line and "alice, bob" in line
    # Only causes that were checked: nothing about threads, ports or timeouts, which nobody
    # measured; it points to where each volunteer says whom it could not reach.
    assert "--threads" not in line and "matchmaking_time_s" not in line and "DHT port" not in line
    assert "cannot reach" in line and "--client-mode" not in line
    # Every live peer in client mode (no address announced) is a cause the coordinator sees.
    clients = [{"peer_id": "QmA", "maddrs": []}, {"peer_id": "QmB", "maddrs": []}]
    assert "All 2 training peers joined with --client-mode" in rounds_failing(failing, clients)
    mixed = [{"peer_id": "QmA", "maddrs": []}, {"peer_id": "QmB", "maddrs": ["/ip4/10.0.0.2/tcp/1/p2p/QmB"]}]
    assert "--client-mode" not in rounds_failing(failing, mixed)

    run = tmp_path / "run"
    run.mkdir()
    store = Store(default_url(run))
    peer = record("QmVolunteer", time.time(), 8, 6).dict()
    status = {"epoch": 8, "peers": [peer], "updated": time.time(),
              "rounds": {"rounds": 8, "apart": 6, "window_s": 300, "users": ["alice"]}}
    (run / "status.json").write_text(json.dumps(status))
    assert any(p.startswith("averaging rounds are failing") for p in run_status(run, store)["problems"])
    # ... and the dashboard shows it to the organizer.
    from fastapi.testclient import TestClient

    from crowdtrain.coordinator.service import create_app

    page = TestClient(create_app(run, store=store)).get("/dashboard")
    assert page.status_code == 200 and "averaging rounds are failing" in page.text
    (run / "status.json").write_text(json.dumps({**status, "peers": []}))  # nobody trains: nothing fails
    assert run_status(run, store)["problems"] == []


def _grouped(peer: str, epoch: int, group: int, swarm: int) -> PeerMetrics:
    r = record(peer, float(epoch), epoch, 0)
    return r.copy(update={"last_round_peers": group, "swarm_peers": swarm})


def test_rounds_short_of_the_swarm_are_counted_once_per_peer_and_epoch_and_reach_the_status():
    health = RoundHealth(window_s=300.0)
    for epoch in range(4):  # 16 peers split 9 + 7 every epoch, each record seen twice
        batch = [_grouped(f"p{i}", epoch, 9 if i < 9 else 7, 16) for i in range(16)]
        health.add_groups(batch, now=100.0 + epoch)
        health.add_groups(batch, now=100.5 + epoch)
    s = health.summary()
    assert (s["grouped"], s["short"], s["short_largest_swarm"]) == (64, 64, 16)
    assert abs(s["short_median"] - 9 / 16) < 1e-9
    line = rounds_short(s)
    assert line and "64 of the 64" in line and "56%" in line and "matchmaking_time_s" in line
    # Rounds that hold the swarm, or averaged with nobody (add's), are not short.
    ok = RoundHealth()
    ok.add_groups([_grouped(f"p{i}", e, 5, 5) for i in range(5) for e in range(3)]
                  + [_grouped("q", 3, 1, 5)], now=10.0)
    assert ok.summary()["grouped"] == 15 and ok.summary()["short"] == 0 and rounds_short(ok.summary()) is None
    # A storm: a few short rounds among many full ones.
    storm = RoundHealth()
    storm.add_groups([_grouped(f"p{i}", e, 12 if e == 3 else 16, 16) for i in range(12) for e in range(8)], now=10.0)
    assert storm.summary()["short"] == 12 and rounds_short(storm.summary()) is None
    # Rounds leave the window.
    health.add_groups([], now=100.0 + 300.0 + 10)
    assert health.summary()["grouped"] == 0
    assert rounds_short({"grouped": "x"}) is None and rounds_short({}) is None


def test_the_status_names_rounds_short_of_the_swarm_while_peers_train(tmp_path):
    store = Store(default_url(tmp_path))
    now = time.time()
    peer = record("p", now, 3, 0).dict()
    (tmp_path / "status.json").write_text(json.dumps({
        "epoch": 3, "peers": [peer], "updated": now,
        "rounds": {"window_s": 300.0, "rounds": 40, "apart": 0, "users": [], "grouped": 40, "short": 30,
                   "short_median": 0.5, "short_largest_swarm": 16}}))
    problems = run_status(tmp_path, store)["problems"]
    assert any("averaging rounds are missing peers" in p for p in problems), problems
    from fastapi.testclient import TestClient

    from crowdtrain.coordinator.service import create_app

    page = TestClient(create_app(tmp_path, store=store)).get("/dashboard")
    assert page.status_code == 200 and "averaging rounds are missing peers" in page.text
