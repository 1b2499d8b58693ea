"""A volunteer from zero, as one would do it: a fresh Python with pip, the install line a real
coordinator shows, `crowdtrain join`; and the coordinator's two notebooks on a real Jupyter
kernel (nbclient) in that same fresh environment.

The coordinator is deployed as docs/organize-a-run.md says for the Internet: on 127.0.0.1 behind
a real Caddy that serves HTTPS (its internal CA here, which the volunteer's machine trusts through
``SSL_CERT_FILE`` and ``PIP_CERT``; a public certificate on a real domain), with
``--public-url`` and ``--trusted-proxy``. Everything a volunteer does goes through it.

The environment has torch first, as a notebook or GPU machine has it: this machine's (the pinned
CPU build), installed outside the venv where pip sees it but does not own it, as a notebook
image's is; then only what the install line brings.
Packages come from the machine's pip index and cache. The steps are the benchmark's
(benchmarks/bench_volunteer_from_zero.py), so what is timed there is what is tested here.
"""

import importlib.util
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from crowdtrain.launch import LocalSwarm, get_json
from crowdtrain.release import PROTOCOL
from crowdtrain.runspec.tokens import CoordinatorKey
from crowdtrain.runspec.trust import fingerprint
from tests.tls_servers import Caddy, network_address

pytestmark = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "bench_volunteer_from_zero", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_volunteer_from_zero.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# What joining must not install: the coordinator's web stack, database drivers, the browser
# driver, plotting, and the CLIP re-ranker's transformers.
NOT_FOR_VOLUNTEERS = {"fastapi", "uvicorn", "sqlalchemy", "psycopg", "playwright", "matplotlib", "transformers",
                      "plotly", "psycopg-binary", "swagger-ui-py"}


@pytest.fixture(scope="module")
def python_with_torch(tmp_path_factory):
    """A virtual environment with pip, and torch preinstalled outside it as a notebook image has it
    (``bench.fresh_python``; the benchmark times a real ``pip install`` of torch instead)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    timings = bench.fresh_python(venv, torch="preinstalled")
    return {"venv": venv, "timings": timings, "before": bench.installed(venv)}


def system_roots() -> str:
    """The CA bundle this machine's clients use now (pip's package index is verified with it)."""
    import ssl

    import certifi

    for candidate in (os.environ.get("REQUESTS_CA_BUNDLE"), os.environ.get("PIP_CERT"),
                      os.environ.get("SSL_CERT_FILE"), ssl.get_default_verify_paths().cafile, certifi.where()):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("no CA bundle on this machine")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, python_with_torch):
    from crowdtrain.data import ensure_demo_shards

    tmp = tmp_path_factory.mktemp("zero")
    # The bundled shapes, 2,000 of them: `--data shapes` makes 50,000 once per machine (minutes on
    # a fresh 2-core one, past the coordinator's start-up wait), and a few minutes of training
    # see fewer. A run that goes on while the module runs.
    shards = ensure_demo_shards(tmp / "shapes", num_train=2000)
    # Epochs of 96 samples: a newcomer is credited at the end of the epoch its samples went into,
    # and the notebooks' volunteer, starved beside the lane's runs, adds few (384 at this pace are
    # epochs of up to a minute, which a notebook then waits out). A checkpoint every 4 epochs, for
    # the drawing notebook.
    swarm = LocalSwarm(tmp, data=str(shards), swarm={"total_epochs": 100_000, "target_batch_size": 96,
                                                     "checkpoint_every_epochs": 4})
    caddy = Caddy(tmp / "caddy", upstream=swarm.port)
    swarm.url = caddy.url
    # What the volunteer's machine trusts: the roots it has (the package index's among them) and the
    # proxy's CA (a real deployment's certificate chains to the usual roots: nothing to set).
    bundle = tmp / "trusted.pem"
    bundle.write_text(Path(system_roots()).read_text() + caddy.root_ca.read_text())
    # pip's requests takes REQUESTS_CA_BUNDLE over PIP_CERT where both are set (as on this machine).
    trusted = {k: str(bundle) for k in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE")}
    saved = {k: os.environ.get(k) for k in trusted}
    os.environ.update(trusted)  # the kernels' and the fresh venv's too
    swarm.env.update(trusted)
    swarm.start_coordinator(extra=["--public-url", caddy.url, "--trusted-proxy", "127.0.0.1"])
    swarm.pin = fingerprint(CoordinatorKey.load_or_create(swarm.run_dir / "coordinator_key.pem").public_key)
    # At a slow device's pace (steps padded to 1 s): the run lasts the whole module, and its peer
    # is there to serve the state and average with the newcomers, not to train; at full speed it
    # would take half a core from the fresh volunteer and the notebooks' kernels (a fifth at 0.25 s).
    # Alone it ends an epoch every 12 s.
    swarm.join("first", batch_size=8, max_epochs=100_000, extra=["--simulated-step-s", "1.0"])
    yield swarm
    swarm.close()
    caddy.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def fresh(python_with_torch, swarm):
    """A virtual environment with pip and torch, then the coordinator's install line."""
    venv, timings = python_with_torch["venv"], dict(python_with_torch["timings"])
    line = get_json(f"{swarm.url}/api/version")["install"]
    timings["install_s"] = bench.run_install_line(venv, line, byte_compile=False)
    return {"venv": venv, "before": python_with_torch["before"], "after": bench.installed(venv), "timings": timings,
            "line": line}


