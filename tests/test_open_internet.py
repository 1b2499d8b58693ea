"""A run on the open Internet, on one machine: the coordinator serves HTTPS itself (`--tls-cert`,
a CA of the test's own), and an attacker on the path (a real mitmproxy whose CA the volunteer
trusts, as a compromised CA or a corporate proxy would be) changes one thing at a time. Each
change is refused by name; the same proxy changing nothing lets a volunteer train and be credited.
The key, signatures and manifests are ``crowdtrain.runspec.trust``'s; Caddy in front of a
coordinator is tests/test_volunteer_from_zero.py's run.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from crowdtrain.launch import LocalSwarm, cli, get_json, join_args, spawn
from crowdtrain.runspec.tokens import CoordinatorKey
from crowdtrain.runspec.trust import (CoordinatorTrust, FileMismatch, UntrustedCoordinator, check_key_transport,
                                      fingerprint, sign_answer)
from tests.tls_servers import Mitm, make_certificates, network_address


# ---- the decisions, in-process ------------------------------------------------------------------
def test_the_fingerprint_is_the_one_ssh_keygen_prints_for_the_key(tmp_path):
    key = CoordinatorKey.load_or_create(tmp_path / "k.pem")
    (tmp_path / "k.pub").write_bytes(key.public_key + b"\n")
    out = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True, check=True)
    assert fingerprint(key.public_key) == out.stdout.split()[1], out.stdout


class Headers(dict):
    pass


def test_trust_on_first_use_remembers_a_key_and_refuses_a_changed_one(tmp_path):
    real, other = (CoordinatorKey.load_or_create(tmp_path / n) for n in ("real.pem", "other.pem"))
    known = tmp_path / "known.json"
    body = b'{"run_id": "r"}'
    first = CoordinatorTrust("https://run.example.org", known_path=known)
    first.check(body, Headers(sign_answer(real, body)), "join info")
    assert json.loads(known.read_text()) == {"https://run.example.org:443": fingerprint(real.public_key)}
    CoordinatorTrust("https://run.example.org/", known_path=known).check(body, Headers(sign_answer(real, body)), "x")
    with pytest.raises(UntrustedCoordinator, match="when this machine first joined it") as changed:
        CoordinatorTrust("https://run.example.org", known_path=known).check(body, Headers(sign_answer(other, body)),
                                                                           "join info")
    assert str(known) in str(changed.value) and fingerprint(other.public_key) in str(changed.value)
    # A pin decides alone: the pinned key is taken at an address that remembered another one.
    pinned = CoordinatorTrust("https://run.example.org", pin=fingerprint(other.public_key), known_path=known)
    pinned.check(body, Headers(sign_answer(other, body)), "join info")
    with pytest.raises(UntrustedCoordinator, match="not the pinned"):
        CoordinatorTrust("https://run.example.org", pin=fingerprint(other.public_key), known_path=known).check(
            body, Headers(sign_answer(real, body)), "join info")
    # Loopback is not remembered: test runs reuse ports with new keys.
    CoordinatorTrust("http://127.0.0.1:8000", known_path=known).check(body, Headers(sign_answer(other, body)), "x")
    assert "http://127.0.0.1:8000" not in known.read_text()


def test_an_answer_changed_after_signing_or_unsigned_is_refused(tmp_path):
    key = CoordinatorKey.load_or_create(tmp_path / "k.pem")
    trust = CoordinatorTrust("https://h", pin=fingerprint(key.public_key), known_path=tmp_path / "known.json")
    headers = Headers(sign_answer(key, b'{"initial_peers": ["/ip4/10.0.0.1/tcp/1"]}'))
    with pytest.raises(UntrustedCoordinator, match="changed on the way"):
        trust.check(b'{"initial_peers": ["/ip4/10.6.6.6/tcp/1"]}', headers, "join info")
    with pytest.raises(UntrustedCoordinator, match="without the coordinator's signature"):
        trust.check(b"{}", Headers(), "join info")
    # Fresh: signed for the request's nonce; an answer signed for another request (or none) is a replay.
    body = b'{"initial_peers": []}'
    _, nonce = trust.request_headers()
    trust.check(body, Headers(sign_answer(key, body, nonce)), "join info", nonce)
    for earlier in (CoordinatorTrust.request_headers()[1], None):
        with pytest.raises(UntrustedCoordinator, match="not for this request"):
            trust.check(body, Headers(sign_answer(key, body, earlier)), "join info", nonce)
    with pytest.raises(ValueError, match="--pin must be"):
        CoordinatorTrust("https://h", pin="deadbeef")


@pytest.mark.parametrize("url,refused", [("http://run.example.org:8000", True), ("http://10.1.2.3:8000", True),
                                         ("https://run.example.org", False), ("http://127.0.0.1:8000", False),
                                         ("http://localhost:8000", False), ("http://[::1]:8000", False)])
def test_an_api_key_goes_over_https_or_to_this_machine_only(url, refused):
    if refused:
        with pytest.raises(ValueError, match="over plain http://.*--public-url https://"):
            check_key_transport(url + "/api/token")
    else:
        check_key_transport(url + "/api/token")


def test_a_shard_changed_on_the_way_is_refused_by_name_before_a_row_is_read(tmp_path):
    import http.server

    from crowdtrain.data.streaming import fetch_verified

    (tmp_path / "train-00000.parquet").write_bytes(b"PAR1 the real shard")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: http.server.SimpleHTTPRequestHandler(
        *a, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/train-00000.parquet"
    try:
        import hashlib

        good = hashlib.sha256(b"PAR1 the real shard").hexdigest()
        assert fetch_verified(url, good, timeout_s=10).read() == b"PAR1 the real shard"
        with pytest.raises(FileMismatch, match="train-00000.parquet .* does not match"):
            fetch_verified(url, "0" * 64, timeout_s=10)
        with pytest.raises(FileMismatch, match="not in the coordinator's signed manifest"):
            fetch_verified(url, None, timeout_s=10)
        # The tokenizer takes the same way into the cache, named by its hash; a mismatch leaves nothing.
        from crowdtrain.swarm.peer import download_asset

        cache = tmp_path / "cache"
        with pytest.raises(FileMismatch, match="train-00000.parquet .* does not match"):
            download_asset(url, "0" * 64, cache)
        assert list(cache.iterdir()) == [], "a refused download is not kept"
        path = download_asset(url, good, cache)
        assert path.read_bytes() == b"PAR1 the real shard" and path.name.startswith(good)
        server.shutdown()
        assert download_asset(url, good, cache) == path, "cached by hash: not fetched again"
    finally:
        server.shutdown()


# ---- a real run over HTTPS, through a real intercepting proxy -------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from crowdtrain.data import ensure_demo_shards

    tmp = tmp_path_factory.mktemp("https")
    certs = make_certificates(tmp / "certs")
    shards = ensure_demo_shards(tmp / "shapes", num_train=500, cache=False)
    swarm = LocalSwarm(tmp, data=str(shards), swarm={"total_epochs": 100_000, "target_batch_size": 64,
                                                     "checkpoint_every_epochs": 1})
    swarm.url = f"https://localhost:{swarm.port}"
    old_cert_file = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(certs["ca"])  # this process reads the run's API too
    swarm.env["SSL_CERT_FILE"] = str(certs["ca"])
    mitm = None
    try:
        swarm.start_coordinator(extra=["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"]),
                                       "--public-url", swarm.url])
        swarm.pin = fingerprint(CoordinatorKey.load_or_create(swarm.run_dir / "coordinator_key.pem").public_key)
        # The run's own peer, straight to the coordinator: the state to download and the partner to
        # average with. At a slow device's pace, so that it leaves the cores to the volunteers tested.
        swarm.join("first", batch_size=8, max_epochs=100_000, extra=["--pin", swarm.pin, "--simulated-step-s", "1.0"])
        mitm = Mitm(tmp / "mitm", upstream_ca=certs["ca"])
        bundle = tmp / "trusted.pem"  # the volunteer trusts the run's CA and, unknowingly, the attacker's
        bundle.write_text(certs["ca"].read_text() + mitm.ca.read_text())
        swarm.mitm, swarm.proxied_env = mitm, {**swarm.env, **mitm.env(bundle), "PIP_CERT": str(bundle),
                                               "REQUESTS_CA_BUNDLE": str(bundle)}
        yield swarm
    finally:
        if mitm is not None:
            mitm.close()
        swarm.close()
        if old_cert_file is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = old_cert_file


def join_through_proxy(run, name: str, *, extra=()) -> subprocess.Popen:
    argv = cli(*join_args(run.url, user=name, batch_size=8, host="127.0.0.1", max_epochs=100_000,
                          summary_file=run.tmp / f"{name}.json", extra=["--pin", run.pin, *extra]))
    run.procs[name] = spawn(argv, run.tmp / f"{name}.log", env=run.proxied_env)
    return run.procs[name]


def ended(run, name: str, timeout: float = 180.0) -> str:
    """The log of volunteer ``name`` once it exited (a failure if it did not within ``timeout``)."""
    try:
        run.procs[name].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.procs[name].pid, signal.SIGKILL)
        pytest.fail(f"{name} did not stop within {timeout} s:\n{run.log(name)[-3000:]}")
    return run.log(name)


def test_through_a_proxy_that_changes_nothing_a_volunteer_trains_and_is_credited(run):
    run.mitm.set_rules([{"path_suffix": "", "kind": "replace", "old": "", "new": ""}])  # passes all, counts it
    proc = join_through_proxy(run, "proxied")
    deadline = time.monotonic() + 240
    board = {}
    while time.monotonic() < deadline and proc.poll() is None:
        board = {row["user"]: row["samples"] for row in get_json(f"{run.url}/api/leaderboard")}
        if board.get("proxied", 0) > 0:
            break
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)
    log = ended(run, "proxied", 120)
    assert board.get("proxied", 0) > 0, (board, log[-3000:])
    hits = run.mitm.hits()
    assert any(h.startswith("/api/join") for h in hits) and any(h.endswith(".parquet") for h in hits), hits[:20]


def test_a_shard_changed_on_the_way_stops_the_volunteer_naming_it(run):
    run.mitm.set_rules([{"path_suffix": ".parquet", "kind": "flip"}])
    join_through_proxy(run, "shard-victim")
    log = ended(run, "shard-victim")
    assert run.procs["shard-victim"].returncode != 0, log[-3000:]
    assert "does not match the coordinator's signed manifest" in log and ".parquet" in log, log[-3000:]
    assert run.mitm.hits(), "the proxy changed nothing: the test did not test"


def test_join_information_changed_on_the_way_or_signed_by_another_key_is_refused(run, tmp_path):
    run.mitm.set_rules([{"path_suffix": "/api/join", "kind": "replace", "old": "/ip4/127.0.0.1/",
                         "new": "/ip4/127.6.6.6/"}])
    join_through_proxy(run, "join-victim")
    log = ended(run, "join-victim", 120)
    assert run.procs["join-victim"].returncode == 2 and "changed on the way" in log, log[-3000:]
    attacker = CoordinatorKey.load_or_create(tmp_path / "attacker.pem")
    run.mitm.set_rules([{"path_suffix": "/api/join", "kind": "resign", "key_pem": str(tmp_path / "attacker.pem"),
                         "old": "/ip4/127.0.0.1/", "new": "/ip4/127.6.6.6/"}])
    join_through_proxy(run, "key-victim")
    log = ended(run, "key-victim", 120)
    assert run.procs["key-victim"].returncode == 2, log[-3000:]
    assert f"has key {fingerprint(attacker.public_key)}, not the pinned {run.pin}" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_an_earlier_answer_replayed_is_refused(run, tmp_path):
    """An attacker on the path (here: holding a certificate the volunteer trusts) records the
    coordinator's signed join information and later hands it back (older peers, an older wheel):
    it is signed for another request's nonce, and refused."""
    recorded = tmp_path / "recorded.json"
    run.mitm.set_rules([{"path_suffix": "/api/join", "kind": "replay", "file": str(recorded)}])
    code = ("from crowdtrain.runspec.trust import CoordinatorTrust; from crowdtrain.swarm.join_info import fetch_json; "
            f"fetch_json({run.url + '/api/join'!r}, trust=CoordinatorTrust({run.url!r}, pin={run.pin!r}))")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=run.proxied_env)
    assert first.returncode == 0 and recorded.is_file(), first.stderr[-3000:]
    join_through_proxy(run, "replay-victim")
    log = ended(run, "replay-victim", 120)
    run.mitm.set_rules([])
    assert run.procs["replay-victim"].returncode == 2, log[-3000:]
    assert "is signed by the coordinator, but not for this request" in log, log[-3000:]


