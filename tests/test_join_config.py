"""`crowdtrain join` against a coordinator that serves a bad run config: one error line naming the
field, a non-zero exit, no traceback and no hang, before any p2p start-up; and a failure after
start-up still ends the process (its hivemind threads are stopped).

The real coordinator app (uvicorn in a thread) serves the run.json under test; the real CLI runs
as a subprocess with a timeout, so a hang fails the test instead of blocking it. Each such
subprocess spends seconds of CPU importing torch, so the ``joins`` fixture starts all the joins
of the selected tests at once, a few at a time, and each test checks its own.
"""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.model.config import get_preset
from crowdtrain.model.info import architecture_fingerprint
from crowdtrain.runspec.swarm import demo_swarm_config
from crowdtrain.swarm.join_info import check_join_info
from crowdtrain.launch import free_port

# A well-formed address of a peer that is not there: nothing may dial it before the config passes.
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
# A peer that hangs fails here. A refusal is mostly torch's import (about 3 s of CPU), stretched
# by the joins running beside it.
TIMEOUT_S = 120
# Joins running at once. Their start-up is CPU-bound, so two per core already keep a 2-core
# machine busy (more only stretches each toward TIMEOUT_S); each holds about 400 MB.
JOINS_AT_ONCE = 4


def good_info(initial_peers=(NOBODY,)) -> dict:
    """run.json as the auxiliary peer writes it for an open run on generated data."""
    model = get_preset("tiny")
    return {"run_id": "t", "fingerprint": architecture_fingerprint(model), "swarm": demo_swarm_config("t").to_dict(),
            "task": {"name": "dalle", "model": model.to_dict(), "data": "pattern"},
            "initial_peers": list(initial_peers), "text_tokenizer": None, "coordinator_peer_id": "Qm"}