def test_the_install_line_brings_the_coordinators_crowdtrain_keeps_torch_and_nothing_more(swarm, fresh):
    assert fresh["line"].startswith(f'pip install "crowdtrain[volunteer] @ {swarm.url}/install/'), fresh["line"]
    after = fresh["after"]
    version = get_json(f"{swarm.url}/api/version")["version"]
    assert after["crowdtrain"] == version, "pip must install the coordinator's own build"
    assert after["torch"] == fresh["before"]["torch"], "the installed torch (a notebook's CUDA build) must be kept"
    assert not list(bench.site_packages(fresh["venv"]).glob("torch-*")), "pip put a second torch into the venv"
    assert {"hivemind", "bitsandbytes", "datasets"} <= set(after)
    assert not NOT_FOR_VOLUNTEERS & set(after), f"joining does not need {NOT_FOR_VOLUNTEERS & set(after)}"
    print("fresh volunteer set-up (s):", {k: round(v, 1) for k, v in fresh["timings"].items()})


def test_a_fresh_volunteer_joins_and_is_credited(swarm, fresh, tmp_path):
    summary = tmp_path / "summary.json"
    seconds, proc = bench.join_until_first_step(fresh["venv"], swarm.url, user="fresh", log=tmp_path / "fresh.log",
                                                extra=["--batch-size", "8", "--summary-file", str(summary),
                                                       "--pin", swarm.pin])
    # Trains with the swarm until the run credits it: the coordinator's auxiliary peer credits the
    # round records at its next refresh, which a checkpoint (a download, the validation loss) can
    # hold for several seconds on a busy machine.
    deadline = time.monotonic() + 120
    while (board := {row["user"]: row["samples"] for row in get_json(f"{swarm.url}/api/leaderboard")}).get(
            "fresh", 0) <= 0 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1)
    assert bench.leave(proc) == 0, (tmp_path / "fresh.log").read_text()[-3000:]
    assert board.get("fresh", 0) > 0, board
    result = json.loads(summary.read_text())
    assert result["credited_samples"] > 0, result
    print(f"fresh volunteer: first step {seconds:.1f} s after `crowdtrain join`")


def test_behind_caddy_the_coordinator_counts_each_client_by_its_own_address_whatever_it_claims(swarm):
    """``--trusted-proxy 127.0.0.1``: the coordinator takes the client's address from Caddy's
    X-Forwarded-For, so volunteers behind one proxy do not share one rate-limit budget, and a
    client that sends its own X-Forwarded-For (Caddy replaces it for a client it does not trust)
    cannot spread its token requests over addresses it makes up. The client connects from this
    machine's network address, not loopback, to be told apart from the proxy."""
    import http.client
    import socket
    import ssl

    address = network_address()
    port = int(swarm.url.rsplit(":", 1)[1])
    context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])

    class FromAddress(http.client.HTTPSConnection):
        def connect(self):  # to 127.0.0.1 (the certificate's name is localhost), from the network address
            sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(address, 0))
            self.sock = context.wrap_socket(sock, server_hostname="localhost")

    connection = FromAddress("localhost", port, context=context)
    codes, detail = [], ""
    budget = 120  # crowdtrain coordinator --token-requests-per-minute's default
    for i in range(budget + 5):
        connection.request("POST", "/api/token", body=json.dumps({"public_key": "not a key"}),
                           headers={"Content-Type": "application/json", "X-Forwarded-For": f"203.0.113.{i % 250}"})
        answer = connection.getresponse()
        body = answer.read()
        codes.append(answer.status)
        if answer.status == 429:
            detail = json.loads(body)["detail"]
            break
    connection.close()
    assert codes[-1] == 429 and len(codes) == budget + 1, \
        f"made-up X-Forwarded-For addresses spread the requests over several budgets: {codes}"
    assert f"from {address}" in detail, f"the coordinator did not see the client's own address: {detail!r}"


def test_a_volunteer_of_another_protocol_stops_at_once_with_the_install_line(swarm, fresh, tmp_path):
    before = get_json(f"{swarm.url}/api/counters").get("joins_refused_protocol", 0)
    other = f"import sys, crowdtrain.release as r; r.PROTOCOL = {PROTOCOL + 1}; from crowdtrain.cli import main; " \
            f"sys.exit(main(['join', '{swarm.url}']))"
    start = time.monotonic()
    done = subprocess.run([str(fresh["venv"] / "bin" / "python"), "-c", other], capture_output=True, text=True,
                          timeout=120, env=bench._env(fresh["venv"]), cwd=fresh["venv"])
    assert done.returncode == 2, done.stdout + done.stderr
    assert fresh["line"] in done.stderr, done.stderr
    # Refused before the DHT: no p2p identity, no hivemind log line.
    assert "identity" not in done.stderr and "hivemind" not in done.stderr, done.stderr
    # Before torch's import, too: a busy machine's minute of imports is not waited on.
    assert time.monotonic() - start < 60, f"refused after {time.monotonic() - start:.0f} s"
    assert get_json(f"{swarm.url}/api/counters")["joins_refused_protocol"] == before + 1
    assert any("another protocol" in p for p in get_json(f"{swarm.url}/api/status")["problems"])


