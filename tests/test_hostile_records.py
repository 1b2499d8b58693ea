"""What one hostile or broken peer can store, against a real coordinator over the real DHT and HTTP.

One coordinator (web service, database, auxiliary peer) serves every test in this module; the
peers are DHT nodes in this process with their own identities and tokens, as `crowdtrain join`
makes them. The hostile one signs whatever it stores (so the swarm's signature checks pass) but
installs no schema, so nothing stops it locally: the coordinator's side must.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.runspec.tokens import peer_id_of_key, token_request
from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.swarm.auth import HttpTokenSource, SwarmAuthorizer, load_identity
from crowdtrain.launch import LocalSwarm, get_json

RUN_ID = "test"  # the harness's --run-id
COLLECT_EVERY_S = 0.5


class Peer:
    """A DHT node with its own identity and a token from the coordinator, as a volunteer has."""

    def __init__(self, swarm: LocalSwarm, info: dict, name: str, *, hostile: bool = False):
        self.name = name
        self.key_path = swarm.tmp / f"{name}.key"
        self.key = load_identity(self.key_path)
        self.public_key = self.key.get_public_key().to_bytes()
        self.peer_id = peer_id_of_key(self.public_key)
        source = HttpTokenSource(info["auth"]["token_url"], private_key=self.key, api_key=None, user=name)
        authorizer = SwarmAuthorizer(self.key, info["auth"]["coordinator_public_key"].encode(), source,
                                     refresh_margin_s=60)
        # Its own signing key (a volunteer's is per process; these peers share one process).
        self.signer = RSASignatureValidator(RSAPrivateKey())
        self.endorsement = swarm_metrics.endorsement(self.key, RUN_ID, self.signer)
        validators = [self.signer]
        if not hostile:
            validators.append(swarm_metrics.CountingSchemaValidator(swarm_metrics.RunSchema, prefix=RUN_ID))
        self.dht = hivemind.DHT(initial_peers=info["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                identity_path=str(self.key_path), authorizer=authorizer,
                                record_validators=validators, start=True)
        assert str(self.dht.peer_id) == self.peer_id

    def record(self, **changes) -> dict:
        """An honest peer's record, with ``changes``."""
        return {"peer_id": self.peer_id, "epoch": 3, "samples": 640, "samples_per_second": 20.0, "loss": 4.5,
                "steps": 40, "time": time.time(), "client_mode": False, "last_round_peers": 2, "swarm_peers": 2,
                "fingerprint": "f" * 16, "user": self.name, "maddrs": [], **self.endorsement,
                "session": f"{self.name}-1", "credited_samples": 640, "credited_steps": 2, **changes}

    def store(self, value: dict) -> None:
        self.dht.store(swarm_metrics.metrics_key(RUN_ID), subkey=self.signer.local_public_key, value=value,
                       expiration_time=get_dht_time() + 60)

    def shutdown(self) -> None:
        self.dht.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    swarm = LocalSwarm(tmp_path_factory.mktemp("hostile"))
    peers = []

    def peer(name: str, **kwargs) -> Peer:
        p = Peer(swarm, swarm.info, name, **kwargs)
        peers.append(p)
        return p

    try:
        # Every check here waits for the auxiliary peer's next read of the records: read often.
        swarm.info = swarm.start_coordinator(extra=["--collect-every-s", str(COLLECT_EVERY_S)])
        swarm.peer = peer
        yield swarm
    finally:
        for p in peers:
            p.shutdown()
        swarm.close()


def counter(swarm: LocalSwarm, name: str) -> int:
    return get_json(f"{swarm.url}/api/counters").get(name, 0)