def fetch_checkpoint_through_proxy(run, cache: Path) -> subprocess.CompletedProcess:
    code = ("import sys; from crowdtrain.remote import fetch_checkpoint; "
            f"print(fetch_checkpoint({run.url!r}, pin={run.pin!r}, cache_dir={str(cache)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=run.proxied_env)


def wait_for_a_checkpoint(run, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not [c for c in get_json(f"{run.url}/api/checkpoints") if not c.get("pruned")]:
        assert time.monotonic() < deadline, f"no checkpoint within {timeout} s:\n" + run.log("coordinator")[-2000:]
        time.sleep(2)


def test_a_checkpoint_file_changed_on_the_way_is_refused_and_an_untouched_one_is_cached_by_hash(run, tmp_path):
    wait_for_a_checkpoint(run)
    run.mitm.set_rules([{"path_suffix": "model.safetensors", "kind": "flip"}])
    refused = fetch_checkpoint_through_proxy(run, tmp_path / "a")
    assert refused.returncode != 0 and "model.safetensors" in refused.stderr, refused.stderr[-3000:]
    assert "does not match the coordinator's signed manifest" in refused.stderr, refused.stderr[-3000:]
    assert not list((tmp_path / "a").rglob("model.safetensors")), "a refused file must not stay in the cache"
    run.mitm.set_rules([])
    fetched = fetch_checkpoint_through_proxy(run, tmp_path / "b")
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    folder = Path(fetched.stdout.strip().splitlines()[-1])
    assert (folder / "model.safetensors").is_file() and folder.name.count("-") >= 1
    # The name is the checkpoint's and its files' hashes: a file that changes under the same name
    # is a new folder, never the cached one.
    assert folder.parent == tmp_path / "b" / "checkpoints"


def test_a_wheel_changed_on_the_way_is_refused_by_the_install_lines_hash(run, tmp_path):
    line = get_json(f"{run.url}/api/version")["install"]
    requirement = line.split('"')[1]
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--cert",
                run.proxied_env["PIP_CERT"], "-d", str(tmp_path / "dl"), requirement]
    run.mitm.set_rules([{"path_suffix": ".whl", "kind": "flip"}])
    refused = subprocess.run(download, capture_output=True, text=True, timeout=300, env=run.proxied_env)
    assert refused.returncode != 0 and "HASHES" in refused.stderr.upper(), refused.stdout + refused.stderr[-3000:]
    assert run.mitm.hits()
    run.mitm.set_rules([])
    fetched = subprocess.run(download, capture_output=True, text=True, timeout=300, env=run.proxied_env)
    assert fetched.returncode == 0 and list((tmp_path / "dl").glob("*.whl")), fetched.stderr[-3000:]
    # The install line itself, in a fresh venv, from the natively served HTTPS (its dependencies
    # are what tests/test_volunteer_from_zero.py installs behind Caddy; not again here).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    version = get_json(f"{run.url}/api/version")["version"]
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                                "--cert", run.proxied_env["PIP_CERT"], requirement], capture_output=True, text=True,
                               timeout=300, env=run.proxied_env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    shown = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "show", "crowdtrain"], capture_output=True,
                           text=True, timeout=120)
    assert f"Version: {version.split('+')[0]}" in shown.stdout, (version, shown.stdout)


