"""The coordinator's database and its token endpoint: users, contributions, limits, restarts."""

import functools
import threading
import time

import pytest
from fastapi.testclient import TestClient

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.runspec.tokens import CoordinatorKey, peer_id_of_key, token_request, verify_token
from crowdtrain.swarm.auth import load_identity


def metrics(peer_id, t, *, user="claimed", epoch=1, loss=3.0, samples=64):
    return {"peer_id": peer_id, "user": user, "time": t, "epoch": epoch, "loss": loss, "samples": samples,
            "samples_per_second": 10.0, "steps": 4, "client_mode": False, "last_round_peers": 2, "swarm_peers": 2}


def test_users_keys_and_revocation(db_url):
    store = Store(db_url)
    key = store.add_user("alice")
    assert store.user_for_key(key) == "alice" and store.user_for_key("ct_wrong") is None
    with pytest.raises(ValueError, match="revoke it first"):
        store.add_user("alice")
    with pytest.raises(ValueError, match="user names"):
        store.add_user("bad name!")
    store.revoke_user("alice")
    assert store.user_for_key(key) is None and store.is_revoked("alice")
    fresh = store.add_user("alice")
    assert store.user_for_key(fresh) == "alice" and store.user_for_key(key) is None, "old key stays dead"
    with pytest.raises(ValueError, match="no user 'bob'"):
        store.revoke_user("bob")
    assert "ct_" not in str(store.list_users()), "only hashes are stored"


def test_leaderboard_counts_swarm_samples_under_the_authenticated_user_and_survives_a_restart(db_url):
    url = db_url
    store = Store(url)
    store.peer_joined("peerA", "alice", "ssh-rsa AAA")
    now = time.time()
    assert store.record_metrics([metrics("peerA", now, user="bob-impersonator"), metrics("peerB", now - 600, user="bob")]) == 2
    assert store.record_metrics([metrics("peerA", now)]) == 0, "a record is stored once"
    for epoch, samples, steps in [(1, 100, 1), (2, 180, 2), (2, 220, 2)]:  # cumulative, as peers publish
        store.record_credit(peer_id="peerA", session="a1", samples=samples, steps=steps, epoch=epoch,
                            samples_per_second=10.0)
    store.record_credit(peer_id="peerB", session="b1", samples=50, steps=1, epoch=1, samples_per_second=5.0)
    store.record_swarm_point(epoch=2, loss=3.0, active_peers=2, samples_per_second=15.0)
    board = store.leaderboard()
    assert [(r["user"], r["samples"]) for r in board] == [("alice", 220), ("bob", 50)]
    assert board[0]["compute_s"] == pytest.approx(22.0)
    assert board[0]["active"] and not board[1]["active"], "bob last reported ten minutes ago"
    assert store.metrics()[-1]["user"] == "alice", "the name a record claims is not trusted"
    history, peers = store.swarm_history(), store.peers()
    store.close()

    reopened = Store(url)  # a coordinator restart
    assert reopened.leaderboard() == board and reopened.swarm_history() == history and reopened.peers() == peers


def test_the_ledger_credits_each_sample_once_across_repeats_restarts_and_new_sessions(db_url):
    """A peer publishes cumulative counts (crowdtrain.swarm.metrics.Ledger); the coordinator
    credits what grew since the last record of that session. The leaderboard's total is then the
    peers' own totals, whichever records it saw, twice or after a restart."""
    store = Store(db_url)
    store.peer_joined("peerA", "alice", "pk-a")
    store.peer_joined("peerB", "bob", "pk-b")
    credit = functools.partial(store.record_credit, samples_per_second=10.0, max_samples_per_step=512)
    assert credit(peer_id="peerA", session="a1", samples=200, steps=1, epoch=0)["samples"] == 200
    assert credit(peer_id="peerA", session="a1", samples=200, steps=1, epoch=0)["samples"] == 0, "seen twice"
    # Records missed in between lose nothing: the next one carries the whole count.
    assert credit(peer_id="peerA", session="a1", samples=900, steps=4, epoch=3)["samples"] == 700
    assert credit(peer_id="peerA", session="a1", samples=700, steps=3, epoch=2)["samples"] == 0, "out of order"
    store.close()
    store = Store(db_url)  # a coordinator restart re-reads the same records
    credit = functools.partial(store.record_credit, samples_per_second=10.0, max_samples_per_step=512)
    assert credit(peer_id="peerA", session="a1", samples=900, steps=4, epoch=3)["samples"] == 0
    # The peer restarted with the same identity: a new session counts from zero.
    assert credit(peer_id="peerA", session="a2", samples=100, steps=1, epoch=5)["samples"] == 100
    # Claims beyond what a step can hold (2 x the target batch) are cut to the bound.
    assert credit(peer_id="peerB", session="b1", samples=10_000, steps=2, epoch=2) == {"samples": 1024, "steps": 2,
                                                                                        "clamped": 8976}
    # A record from a peer no token was issued to credits nothing.
    assert credit(peer_id="stranger", session="s", samples=50, steps=1, epoch=1)["samples"] == 0
    board = {r["user"]: r for r in store.leaderboard()}
    assert board["alice"]["samples"] == 1000 and board["bob"]["samples"] == 1024
    assert board["alice"]["epochs"] == 5 and board["bob"]["epochs"] == 2
    assert "stranger" not in board
    store.close()


