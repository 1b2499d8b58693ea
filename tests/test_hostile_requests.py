"""What a hostile or broken client can send the coordinator's HTTP service, and what it learns.

The real app through FastAPI's TestClient (with ``raise_server_exceptions=False``, so a crash
shows as the 500 a client would see), and a real server for the volunteer's own HTTP code.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.run import CoordinatorConfig, build_spec
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.runspec.tokens import token_request
from crowdtrain.swarm.auth import load_identity

VOLUNTEER_MADDR = "/ip4/203.0.113.7/tcp/40123/p2p/QmVolunteer"
BOOTSTRAP_MADDR = "/ip4/198.51.100.1/tcp/31337/p2p/QmCoordinator"


def signed(tmp_path: Path, user: str, name: str = "peer") -> dict:
    """A token request as `crowdtrain join` sends it: signed by the peer's identity."""
    key = load_identity(tmp_path / f"{name}.key")
    return token_request(key.get_public_key().to_bytes(), user, key.sign)


def make_app(tmp_path: Path, *, mode: str = "open", run_json: dict | None = None):
    run, shards = tmp_path / "run", tmp_path / "shards"
    run.mkdir(exist_ok=True)
    shards.mkdir(exist_ok=True)
    (shards / "train-00000.parquet").write_bytes(b"shard")
    if run_json is not None:
        (run / "run.json").write_text(json.dumps(run_json))
    store = Store(default_url(run))
    app = create_app(run, store=store, shards_dir=shards,
                     auth=AuthSettings(mode=mode, key_path=run / "coordinator_key.pem"))
    return TestClient(app, raise_server_exceptions=False), store


def test_unencodable_names_nul_bytes_and_non_finite_numbers_get_a_clear_4xx_not_a_500(tmp_path):
    client, store = make_app(tmp_path)
    # A lone surrogate is valid JSON ("\ud800") but no valid text: FastAPI's 422 echoed it and
    # could not encode its own answer.
    r = client.post("/api/token", content=b'{"public_key": "ssh-rsa AAAA", "user": "\\ud800"}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "user"] and "unicode" in r.json()["detail"][0]["msg"]
    # A NUL byte reached the OS call, which raised.
    for path in ("/shards/train-00000.parquet%00", "/shards/%00", "/files/samples/x%00.png",
                 "/checkpoints/step%00/config.json"):
        r = client.get(path)
        assert r.status_code == 400 and "NUL byte" in r.json()["detail"], (path, r.text)
    r = client.get("/shards/" + "a" * 5000)  # a name too long for the file system: not there
    assert r.status_code == 404, r.text[:200]
    assert client.get("/shards/train-00000.parquet").content == b"shard", "real shards still served"
    # NaN passed `pcie_gb_per_s <= 0` and the answer held NaN, which JSON cannot encode.
    for value in ("nan", "inf", "-inf"):
        r = client.get(f"/memcalc/api/estimate?model=gpt2&offload=true&pcie_gb_per_s={value}")
        assert r.status_code == 422 and "pcie_gb_per_s must be a positive finite number" in r.json()["detail"], r.text
    for query in ("batch_size=" + "9" * 400, "offload=true&pcie_gb_per_s=1e-320"):
        r = client.get(f"/memcalc/api/estimate?model=gpt2&{query}")
        assert r.status_code == 422 and "too large to estimate" in r.json()["detail"], (query, r.text)
    assert client.get("/memcalc/api/estimate?model=gpt2").status_code == 200


def test_user_names_are_ascii_so_a_lookalike_of_another_name_is_refused(tmp_path):
    client, store = make_app(tmp_path)
    assert client.post("/api/token", json=signed(tmp_path, "alice")).status_code == 200
    lookalike = "\u0430lice"  # Cyrillic a
    r = client.post("/api/token", json=signed(tmp_path, lookalike, name="mallory"))
    assert r.status_code == 422 and "ASCII" in r.json()["detail"], r.text
    for name in ("\u00e9mile", "\u0101", "\uff41lice"):  # accented, Latin extended, fullwidth
        assert client.post("/api/token", json=signed(tmp_path, name, name="mallory")).status_code == 422
    with pytest.raises(ValueError, match="ASCII"):
        store.add_user(lookalike)  # `crowdtrain users add` (allowlist runs) goes through the same rule
    assert [u["name"] for u in store.list_users()] == ["alice"]
    assert "alice" in {r["user"] for r in client.get("/api/leaderboard").json()}
    # `crowdtrain join` says so at once, instead of retrying a refused token request.
    out = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "join", "http://127.0.0.1:9", "--user", lookalike],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "ASCII" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_refused_token_request_leaves_no_user_behind_on_an_open_run(tmp_path):
    client, store = make_app(tmp_path)
    own, other = signed(tmp_path, "ghost"), signed(tmp_path, "ghost", name="other")
    refused = [{**own, "signature": ""},  # unsigned
               {**own, "public_key": other["public_key"], "peer_id": other["peer_id"]},  # not signed by that key
               {**own, "public_key": other["public_key"]},  # the peer ID of another key
               {**own, "peer_id": other["peer_id"]},
               {**own, "public_key": "ssh-rsa garbage"}]
    for body in refused:
        assert client.post("/api/token", json=body).status_code in (403, 422)
    assert store.list_users() == [] and client.get("/api/leaderboard").json() == []
    assert store.counters()["token_requests_refused"] == 4  # the garbage key is malformed, not refused
    assert client.post("/api/token", json=own).status_code == 200
    assert [u["name"] for u in store.list_users()] == ["ghost"]