def test_join_sends_no_api_key_over_plain_http_to_another_machine(tmp_path):
    """What reaches the address: a listener on this machine's own network address (not loopback)
    records every byte; `crowdtrain join http://THAT:PORT --key ...` must stop before connecting."""
    address = network_address()
    listener = socket.socket()
    listener.bind((address, 0))
    listener.listen()
    listener.settimeout(0.5)
    received = []

    def record():
        while True:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(2)
            try:
                received.append(conn.recv(65536))
            finally:
                conn.close()

    threading.Thread(target=record, daemon=True).start()
    url = f"http://{address}:{listener.getsockname()[1]}"
    done = subprocess.run(cli("join", url, "--key", "ct_secret_never_sent"), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CROWDTRAIN_KNOWN_COORDINATORS": str(tmp_path / "k.json")})
    time.sleep(1)
    listener.close()
    assert done.returncode == 2 and "refusing to send your API key" in done.stderr, done.stderr[-3000:]
    assert "--public-url https://" in done.stderr
    assert received == [], f"bytes reached {url}: {received}"


def test_eval_checks_a_coordinators_held_out_shards_against_its_signed_manifest(run, tmp_path):
    """`crowdtrain eval` on a checkpoint whose run recorded the coordinator's /shards: the held-out
    shards are fetched whole and checked; one changed on the way stops it, naming the file."""
    wait_for_a_checkpoint(run)
    fetched = fetch_checkpoint_through_proxy(run, tmp_path / "cache")
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    checkpoint = fetched.stdout.strip().splitlines()[-1]
    command = cli("eval", "--checkpoint", checkpoint, "--pin", run.pin, "--max-rows", "16",
                  "--samples-per-prompt", "1")
    env = {**run.proxied_env, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}
    run.mitm.set_rules([{"path_suffix": "00000.parquet", "kind": "flip"}])
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode != 0 and "does not match the coordinator's signed manifest" in refused.stderr, \
        refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "00000.parquet" in refused.stderr and "train-" not in refused.stderr  # held-out shards only
    run.mitm.set_rules([])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "checked against its coordinator's signed manifest" in done.stdout and "valid" in done.stdout, done.stdout