def test_the_ledger_columns_are_added_to_an_older_database(tmp_path):
    """A database from before the ledger (no steps, no ledger columns) opens, keeps its rows, and
    each old contribution row counts as one epoch."""
    import sqlite3

    path = tmp_path / "old.sqlite"
    Store(f"sqlite:///{path}").close()
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE contributions DROP COLUMN steps")
    for column in ("ledger_session", "ledger_samples", "ledger_steps"):
        con.execute(f"ALTER TABLE peers DROP COLUMN {column}")
    con.execute("INSERT INTO peers (peer_id, user, first_seen, last_seen, epoch, samples_per_second, client_mode, "
                "last_round_peers) VALUES ('peerA', 'alice', 0, 0, 3, 0, 0, 0)")
    for epoch in (1, 2):
        con.execute("INSERT INTO contributions (peer_id, user, epoch, samples, compute_s, time) "
                    f"VALUES ('peerA', 'alice', {epoch}, 100, 10, 0)")
    con.commit()
    con.close()
    store = Store(f"sqlite:///{path}")
    assert store.leaderboard()[0] | {"last_seen": None} == {
        "user": "alice", "samples": 200, "compute_s": 20.0, "epochs": 2, "peers": 1, "last_seen": None,
        "revoked": False, "active": False}
    assert store.record_credit(peer_id="peerA", session="a1", samples=64, steps=1, epoch=3,
                               samples_per_second=8.0)["samples"] == 64
    assert store.leaderboard()[0]["samples"] == 264
    store.close()