def test_counters_keep_the_runs_total_across_restarts_of_the_process_that_counts(tmp_path):
    """The auxiliary peer counts refused records and requests in memory (from zero at each start)
    and adds what is new to the database, so its restart (it is restarted if it dies) loses nothing."""
    store = Store(default_url(tmp_path))
    reported: dict[str, int] = {}
    store.add_new_counts(reported, {"metrics_records_refused": 3, "averaging_requests_refused": 1})
    store.add_new_counts(reported, {"metrics_records_refused": 5, "averaging_requests_refused": 1})
    store.bump("token_requests_refused")  # the web process counts in the same table
    store.close()
    restarted = Store(default_url(tmp_path))
    restarted.add_new_counts({}, {"metrics_records_refused": 2, "averaging_requests_refused": 0})
    assert restarted.counters() == {"metrics_records_refused": 7, "averaging_requests_refused": 1,
                                    "token_requests_refused": 1}


def run_json(tmp_path: Path) -> dict:
    """run.json as the auxiliary peer writes it, from the spec the coordinator really builds."""
    config = CoordinatorConfig(run_dir=str(tmp_path / "run"), data="shapes")
    spec = build_spec(config, shards_dir=tmp_path / "shards")
    return {"run_id": "r1", "fingerprint": "f" * 16, "swarm": spec["swarm"], "task": spec["task"],
            "initial_peers": [BOOTSTRAP_MADDR], "text_tokenizer": spec["text_tokenizer"],
            "coordinator_peer_id": "QmCoordinator", "auth": {"mode": spec["auth"]["mode"]}}


def status_json(run: Path) -> None:
    peer = {"peer_id": "QmVolunteer", "epoch": 3, "samples": 64, "samples_per_second": 5.0, "loss": 4.0, "steps": 4,
            "time": time.time(), "client_mode": False, "last_round_peers": 2, "swarm_peers": 2, "fingerprint": "f",
            "user": "alice", "maddrs": [VOLUNTEER_MADDR]}
    (run / "status.json").write_text(json.dumps({"epoch": 3, "peers": [peer], "updated": time.time()}))


def test_join_info_holds_no_coordinator_paths_and_no_page_gives_out_volunteers_addresses(tmp_path):
    info = run_json(tmp_path)
    info["text_tokenizer"]["url"] = "http://127.0.0.1:8000/assets/text_tokenizer.json"
    client, store = make_app(tmp_path, run_json=info)
    status_json(tmp_path / "run")
    join = client.get("/api/join")
    assert join.status_code == 200
    assert join.json()["initial_peers"] == [BOOTSTRAP_MADDR], "an open run's bootstrap address is public"
    assert join.json()["text_tokenizer"]["url"].endswith("/assets/text_tokenizer.json")
    assert "path" not in join.json()["text_tokenizer"]
    for secret in (str(Path(__file__).resolve().parents[1]), str(tmp_path)):
        assert secret not in join.text, f"/api/join gives out {secret}"
    status = client.get("/api/status").json()
    assert [p["user"] for p in status["peers"]] == ["alice"] and "maddrs" not in status["peers"][0]
    for path in ("/api/status", "/", "/dashboard", "/peers", "/peers?all=true", "/join", "/leaderboard"):
        r = client.get(path)
        assert r.status_code == 200 and "203.0.113.7" not in r.text, f"{path} gives out a volunteer's address"