@pytest.fixture(scope="module")
def jupyter_path(fresh, tmp_path_factory) -> Path:
    """A folder for ``JUPYTER_PATH`` with one kernel, "fresh": the fresh environment's Python,
    with this interpreter's ipykernel seen from outside it as its torch is (a notebook image has
    both in its system's packages; a pip install of ipykernel here took half a minute)."""
    venv = fresh["venv"]
    bench.link_preinstalled("ipykernel", venv, venv.parent / f"{venv.name}-preinstalled")
    path = tmp_path_factory.mktemp("jupyter")
    spec = path / "kernels" / "fresh"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(fresh["venv"] / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh volunteer", "language": "python", "env": {"PYTHONPATH": ""}}))
    return path


def _kernel(jupyter_path: Path, monkeypatch) -> str:
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    return "fresh"


def _notebook(swarm, path: str, settings: dict):
    import nbformat

    with urllib.request.urlopen(f"{swarm.url}{path}", timeout=30) as answer:
        notebook = nbformat.reads(answer.read().decode(), as_version=4)
    cell = next(c for c in notebook.cells if c.cell_type == "code" and c.source.startswith("COORDINATOR"))
    for name, value in settings.items():  # as a user edits the first cell
        lines = [f"{name} = {value!r}" if line.startswith(f"{name} =") else line for line in cell.source.splitlines()]
        cell.source = "\n".join(lines)
    return notebook


def _outputs(cell) -> str:
    return "\n".join(o.get("text", "") or json.dumps(o.get("data", {})) for o in cell.outputs)


def test_the_join_notebook_trains_on_a_real_kernel_and_leaves_cleanly_when_interrupted(swarm, fresh, jupyter_path,
                                                                                   tmp_path, monkeypatch):
    from nbclient import NotebookClient

    kernel = _kernel(jupyter_path, monkeypatch)
    notebook = _notebook(swarm, "/join.ipynb", {"USER": "notebook", "MINUTES": 4})
    assert f'PIN = "{swarm.pin}"' in notebook.cells[1].source  # what it checks the install and the run against
    client = NotebookClient(notebook, kernel_name=kernel, timeout=400, allow_errors=False)
    credited = threading.Event()

    def interrupt_once_credited():
        # As a volunteer stops the kernel: once the run counts this notebook's samples.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not credited.is_set():
            board = {row["user"]: row["samples"] for row in get_json(f"{swarm.url}/api/leaderboard")}
            if board.get("notebook", 0) > 0:
                credited.set()
                time.sleep(2)
                # What Jupyter's "interrupt" does to a local kernel: SIGINT to its process group.
                os.killpg(os.getpgid(client.km.provisioner.pid), signal.SIGINT)
                return
            time.sleep(1)

    watcher = threading.Thread(target=interrupt_once_credited, daemon=True)
    watcher.start()
    client.execute(cwd=str(tmp_path))
    watcher.join(5)
    assert credited.is_set(), "the notebook's volunteer was never credited"
    settings, install, device, train = [_outputs(c) for c in notebook.cells if c.cell_type == "code"]
    assert f"the run's is {get_json(f'{swarm.url}/api/version')['version']}" in install
    assert "cpu" in device.lower() and "batch size" in device.lower(), device
    assert "leaving the run cleanly" in train and "exited with code 0" in train, train[-3000:]
    contributed = [line for line in train.splitlines() if line.startswith("you contributed")]
    assert contributed and int(contributed[0].split()[2]) > 0, train[-2000:]


def test_the_generate_notebook_draws_the_runs_prompts_from_the_latest_checkpoint(swarm, jupyter_path, tmp_path,
                                                                               monkeypatch):
    from nbclient import NotebookClient

    deadline = time.monotonic() + 120
    while not get_json(f"{swarm.url}/api/checkpoints") and time.monotonic() < deadline:
        time.sleep(2)
    kernel = _kernel(jupyter_path, monkeypatch)
    notebook = _notebook(swarm, "/generate.ipynb", {"SAMPLES": 2, "KEEP": 1})
    NotebookClient(notebook, kernel_name=kernel, timeout=400, allow_errors=False).execute(cwd=str(tmp_path))
    last = [c for c in notebook.cells if c.cell_type == "code"][-1]
    assert any("image/png" in o.get("data", {}) for o in last.outputs), _outputs(last)[:2000]
    prompts = [p["prompt"] for p in get_json(f"{swarm.url}/api/prompts")]
    assert prompts and f"{len(prompts)} prompts" in _outputs(last)
    from PIL import Image

    grid = Image.open(tmp_path / "crowdtrain-samples.png")
    assert grid.height >= len(prompts) * 16, grid.size  # a row per prompt