def start_coordinator(run: Path, info) -> tuple[str, uvicorn.Server, threading.Thread]:
    """The real app serving ``info`` as its /api/join: its URL, its server and the server's thread."""
    run.mkdir()
    # As the auxiliary peer writes it (the app serves it as it is, but for paths and addresses).
    (run / "run.json").write_text(json.dumps(info))
    port = free_port()
    app = create_app(run, store=Store(default_url(run)), auth=AuthSettings(key_path=run / "coordinator_key.pem"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


def stop_coordinators(started: list[tuple[str, uvicorn.Server, threading.Thread]]) -> None:
    """All told at once, since each takes a fraction of a second to notice."""
    for _, server, _ in started:
        server.should_exit = True
    for _, _, thread in started:
        thread.join(timeout=10)


def join(url: str, *extra: str, code: str | None = None) -> subprocess.CompletedProcess:
    argv = ["join", url, "--host", "127.0.0.1", "--threads", "1", "--batch-size", "4", *extra]
    command = ["-m", "crowdtrain.cli", *argv] if code is None else ["-c", code, *argv]
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", ""
    finally:  # a hung peer, or what it started (the DHT's process, the p2p daemon): the whole group goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        proc.wait()
        raise AssertionError(f"`crowdtrain {' '.join(argv)}` did not exit within {TIMEOUT_S} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith("crowdtrain join: error:")]


def with_(info: dict, path: str, value) -> dict:
    """``info`` with the value at a dotted path replaced (or removed, for ``...``)."""
    info = json.loads(json.dumps(info))
    *parents, key = path.split(".")
    target = info
    for p in parents:
        target = target[p]
    if value is ...:
        del target[key]
    else:
        target[key] = value
    return info


ABSURD = {"text_vocab_size": 2**38}  # a 17-trillion-parameter embedding

BAD_CONFIGS = [
    ("negative lr", lambda i: with_(i, "swarm.lr", -1), "swarm: lr must be > 0"),
    # The coordinator's JSON encoder writes NaN as null (one that writes NaN: the unit test below).
    ("NaN lr", lambda i: with_(i, "swarm.lr", math.nan), "swarm.lr must be a finite number, got None"),
    ("lr as text", lambda i: with_(i, "swarm.lr", "fast"), "swarm.lr must be a finite number, got 'fast'"),
    ("a list", lambda i: [i], "expected a JSON object, got a JSON list"),
    ("no fingerprint", lambda i: with_(i, "fingerprint", ...), "fingerprint is missing"),
    ("no model", lambda i: with_(i, "task.model", ...), "task.model is missing"),
    ("swarm as text", lambda i: with_(i, "swarm", "sync"), "swarm must be a JSON object, got a JSON string"),
    ("bad multiaddr", lambda i: with_(i, "initial_peers", ["/ip4/999.0.0.1/tcp/1"]),
     "initial_peers[0] is not a valid multiaddr"),
    ("no peer id", lambda i: with_(i, "initial_peers", ["/ip4/127.0.0.1/tcp/1"]), "initial_peers[0] has no peer ID"),
    ("absurd model", lambda i: with_(i, "task.model", {**i["task"]["model"], **ABSURD}),
     "task.model has 17,592.19 billion parameters"),
]


# The code run instead of `python -m crowdtrain.cli` where a test injects a fault into the real process.
CLI = "from crowdtrain.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class Join:
    """One `crowdtrain join` of this module: the test that checks it, the case's name there, the
    run.json its coordinator serves (None: ``good_info`` listing a live bootstrap peer), its extra
    arguments, and ``code`` to run instead of the CLI module (a fault injected in the real process)."""
    test: str
    label: str
    info: Callable[[], dict] | None
    args: tuple[str, ...] = ()
    code: str | None = None


JOINS = [  # the longest first: it starts a DHT and a p2p daemon before it fails
    Join("test_a_failure_after_start_up_stops_the_hivemind_threads_and_exits", "LAMB refuses the lr", None, code=(
        "import sys; import crowdtrain.swarm.optimizer as o\n"
        "def refuse(*args, **kwargs): raise ValueError('Invalid learning rate: -1')\n"
        "o.make_lamb = refuse\n" + CLI)),
    *(Join("test_a_bad_run_config_ends_join_with_one_line_naming_the_field", name,
           lambda broken=broken: broken(good_info())) for name, broken, _ in BAD_CONFIGS),
    *(Join("test_a_bad_model_override_is_refused_the_same_way", override, good_info, ("--model", override))
      for override in ("width=-3", 'width="wide"')),
    Join("test_what_this_machine_cannot_train_ends_join_before_any_p2p_start_up", "too little memory", good_info,
         ("--batch-size", "auto"), code=(
             "import sys; import crowdtrain.swarm.machine as m\n"
             "m.free_memory = lambda device: (2**20, 'of available RAM')\n" + CLI)),
    Join("test_what_this_machine_cannot_train_ends_join_before_any_p2p_start_up", "fp16 without a GPU", good_info,
         ("--device", "auto", "--precision", "fp16"), code=(
             "import sys; import torch; torch.cuda.is_available = lambda: False\n" + CLI)),
]
# Enough for every test to wait for its join behind the others, each of them hanging until killed.
JOINS_TIMEOUT_S = TIMEOUT_S * -(-len(JOINS) // JOINS_AT_ONCE) + 60


def checked_by(item, join_: Join) -> bool:
    """Whether the selected test ``item`` checks ``join_``."""
    params = getattr(item, "callspec", None)
    return (item.path == Path(__file__) and item.originalname == join_.test
            and (params is None or params.params.get("name") == join_.label))


@pytest.fixture(scope="module")
def joins(request, tmp_path_factory) -> dict[tuple[str, str], tuple[str, Future]]:
    """Starts the joins that the selected tests check (all of JOINS in a full run), each against
    the real app serving its run.json, and gives for ``(test, label)``: (the coordinator's URL, the
    join's CompletedProcess to come)."""
    selected = [j for j in JOINS if any(checked_by(item, j) for item in request.session.items)]
    with contextlib.ExitStack() as stack:
        peers: list[str] = []  # the bootstrap peer's addresses, where a join needs one
        if any(j.info is None for j in selected):
            import hivemind

            bootstrap = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            stack.callback(bootstrap.shutdown)
            peers = [str(m) for m in bootstrap.get_visible_maddrs()]
        served = {(j.test, j.label): json.dumps(good_info(initial_peers=peers) if j.info is None else j.info())
                  for j in selected}
        coordinators = {}  # run.json -> the coordinator serving it (one for the joins that share one)
        stack.callback(lambda: stop_coordinators(list(coordinators.values())))
        for info in served.values():
            if info not in coordinators:
                coordinators[info] = start_coordinator(tmp_path_factory.mktemp("run") / "run", json.loads(info))
        pool = ThreadPoolExecutor(JOINS_AT_ONCE)
        # Runs first on the way out: what runs ends within TIMEOUT_S (what waits is dropped where
        # a test was interrupted), then the servers and the bootstrap peer stop.
        stack.callback(pool.shutdown, cancel_futures=True)
        started = {}
        for j in selected:
            url = coordinators[served[j.test, j.label]][0]
            started[j.test, j.label] = url, pool.submit(join, url, *j.args, code=j.code)
        yield started


@pytest.fixture
def joined(request, joins) -> Callable[[str], tuple[str, subprocess.CompletedProcess]]:
    """This test's join named ``label``, once it has ended: (the coordinator's URL, its CompletedProcess)."""
    def result(label: str) -> tuple[str, subprocess.CompletedProcess]:
        url, future = joins[request.node.originalname, label]
        return url, future.result()

    return result


@pytest.mark.timeout(JOINS_TIMEOUT_S)
@pytest.mark.parametrize("name,message", [(c[0], c[2]) for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_run_config_ends_join_with_one_line_naming_the_field(joined, name, message):
    url, out = joined(name)  # `crowdtrain join` against the real app serving broken(good_info()) (JOINS)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and message in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
    if name == "absurd model":
        assert "GiB" in lines[0] and "smaller model" in lines[0] and f"{url}/memcalc/" in lines[0]


@pytest.mark.timeout(JOINS_TIMEOUT_S)
def test_a_bad_model_override_is_refused_the_same_way(joined):
    _, out = joined("width=-3")  # good_info(), `--model width=-3`
    assert out.returncode == 2 and len(error_lines(out)) == 1, out.stderr[-3000:]
    assert "task.model: model.width must be positive" in error_lines(out)[0]
    _, out = joined('width="wide"')
    assert out.returncode == 2 and "task.model.width must be an integer" in error_lines(out)[0], out.stderr[-3000:]


def test_the_config_checks_accept_what_a_real_coordinator_serves_and_size_the_model():
    checked = check_join_info(good_info(), source="http://c", ram_bytes=2**30)
    assert checked.swarm == demo_swarm_config("t") and checked.model == get_preset("tiny")
    assert checked.params == 286400, "presets.json's count of the tiny preset"
    for value in (math.nan, math.inf, -math.inf, 0.0, -1, True):  # Python's json reads NaN and Infinity
        with pytest.raises(ValueError, match="the run config from http://c: swarm"):
            check_join_info(with_(good_info(), "swarm.lr", value), source="http://c")
    # 2**22 text tokens of width 64: 269M parameters, 2.0 GiB of fp32 parameters and gradients.
    with pytest.raises(ValueError, match=r"0\.27 billion parameters: .* at least 2\.0 GiB .* this machine has 1\.0 GiB"):
        check_join_info(good_info(), source="http://c", ram_bytes=2**30, model_overrides={"text_vocab_size": 2**22})
    assert check_join_info(good_info(), ram_bytes=2**30, model_overrides={"text_vocab_size": 2**20}).params > 6e7


def test_on_a_gpu_the_model_must_fit_the_gpus_memory_not_the_machines(monkeypatch):
    import types

    import torch

    from crowdtrain.swarm.join_info import device_memory, machine_ram_bytes

    assert device_memory("cpu") == (machine_ram_bytes(), "this machine")
    # A 4 GiB GPU in a machine with far more RAM (the model lives on the GPU).
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=4 * 2**30, name=f"Small GPU {i}"))
    assert device_memory("cuda") == (4 * 2**30, "this GPU (Small GPU 0)")
    assert device_memory("cuda:1") == (4 * 2**30, "this GPU (Small GPU 1)")
    # 2**23 text tokens of width 64: 537M parameters, 4.0 GiB of fp32 parameters and gradients.
    with pytest.raises(ValueError, match=r"this GPU \(Small GPU 0\) has 4\.0 GiB.*or use a GPU with more memory"):
        check_join_info(good_info(), source="http://c", device="cuda", model_overrides={"text_vocab_size": 2**23})
    assert check_join_info(good_info(), source="http://c", device="cpu",
                           model_overrides={"text_vocab_size": 2**23}).params > 5e8  # the 24 GiB machine


@pytest.mark.timeout(JOINS_TIMEOUT_S)
def test_a_failure_after_start_up_stops_the_hivemind_threads_and_exits(joined):
    """The optimizer refusing a setting after the DHT and the progress tracker have started (as
    torch refused lr=-1 before the config was checked): the peer must still exit, not hang on
    the tracker's thread. The refusal is injected where torch raised it (JOINS); the run lists a
    live bootstrap peer, so the DHT starts."""
    _, out = joined("LAMB refuses the lr")
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out) == ["crowdtrain join: error: Invalid learning rate: -1"], out.stderr[-3000:]


@pytest.mark.timeout(JOINS_TIMEOUT_S)
def test_what_this_machine_cannot_train_ends_join_before_any_p2p_start_up(joined):
    """`--batch-size auto` on too little memory, and fp16 where `--device auto` finds no GPU: one
    line naming the fix, before the DHT starts (crowdtrain.swarm.machine). Both faults are
    injected in the real process (JOINS)."""
    url, out = joined("too little memory")
    assert out.returncode == 2, out.stderr[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and "to train at batch size 1" in lines[0] and "smaller model" in lines[0] \
        and f"{url}/memcalc/" in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
    _, out = joined("fp16 without a GPU")
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out) == ["crowdtrain join: error: fp16 autocast needs a GPU; use --precision bf16 or fp32 "
                                "on CPU"], out.stderr[-3000:]
    assert "training on the CPU: " in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