def test_concurrent_counter_bumps_from_threads_all_count(db_url):
    store = Store(db_url)
    threads = [threading.Thread(target=lambda: [store.bump("hits") for _ in range(20)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.counters()["hits"] == 80


@pytest.fixture
def identity(tmp_path):
    return load_identity(tmp_path / "peer.key").get_public_key().to_bytes().decode()


def signed(tmp_path, user="anonymous", name="peer", now=None) -> dict:
    """A token request as `crowdtrain join` sends it: signed by the peer's identity."""
    key = load_identity(tmp_path / f"{name}.key")
    return token_request(key.get_public_key().to_bytes(), user, key.sign, now=now)


def client_for(tmp_path, url=None, **auth):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    store = Store(url or default_url(run))
    settings = AuthSettings(key_path=run / "coordinator_key.pem", **auth)
    return TestClient(create_app(run, store=store, auth=settings)), store, CoordinatorKey.load_or_create(
        run / "coordinator_key.pem")


def test_open_runs_issue_tokens_bound_to_the_peer_key(tmp_path, identity):
    client, store, key = client_for(tmp_path, mode="open", token_lifetime_s=60)
    r = client.post("/api/token", json=signed(tmp_path, "carol"))
    assert r.status_code == 200, r.text
    token = r.json()
    assert token["username"] == "carol" and token["public_key"] == identity and verify_token(token, key.public_key)
    assert store.user_of_peer(peer_id_of_key(identity.encode())) == "carol"
    assert client.post("/api/token", json={"public_key": identity, "user": "coordinator"}).status_code == 422
    assert client.post("/api/token", json={"public_key": identity, "user": "<b>x</b>"}).status_code == 422


def test_allowlist_runs_want_a_live_key(tmp_path, identity, db_url):
    client, store, key = client_for(tmp_path, db_url, mode="allowlist")
    r = client.post("/api/token", json={"public_key": identity})
    assert r.status_code == 401 and "--key" in r.json()["detail"]
    api_key = store.add_user("dave")
    auth = {"Authorization": f"Bearer {api_key}"}
    r = client.post("/api/token", json=signed(tmp_path, "pretender"), headers=auth)
    assert r.status_code == 200 and r.json()["username"] == "dave", "the key decides the user"
    store.revoke_user("dave")
    r = client.post("/api/token", json={"public_key": identity}, headers=auth)
    assert r.status_code == 403 and "revoked" in r.json()["detail"]
    assert client.post("/api/token", json={"public_key": identity}, headers={"Authorization": "Basic x"}).status_code == 401
    assert store.counters()["token_requests_refused"] == 2


def test_malformed_oversized_and_flooding_requests_get_clear_4xx(tmp_path, identity):
    client, store, _ = client_for(tmp_path, requests_per_minute=2)
    assert client.post("/api/token", json={"public_key": "ssh-rsa garbage"}).status_code == 422
    assert client.post("/api/token", content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 422
    big = client.post("/api/token", content=b"x" * 100_000, headers={"Content-Type": "application/json"})
    assert big.status_code == 413 and "too large" in big.json()["detail"]
    assert client.post("/api/token", json=signed(tmp_path)).status_code == 200  # the 2nd this minute
    r = client.post("/api/token", json={"public_key": identity})
    assert r.status_code == 429 and "too many" in r.json()["detail"]
    assert store.counters()["token_requests_rate_limited"] == 1
    assert client.get("/api/history?limit=0").status_code == 422


def test_a_valid_key_has_its_own_token_budget_so_refused_clients_cannot_lock_it_out(tmp_path, identity):
    client, store, _ = client_for(tmp_path, mode="allowlist", requests_per_minute=3)
    alice = {"Authorization": f"Bearer {store.add_user('alice')}"}
    bob_key = store.add_user("bob")
    store.revoke_user("bob")
    for _ in range(3):  # a revoked peer retrying from the same address as alice (a lab's NAT)
        assert client.post("/api/token", json={"public_key": identity},
                           headers={"Authorization": f"Bearer {bob_key}"}).status_code == 403
    r = client.post("/api/token", json={"public_key": identity}, headers={"Authorization": "Bearer ct_guess"})
    assert r.status_code == 429 and "too many" in r.json()["detail"], "the address's budget is spent"
    for _ in range(3):
        assert client.post("/api/token", json=signed(tmp_path), headers=alice).status_code == 200
    r = client.post("/api/token", json=signed(tmp_path), headers=alice)
    assert r.status_code == 429 and "'alice'" in r.json()["detail"], "a key's own budget still holds"


def test_a_valid_api_key_cannot_move_another_volunteers_peer_either(tmp_path):
    """Allowlist runs: a key decides the user, but only the holder of a peer's identity may bind
    that peer to a user; the peer ID follows from the key, whatever the request says."""
    client, store, _ = client_for(tmp_path, mode="allowlist")
    alice = {"Authorization": f"Bearer {store.add_user('alice')}"}
    mallory = {"Authorization": f"Bearer {store.add_user('mallory')}"}
    victim = signed(tmp_path, name="alice-peer")
    assert client.post("/api/token", json=victim, headers=alice).status_code == 200
    assert store.user_of_peer(victim["peer_id"]) == "alice"
    own = signed(tmp_path, name="mallory-peer")
    attempts = [({"public_key": victim["public_key"], "peer_id": victim["peer_id"]}, 403, "unsigned"),
                ({**own, "public_key": victim["public_key"], "peer_id": victim["peer_id"]}, 403, "does not match"),
                ({**own, "peer_id": victim["peer_id"]}, 422, "is not the peer ID"),
                (signed(tmp_path, "mallory", name="alice-peer", now=time.time() - 3600), 403,
                 "from the coordinator's clock")]  # an old request of the victim's, replayed
    for body, code, message in attempts:
        r = client.post("/api/token", json=body, headers=mallory)
        assert r.status_code == code and message in r.json()["detail"], r.text
    assert store.user_of_peer(victim["peer_id"]) == "alice"
    assert store.counters()["token_requests_refused"] == len(attempts)