def wait_for(what: str, check, *, swarm: LocalSwarm, timeout_s: float = 90.0):
    """``check()``'s first true value; after ``timeout_s``, fail with ``what`` and the auxiliary peer's log."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s\n{(swarm.run_dir / 'aux.log').read_text()[-3000:]}")
        time.sleep(0.5)


def aux_alive(swarm: LocalSwarm) -> bool:
    pid = int((swarm.run_dir / "aux.pid").read_text())
    try:
        return b"crowdtrain.auxpeer" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def status_moves_on(swarm: LocalSwarm) -> bool:
    """/api/status is refreshed by the auxiliary peer at every read: it must go on doing so."""
    before = swarm.status()["updated"]
    return wait_for("the auxiliary peer's status did not move on", lambda: swarm.status()["updated"] > before,
                    swarm=swarm)


@pytest.mark.timeout(300)
def test_a_nan_loss_neither_stops_the_auxiliary_peer_nor_reaches_the_database(run):
    mallory = run.peer("mallory", hostile=True)
    refused = counter(run, "metrics_records_refused")
    mallory.store(mallory.record(loss=float("nan")))  # the database's NOT NULL refused it, and the process died
    wait_for("the NaN record was not refused", lambda: counter(run, "metrics_records_refused") > refused, swarm=run)
    # Nor can any other value that a column or JSON cannot hold.
    mallory.store(mallory.record(samples_per_second=float("inf"), samples=2**64 - 1))
    wait_for("the inf record was not refused", lambda: counter(run, "metrics_records_refused") > refused + 1,
             swarm=run)
    assert status_moves_on(run) and aux_alive(run)
    assert f"reading the volunteers' records every {COLLECT_EVERY_S:g} s" in (run.run_dir / "aux.log").read_text()
    # The run's first DHT peer still lets newcomers in (it raises if bootstrapping fails) and collects.
    newcomer = run.peer("newcomer")
    newcomer.store(newcomer.record())
    wait_for("the newcomer's record did not arrive",
             lambda: [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == newcomer.peer_id], swarm=run)
    assert not [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == mallory.peer_id]


@pytest.mark.timeout(300)
def test_a_record_counts_only_for_its_signer_under_its_token_user_in_bounds(run):
    honest, eve = run.peer("honest"), run.peer("eve", hostile=True)
    honest.store(honest.record())
    wait_for("the honest record did not arrive",
             lambda: [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == honest.peer_id], swarm=run)
    # Each of eve's records, one after another (a subkey holds one): dropped for the named reason.
    for reason, record in [
            # The honest peer's record with its identity and proof, stored under eve's key.
            ("not_signer", honest.record(epoch=999, loss=123.0, samples_per_second=999_999.0)),
            ("user", eve.record(user="coordinator")),
            ("user", eve.record(user="<b>x</b>")),
            ("time", eve.record(time=time.time() + 3600)),
            ("epoch", eve.record(epoch=999))]:
        before = counter(run, f"metrics_records_dropped_{reason}")
        honest.store(honest.record())  # keeps the honest peer live, the reference for epochs
        eve.store(record)
        wait_for(f"a {reason} record was not dropped",
                 lambda: counter(run, f"metrics_records_dropped_{reason}") > before, swarm=run)
    refused = counter(run, "metrics_records_refused")
    eve.store(eve.record(time=1e12))  # beyond any time the schema admits
    wait_for("the record from year 33658 was not refused", lambda: counter(run, "metrics_records_refused") > refused,
             swarm=run)
    eve.store(eve.record())  # a record that is all in order is taken, under eve's own name
    rows = wait_for("eve's honest record did not arrive",
                    lambda: [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == eve.peer_id], swarm=run)
    assert [(r["user"], r["epoch"]) for r in rows] == [("eve", 3)]
    honest_rows = [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == honest.peer_id]
    assert {(r["user"], r["epoch"], r["loss"]) for r in honest_rows} == {("honest", 3, 4.5)}
    assert max(p["epoch"] for p in get_json(f"{run.url}/api/history")) < 999
    status = json.loads((run.run_dir / "status.json").read_text())
    assert set(status["metrics_records_dropped"]) >= {"not_signer", "user", "time", "epoch"}
    log = (run.run_dir / "aux.log").read_text()
    assert log.count("dropped a metrics record (user)") == 1, "one warning per kind, then counted"
    for page in ("/leaderboard", "/peers", "/peers?all=true", "/"):
        with urllib.request.urlopen(f"{run.url}{page}", timeout=10) as response:
            assert response.status == 200, page
    assert aux_alive(run)


def post_token(swarm: LocalSwarm, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(f"{swarm.url}/api/token", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.timeout(300)
def test_nobody_can_move_another_volunteers_peer_to_their_name(run):
    victim = run.peer("victim")
    mallory_key = load_identity(run.tmp / "mallory-token.key")
    mallory_public = mallory_key.get_public_key().to_bytes()
    victim_public = victim.public_key.decode()

    def owner() -> str:
        return next(p["user"] for p in get_json(f"{run.url}/api/peers") if p["peer_id"] == victim.peer_id)

    assert owner() == "victim"
    # The victim's key and peer ID are public (tokens are published in the DHT): without the
    # victim's private key, no request for them is honoured.
    unsigned = {"public_key": victim_public, "peer_id": victim.peer_id, "user": "mallory"}
    code, text = post_token(run, unsigned)
    assert code == 403 and "signed" in text, text
    forged = token_request(mallory_public, "mallory", mallory_key.sign)
    code, text = post_token(run, {**forged, "public_key": victim_public, "peer_id": victim.peer_id})
    assert code == 403 and "does not match" in text, text
    # Her own key, signed, naming the victim's peer: the peer ID follows from the key.
    code, text = post_token(run, {**forged, "peer_id": victim.peer_id})
    assert code == 422 and "is not the peer ID" in text, text
    assert owner() == "victim"
    code, text = post_token(run, forged)  # what she may do: get a token for her own key
    assert code == 200 and json.loads(text)["username"] == "mallory"
    assert next(p["user"] for p in get_json(f"{run.url}/api/peers") if p["peer_id"] == peer_id_of_key(mallory_public)) \
        == "mallory"
    assert owner() == "victim"


def test_screen_drops_each_kind_of_bad_record_for_its_reason(tmp_path):
    """The checks a schema cannot make, without processes: the same as the coordinator applies."""
    names = ("a", "b", "c")
    identity = {name: load_identity(tmp_path / f"{name}.key") for name in names}
    signer = {name: RSASignatureValidator(RSAPrivateKey()) for name in names}
    proof = {name: swarm_metrics.endorsement(identity[name], RUN_ID, signer[name]) for name in names}
    peer_id = {name: peer_id_of_key(key.get_public_key().to_bytes()) for name, key in identity.items()}
    users = {peer_id[name]: name for name in names}
    now = 1.7e9

    def stored(name: str, *, subkey: bytes | None = None, **changes) -> swarm_metrics.StoredRecord:
        value = {"peer_id": peer_id[name], "epoch": 7, "samples": 64, "samples_per_second": 10.0, "loss": 3.0,
                 "steps": 4, "time": now, "client_mode": False, "last_round_peers": 2, "swarm_peers": 3,
                 "fingerprint": "f" * 16, "user": name, "maddrs": [], **proof[name], **changes}
        return swarm_metrics.StoredRecord(subkey or signer[name].local_public_key, value, now + 60)

    def reasons(records, run_id=RUN_ID, **kwargs) -> tuple[list[str], list[str]]:
        kept, dropped = swarm_metrics.screen(records, run_id=run_id, now=now,
                                             user_of=lambda ids: {i: users[i] for i in ids}, **kwargs)
        return [r.peer_id for r in kept], [d.reason for d in dropped]

    assert reasons([stored("a"), stored("b", epoch=8)]) == ([peer_id["a"], peer_id["b"]], [])
    # Under one's own key: another peer's whole record (its identity and proof too); one's own
    # proof with another's peer ID; another's identity with one's own proof. Then a proof made for
    # another run, no identity at all, a subkey with no key in it.
    assert reasons([stored("b", subkey=signer["a"].local_public_key)]) == ([], ["not_signer"])
    assert reasons([stored("a", peer_id=peer_id["b"], user="b")]) == ([], ["not_signer"])
    b_identity = proof["b"]["identity"]
    assert reasons([stored("a", identity=b_identity, peer_id=peer_id["b"], user="b")]) == ([], ["not_signer"])
    assert reasons([stored("a")], run_id="another-run") == ([], ["not_signer"])
    assert reasons([stored("a", identity="", identity_proof="")]) == ([], ["not_signer"])
    assert reasons([stored("a", subkey=b"[owner:ssh-rsa garbage]")]) == ([], ["not_signer"])
    assert reasons([stored("a", user="b"), stored("b", user="coordinator")]) == ([], ["user", "user"])
    assert reasons([stored("a", time=now + 301), stored("b", time=now - 301)]) == ([], ["time", "time"])
    for bad in ({"loss": float("nan")}, {"samples": 2**63}, {"time": 1e12}, {"user": "x" * 65}, {"extra": 1}):
        assert reasons([stored("a", **bad)]) == ([], ["malformed"]), bad
    # Epochs: compared with the lower median, so one peer far ahead neither passes nor moves it ...
    assert reasons([stored("a"), stored("b"), stored("c", epoch=999)]) == ([peer_id["a"], peer_id["b"]], ["epoch"])
    assert reasons([stored("a"), stored("c", epoch=999)]) == ([peer_id["a"]], ["epoch"])
    # ... a swarm that moved on together passes, and a lone peer is its own reference, above the floor.
    assert reasons([stored("a", epoch=500), stored("b", epoch=501)], floor_epoch=30)[1] == []
    assert reasons([stored("c", epoch=999)]) == ([peer_id["c"]], [])
    assert reasons([stored("c", epoch=45)], floor_epoch=30, max_epoch_lead=10) == ([peer_id["c"]], [])


def dht_daemons_on(port: int) -> list[int]:
    """p2p daemons listening on the DHT port (found by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"p2pd") and f"-hostAddrs=/ip4/127.0.0.1/tcp/{port}".encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_an_auxiliary_peer_that_dies_anyway_is_started_again_on_its_port(run):
    """Whatever else ends it (the OOM killer, a bug): the coordinator starts it again, and what the
    killed one left behind (its DHT process and p2p daemon, still on the port) goes first."""
    pid = int((run.run_dir / "aux.pid").read_text())
    assert len(dht_daemons_on(run.dht_port)) == 1
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for("the auxiliary peer was not started again",
             lambda: int((run.run_dir / "aux.pid").read_text()) != pid and aux_alive(run)
             and run.status().get("updated", 0) > killed_at, timeout_s=120, swarm=run)
    assert len(dht_daemons_on(run.dht_port)) == 1, "the killed peer's daemon still holds the port"
    late = run.peer("late")  # joins through the same address as before
    late.store(late.record())
    wait_for("the late peer's record did not arrive",
             lambda: [m for m in get_json(f"{run.url}/api/metrics") if m["peer_id"] == late.peer_id], swarm=run)
    assert "exited with code -9; starting it again" in run.log("coordinator")


@pytest.mark.timeout(300)
def test_a_peer_claiming_more_samples_than_its_steps_can_hold_is_credited_the_bound_only(run):
    """A peer's ledger is its own claim: a step averages about the target batch (384 here), so
    the coordinator credits at most twice that per step, and counts the claim."""
    boaster = run.peer("boaster")
    boaster.store(boaster.record())

    def credited() -> int:
        return {r["user"]: r["samples"] for r in get_json(f"{run.url}/api/leaderboard")}.get("boaster", 0)

    wait_for("the honest record was not credited", lambda: credited() == 640, swarm=run)
    boaster.store(boaster.record(credited_samples=10**12, credited_steps=3, time=time.time() + 1))
    wait_for("the boast was not cut", lambda: counter(run, "credit_claims_over_step_bound") == 1, swarm=run)
    assert credited() == 640 + 2 * 384, credited()

