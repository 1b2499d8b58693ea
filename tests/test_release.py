"""The crowdtrain a coordinator serves, and the protocol check: in-process, fast.

The real install from the served wheel into a fresh Python, and the notebooks on a real kernel,
are in tests/test_volunteer_from_zero.py.
"""

import hashlib
import io
import json
import zipfile

import pytest
from fastapi.testclient import TestClient

from crowdtrain import release
from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.service import create_app
from crowdtrain.runspec.tokens import token_payload, token_request
from crowdtrain.swarm.auth import load_identity

from tests.test_hostile_requests import run_json

# What goes over the wire at each protocol: the DHT records' schemas, the token's signed bytes and
# the token request's fields. A change here without a new protocol number would let two
# crowdtrains that cannot train together meet in one swarm.
WIRE_DIGESTS = {1: "1a651bc36e928138"}


def wire_digest() -> str:
    from crowdtrain.swarm.metrics import RunSchema, make_validators

    # The schema as peers enforce it: hivemind's SchemaValidator patches the models it checks
    # (every field required), in every peer's process, once any validator exists.
    make_validators("wire")
    RunSchema.__schema_cache__.clear()
    key = load_identity_for_digest()
    wire = {"records": RunSchema.schema(),  # pydantic v1 models, as hivemind uses
            "token": token_payload("user", b"ssh-rsa KEY", "2026-01-01").decode(),
            "token_request": sorted(token_request(key.get_public_key().to_bytes(), "user", key.sign, now=0.0))}
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


def load_identity_for_digest():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        return load_identity(Path(d) / "k.key")


def test_a_change_of_the_wire_format_comes_with_a_new_protocol_number():
    digest = wire_digest()
    assert release.PROTOCOL in WIRE_DIGESTS, f"record the wire digest of protocol {release.PROTOCOL}: {digest}"
    assert digest == WIRE_DIGESTS[release.PROTOCOL], (
        f"the DHT records, the token or the token request changed (digest {digest}, protocol "
        f"{release.PROTOCOL} was {WIRE_DIGESTS[release.PROTOCOL]}): peers of the old and new code would meet in one "
        "swarm and refuse each other's records. Bump crowdtrain.release.PROTOCOL and record the new digest here")


def test_the_wheel_is_the_running_package_reproducibly_with_the_volunteer_extra(tmp_path):
    data = release.wheel_bytes()
    assert data == release.wheel_bytes(), "the same code must give the same wheel (the install line's hash)"
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    files = {f"crowdtrain/{p.relative_to(release.PACKAGE_ROOT).as_posix()}" for p in release.package_files()}
    assert files <= set(names) and "crowdtrain/release.py" in files and "crowdtrain/assets/shapes_vq.safetensors" in files
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    dist_info = f"crowdtrain-{release.full_version()}.dist-info"
    wheel = zipfile.ZipFile(io.BytesIO(data))
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert f"Version: {release.full_version()}" in metadata
    volunteer = [line.split(": ", 1)[1] for line in metadata.splitlines()
                 if line.startswith("Requires-Dist:") and 'extra == "volunteer"' in line]
    needed = {r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip() for r in volunteer}
    assert {"hivemind", "bitsandbytes", "datasets", "pyarrow", "tokenizers"} <= needed
    assert not needed & {"fastapi", "uvicorn", "sqlalchemy", "psycopg[binary]", "playwright", "matplotlib",
                         "transformers"}, f"the volunteer extra holds more than joining needs: {needed}"
    assert "Requires-Dist: torch>=2.1\n" in metadata, "torch must stay a range an installed (CUDA) torch satisfies"
    assert "crowdtrain = crowdtrain.cli:main" in wheel.read(f"{dist_info}/entry_points.txt").decode()
    # RECORD lists every file with its hash, as pip checks on install.
    record = {row.split(",")[0]: row.split(",")[1] for row in wheel.read(f"{dist_info}/RECORD").decode().splitlines()}
    assert set(record) == set(names)
    source = wheel.read("crowdtrain/release.py")
    assert record["crowdtrain/release.py"] == release._record_hash(source)


def test_the_build_id_follows_the_code(tmp_path):
    package = tmp_path / "crowdtrain"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    (package / "sub" / "b.json").write_text("{}")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"compiled")
    before = release.build_id.__wrapped__(package)
    (package / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"recompiled")
    assert release.build_id.__wrapped__(package) == before, "byte code is not the code"
    (package / "a.py").write_text("x = 2\n")
    assert release.build_id.__wrapped__(package) != before


def make_client(tmp_path, public_url="http://203.0.113.5:8000"):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "run.json").write_text(json.dumps(run_json(tmp_path)))
    store = Store(default_url(run))
    return TestClient(create_app(run, store=store, public_url=public_url), raise_server_exceptions=False), store