def test_an_allowlist_run_gives_peer_addresses_only_to_its_users(tmp_path):
    """`crowdtrain join --key` asks with its key, so invited volunteers still find the swarm."""
    import uvicorn

    from crowdtrain.swarm.join_info import fetch_json
    from crowdtrain.launch import free_port

    info = {**run_json(tmp_path), "auth": {"mode": "allowlist"}}
    client, store = make_app(tmp_path, mode="allowlist", run_json=info)
    status_json(tmp_path / "run")
    key, revoked = store.add_user("alice"), store.add_user("bob")
    store.revoke_user("bob")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(client.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/api/join"
        assert fetch_json(url, patience_s=5)["initial_peers"] == []
        assert fetch_json(url, patience_s=5, api_key="ct_guess")["initial_peers"] == []
        assert fetch_json(url, patience_s=5, api_key=revoked)["initial_peers"] == []
        assert fetch_json(url, patience_s=5, api_key=key)["initial_peers"] == [BOOTSTRAP_MADDR]
        for path in ("/api/status", "/peers", "/dashboard"):
            assert "203.0.113.7" not in client.get(path).text and "198.51.100.1" not in client.get(path).text
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_guessing_api_keys_at_the_join_endpoint_is_rate_limited_like_token_requests(tmp_path):
    """On an allowlist run /api/join answers a valid key with the swarm's addresses and a wrong
    one without: an oracle for key guesses, so wrong keys spend the address's budget."""
    info = {**run_json(tmp_path), "auth": {"mode": "allowlist"}}
    client, store = make_app(tmp_path, mode="allowlist", run_json=info)
    status_json(tmp_path / "run")
    key = store.add_user("alice")
    budget = AuthSettings(mode="allowlist", key_path=tmp_path / "k.pem").requests_per_minute
    answers = [client.get("/api/join", headers={"Authorization": f"Bearer ct_guess{i}"}).status_code
               for i in range(budget + 1)]
    assert answers[:budget] == [200] * budget and answers[-1] == 429, answers
    # The guesser's address is spent, the invited volunteer's key is not; asking without a key
    # (the join page) is not a guess.
    assert client.get("/api/join", headers={"Authorization": f"Bearer {key}"}).json()["initial_peers"] == \
        [BOOTSTRAP_MADDR]
    assert client.get("/api/join").status_code == 200
    assert client.post("/api/token", json=signed(tmp_path, "alice"),
                       headers={"Authorization": "Bearer ct_another_guess"}).status_code == 429


def test_the_rate_limiter_forgets_expired_windows_and_stays_bounded_under_many_addresses():
    """Every source address gets a bucket: the table must shrink once their windows pass (it
    used to keep every address it ever saw, each call then slower) and never hold more than
    ``max_buckets``, while each address still gets its own limit."""
    from crowdtrain.coordinator.service import RateLimiter

    now = [0.0]
    limiter = RateLimiter(3, window_s=60.0, max_buckets=5_000, clock=lambda: now[0])
    for i in range(4_000):
        assert limiter.allow(f"address:10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(limiter) == 4_000
    assert [limiter.allow("address:attacker") for _ in range(4)] == [True, True, True, False]
    now[0] = 61.0  # every window passed: the next call sweeps them all
    assert limiter.allow("address:newcomer") and len(limiter) == 1
    assert limiter.allow("address:attacker"), "a bucket whose window passed starts afresh"
    for i in range(20_000):  # more live addresses than the table holds: the least recent go
        limiter.allow(f"address:flood-{i}")
    assert len(limiter) == 5_000
    now[0] = 62.0
    assert [limiter.allow("address:flood-19999") for _ in range(3)] == [True, True, False], \
        "a live bucket keeps its count"


def test_list_endpoints_are_capped_whatever_strangers_fill_the_tables_with(tmp_path):
    client, store = make_app(tmp_path, run_json=run_json(tmp_path))
    now = time.time()
    store.record_metrics([{"peer_id": f"QmPeer{i}", "epoch": 1, "samples": 16, "samples_per_second": 1.0, "loss": 4.0,
                           "steps": 1, "time": now - i, "client_mode": False, "last_round_peers": 1,
                           "swarm_peers": 1, "fingerprint": "f", "user": f"user{i}", "maddrs": []}
                          for i in range(30)])
    peers = client.get("/api/peers?limit=7").json()
    assert [p["peer_id"] for p in peers] == [f"QmPeer{i}" for i in range(7)], "the newest first, capped"
    assert len(client.get("/api/peers").json()) == 30
    assert len(client.get("/api/leaderboard?limit=5").json()) == 5
    for path in ("/api/peers?limit=10001", "/api/leaderboard?limit=0", "/api/metrics?limit=1000000",
                 "/api/history?limit=1000000", "/api/samples?limit=100000"):
        r = client.get(path)
        assert r.status_code == 422 and "limit must be between" in r.json()["detail"], path


def test_the_shard_folder_serves_shards_and_manifests_and_never_the_organizers_pictures(tmp_path):
    """`data prepare` leaves a fit report (a grid of the organizer's own pictures) and the list of
    skipped files beside the shards; volunteers never download the organizer's images."""
    client, _ = make_app(tmp_path, run_json=run_json(tmp_path))
    shards = tmp_path / "shards"
    (shards / "shards.json").write_text("{}")
    (shards / "fit_report-train.png").write_bytes(b"\x89PNG the organizer's pictures")
    (shards / "skipped-train.txt").write_text("/home/organizer/private/holiday.jpg\n")
    assert client.get("/shards/train-00000.parquet").content == b"shard"
    assert client.get("/shards/shards.json").status_code == 200
    (shards / ".hidden.json").write_text("{}")
    for name in ("fit_report-train.png", "skipped-train.txt", ".hidden.json"):
        r = client.get(f"/shards/{name}")
        assert r.status_code == 404 and "serves its *.parquet shards" in r.json()["detail"], name


def test_secrets_stay_in_files_only_their_owner_reads_and_out_of_command_lines(tmp_path):
    import os
    import re
    import stat

    from crowdtrain.coordinator.run import write_private

    spec = tmp_path / "coordinator.json"
    spec.write_text("{}")
    os.chmod(spec, 0o644)  # an older run's spec, as the default umask left it
    old = os.umask(0)
    try:
        write_private(spec, json.dumps({"db_url": "postgresql://crowd:secret@db/run"}))
    finally:
        os.umask(old)
    assert stat.S_IMODE(spec.stat().st_mode) == 0o600 and "secret" in spec.read_text()
    out = subprocess.run([sys.executable, "-m", "crowdtrain.cli", "users", "add", "alice", "--run-dir",
                          str(tmp_path / "run")], check=True, capture_output=True, text=True, timeout=120).stdout
    key = re.search(r"(ct_\S+)", out).group(1)
    join_lines = [line for line in out.splitlines() if "crowdtrain join" in line]
    assert join_lines and all(key not in line and "--key" not in line for line in join_lines), out
    assert "CROWDTRAIN_KEY" in out


def test_the_join_information_is_read_again_only_when_the_run_replaces_it(tmp_path, monkeypatch):
    # /api/join serves run.json to every volunteer's schedule poll: parsed once per change.
    from crowdtrain.coordinator import service
    from crowdtrain.runspec.files import write_json_atomic

    reads = []
    real = service._read_json
    monkeypatch.setattr(service, "_read_json", lambda path: reads.append(path) or real(path))
    path = tmp_path / "run.json"
    cached = service.JsonFile(path)
    assert cached.read() is None and reads == [], "no file yet: nothing read"
    write_json_atomic(path, {"run_id": "a", "total_epochs": 10})
    assert [cached.read() for _ in range(50)] == [{"run_id": "a", "total_epochs": 10}] * 50
    assert len(reads) == 1
    write_json_atomic(path, {"run_id": "a", "total_epochs": 20})  # the organizer extended the run
    assert cached.read() == {"run_id": "a", "total_epochs": 20} and len(reads) == 2
    path.write_text("{not json")
    assert cached.read() is None, "a broken file reads as none, as before"
