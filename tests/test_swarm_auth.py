"""Authentication with real processes: only invited users train; strangers are refused on the DHT
and at the averagers; a revoked user's peers drop out; the database survives a restart."""

import asyncio
import json
import re
import subprocess
import sys
import time

import hivemind
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.proto import averaging_pb2

from crowdtrain.launch import LocalSwarm, get_json

LIFETIME_S = 20


def add_user(run_dir, name, db: str | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "users", "add", name, "--run-dir", str(run_dir),
                          *(["--db", db] if db else [])], check=True, capture_output=True, text=True, timeout=60).stdout
    return re.search(r"(ct_\S+)", out).group(1)


async def call_as_stranger(maddrs: list[str], peer_id: str, averager_cls, namespace: str, method: str, request):
    """A libp2p peer with no token calls an averager RPC directly, bypassing the DHT."""
    p2p = await P2P.create(initial_peers=maddrs)
    try:
        stub = averager_cls.get_stub(p2p, PeerID.from_base58(peer_id), namespace=namespace)
        stream = await getattr(stub, method)(request)
        return [msg async for msg in stream]
    finally:
        await p2p.shutdown()


@pytest.mark.timeout(600)
def test_allowlist_run_on_postgres_admits_keys_refuses_strangers_revokes_and_keeps_every_row(tmp_path, postgres):
    """The whole run on a real PostgreSQL (`--db`, as docs/dashboard.md promises): its users and
    keys, metrics, contributions and checkpoints go there, and a coordinator restart loses none."""
    import psycopg

    db = postgres.new_database()
    # total_epochs: the volunteers train until the test stops them, never to the run's last epoch.
    # Steps padded to 0.2 s and epochs of 192 samples (about 2 s): the subject is who gets in and
    # what is kept, not training, and at full speed alice and bob trained through the whole run
    # (most of it waiting out bob's token) on the cores the rest of the suite needs (alone: 33-34 s
    # of CPU instead of 46).
    swarm = LocalSwarm(tmp_path, swarm={"checkpoint_every_epochs": 2, "total_epochs": 100_000,
                                        "target_batch_size": 192})
    pace = ["--simulated-step-s", "0.2"]
    coordinator = ["--auth", "allowlist", "--token-lifetime-s", str(LIFETIME_S), "--db", db]
    try:
        keys = {name: add_user(swarm.run_dir, name, db) for name in ("alice", "bob")}
        info = swarm.start_coordinator(extra=coordinator)
        assert info["auth"]["mode"] == "allowlist"
        assert info["initial_peers"] == [], "an allowlist run gives its addresses only to holders of a key"
        info = json.loads((swarm.run_dir / "run.json").read_text())  # a stranger who learned them anyway
        swarm.join("alice", batch_size=16, max_epochs=1000, extra=["--key", keys["alice"], *pace])
        swarm.join("bob", batch_size=8, max_epochs=1000, extra=["--key", keys["bob"], *pace])
        # No key, or a made-up one: refused before any p2p start-up, with the fix in the message.
        nokey = swarm.join("mallory", batch_size=8, max_epochs=1)
        badkey = swarm.join("eve", batch_size=8, max_epochs=1, extra=["--key", "ct_made_up"])
        assert nokey.wait(120) != 0 and "admits invited users only" in swarm.log("mallory")
        assert badkey.wait(120) != 0 and "unknown or was revoked" in swarm.log("eve")

        # A DHT peer without a token gets no answers: it cannot even bootstrap.
        with pytest.raises(RuntimeError, match="bootstrap failed"):
            hivemind.DHT(initial_peers=info["initial_peers"], start=True)

        swarm.wait_epoch(2, 240)
        assert all("maddrs" not in p for p in swarm.status()["peers"]), "volunteers' addresses are not public"
        status = json.loads((swarm.run_dir / "status.json").read_text())
        alice = next(p for p in status["peers"] if p["user"] == "alice")
        # A stranger that knows the addresses talks libp2p to the averagers directly: refused.
        for maddrs, peer_id, cls, namespace, method, request in [
                (info["initial_peers"], info["coordinator_peer_id"], TrainingStateAverager, "test_state_averager",
                 "rpc_download_state", averaging_pb2.DownloadRequest()),
                (alice["maddrs"], alice["peer_id"], GradientAverager, "test_grad_averager", "rpc_join_group",
                 averaging_pb2.JoinRequest(group_key="test_grad_averager.0b", expiration=time.time() + 5))]:
            with pytest.raises(Exception, match="no valid access token"):
                asyncio.run(call_as_stranger(maddrs, peer_id, cls, namespace, method, request))
        deadline = time.monotonic() + 30  # the auxiliary peer stores its counters every few seconds
        while get_json(f"{swarm.url}/api/counters").get("averaging_requests_refused", 0) < 1:
            assert time.monotonic() < deadline, get_json(f"{swarm.url}/api/counters")
            time.sleep(1)

        # Revoke bob: his token cannot be refreshed and he is out within one lifetime.
        subprocess.run([sys.executable, "-m", "crowdtrain.cli", "users", "revoke", "bob", "--run-dir",
                        str(swarm.run_dir), "--db", db], check=True, timeout=60)
        revoked_at = time.monotonic()
        swarm.wait_exit("bob", LIFETIME_S + 90)
        assert time.monotonic() - revoked_at < LIFETIME_S + 60
        assert "refused" in swarm.summary("bob").get("stopped_because", ""), swarm.log("bob")[-2000:]
        epoch = swarm.status()["epoch"]
        swarm.wait_epoch(epoch + 2, 180)  # alice goes on alone

        # The auxiliary peer checkpoints from the volunteers' state (on a busy machine that can
        # come epochs after the first one due).
        deadline = time.monotonic() + 120
        while not (checkpoints := get_json(f"{swarm.url}/api/checkpoints")):
            assert time.monotonic() < deadline, (swarm.run_dir / "aux.log").read_text()[-3000:]
            time.sleep(1)
        board = get_json(f"{swarm.url}/api/leaderboard")
        history = get_json(f"{swarm.url}/api/history")
        assert {r["user"] for r in board} >= {"alice", "bob"} and board[0]["samples"] > 0
        # The rows are in PostgreSQL, and nothing went to the default SQLite file.
        assert not (swarm.run_dir / "coordinator.sqlite").exists()
        with psycopg.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM contributions").fetchone()[0] > 0
            assert conn.execute("SELECT count(*) FROM checkpoints WHERE NOT pruned").fetchone()[0] >= len(checkpoints)

        # A restart loses no row: the history, the leaderboard, the checkpoints, the revocation.
        swarm.kill("coordinator", 15)
        swarm.start_coordinator(extra=coordinator)
        after = get_json(f"{swarm.url}/api/history")
        kept = {(p["time"], p["epoch"]) for p in after}
        assert all((p["time"], p["epoch"]) in kept for p in history), "every point from before the restart"
        board_after = {r["user"]: r for r in get_json(f"{swarm.url}/api/leaderboard")}
        for row in board:  # alice may have trained on while the coordinator was down
            assert board_after[row["user"]]["samples"] >= row["samples"]
        assert board_after["bob"]["revoked"]
        assert (board_after["bob"]["samples"], board_after["bob"]["compute_s"]) == (
            next((r["samples"], r["compute_s"]) for r in board if r["user"] == "bob")), "bob trains no more"
        # Every checkpoint from before is still a row (newer ones, saved while alice trained on
        # through the restart, may have pruned its files: the row says so).
        with psycopg.connect(db) as conn:
            assert {c["name"] for c in checkpoints} <= {name for name, in conn.execute("SELECT name FROM checkpoints")}
    finally:
        swarm.close()


def test_an_identity_file_fixes_the_peer_id_in_an_open_run_too(tmp_path):
    # Open runs (no auth) used to ignore --identity: a fresh peer ID, and with it another data
    # order, every time (bench_robust relies on fixed ones).
    from crowdtrain.swarm.peer import VolunteerConfig, _Access

    config = VolunteerConfig("http://127.0.0.1:1", identity=str(tmp_path / "keys" / "me.key"))
    ids = []
    for _ in range(2):
        access = _Access(config, {}, "open-run")
        dht = hivemind.DHT(start=True, **access.dht_kwargs())
        ids.append(dht.peer_id)
        dht.shutdown()
        access.close()
    assert ids[0] == ids[1] and (tmp_path / "keys" / "me.key").is_file()
    assert _Access(VolunteerConfig("http://127.0.0.1:1"), {}, "open-run").dht_kwargs() == {}