def test_the_coordinator_serves_its_wheel_and_one_install_line_everywhere(tmp_path):
    client, _ = make_client(tmp_path)
    version = client.get("/api/version").json()
    assert version["version"] == release.full_version() and version["protocol"] == release.PROTOCOL
    line = version["install"]
    assert line.startswith('pip install "crowdtrain[volunteer] @ http://203.0.113.5:8000/install/crowdtrain-')
    wheel = client.get(version["wheel"].removeprefix("http://203.0.113.5:8000"))
    assert wheel.status_code == 200 and hashlib.sha256(wheel.content).hexdigest() == version["wheel_sha256"]
    assert f"#sha256={version['wheel_sha256']}" in line
    assert client.get("/api/join").json()["crowdtrain"]["install"] == line
    for page in ("/", "/join"):
        html = client.get(page).text
        assert line.replace('"', "&#34;") in html or line.replace('"', "&quot;") in html, page
        assert "/join.ipynb" in html and "/generate.ipynb" in html
    other = client.get("/install/crowdtrain-0.0.1-py3-none-any.whl")
    assert other.status_code == 404 and line in other.json()["detail"]


def test_a_volunteer_of_another_protocol_is_refused_with_the_install_line_and_counted(tmp_path):
    client, store = make_client(tmp_path)
    line = client.get("/api/version").json()["install"]
    same = client.get("/api/join", params=release.this_crowdtrain())
    assert same.status_code == 200 and same.json()["crowdtrain"]["protocol"] == release.PROTOCOL
    other = client.get("/api/join", params={"protocol": release.PROTOCOL + 1, "version": "9.9.9"})
    assert other.status_code == 409, other.text
    assert line in other.json()["detail"] and "9.9.9" in other.json()["detail"]
    # A token request without the protocol (a crowdtrain from before the check) or with another one.
    key = load_identity(tmp_path / "peer.key")
    body = token_request(key.get_public_key().to_bytes(), "alice", key.sign)
    assert client.post("/api/token", json=body).status_code == 200
    for protocol in (None, release.PROTOCOL + 1):
        refused = client.post("/api/token", json={**body, "protocol": protocol} if protocol else
                              {k: v for k, v in body.items() if k != "protocol"})
        assert refused.status_code == 409 and line in refused.json()["detail"], refused.text
    counters = store.counters()
    assert counters["joins_refused_protocol"] == 1 and counters["tokens_refused_protocol"] == 2
    problems = client.get("/api/status").json()["problems"]
    assert any("another protocol" in p and "1 join attempt" in p for p in problems), problems


def test_join_stops_before_any_peer_starts_with_the_coordinators_install_line(tmp_path):
    from crowdtrain.swarm.join_info import check_same_protocol

    install = 'pip install "crowdtrain[volunteer] @ http://h/install/x.whl"'
    check_same_protocol({"crowdtrain": {"protocol": release.PROTOCOL, "install": install}}, "http://h")
    with pytest.raises(ValueError, match="protocol 99") as refused:
        check_same_protocol({"crowdtrain": {"protocol": 99, "install": install}}, "http://h")
    assert install in str(refused.value)
    with pytest.raises(ValueError, match="older crowdtrain"):
        check_same_protocol({"run_id": "r"}, "http://h")  # a coordinator from before protocol numbers


@pytest.mark.parametrize("answer", [409, 200], ids=["refused by the coordinator", "an older coordinator"])
def test_join_of_another_protocol_stops_before_importing_torch(answer):
    """`crowdtrain join` asks the coordinator before torch's import (seconds, a minute on a busy
    machine): a volunteer of another protocol reads the install line at once. A coordinator that
    refuses answers 409; one from before the question answers its join information."""
    import http.server
    import subprocess
    import sys
    import threading

    install = 'pip install "crowdtrain[volunteer] @ http://h/install/x.whl"'
    body = ({"detail": f"this coordinator runs another crowdtrain; install it: {install}"} if answer == 409 else
            {"crowdtrain": {"protocol": release.PROTOCOL + 1, "install": install}})

    class Coordinator(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = json.dumps(body).encode()
            self.send_response(answer)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Coordinator)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        script = ("import sys; from crowdtrain.cli import main; "
                  f"code = main(['join', 'http://127.0.0.1:{server.server_address[1]}']); "
                  "print('torch imported:', 'torch' in sys.modules); sys.exit(code)")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert done.returncode == 2, done.stdout + done.stderr
    assert install in done.stderr and "torch imported: False" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("path", ["/join.ipynb", "/generate.ipynb"])
def test_the_notebooks_are_valid_with_the_coordinators_address_filled_in(tmp_path, path):
    import nbformat

    client, _ = make_client(tmp_path, public_url="http://203.0.113.5:8000")
    answer = client.get(path)
    assert answer.status_code == 200 and "attachment" in answer.headers["content-disposition"]
    notebook = nbformat.reads(answer.text, as_version=4)
    nbformat.validate(notebook)
    code = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    assert 'COORDINATOR = "http://203.0.113.5:8000"' in code
    compile(code.replace("from IPython", "#"), path, "exec")  # every cell parses
