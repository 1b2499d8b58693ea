"""`crowdtrain join` against a coordinator that serves a bad run config: one error line naming the
field, a non-zero exit, no traceback and no hang, before any p2p start-up; and a failure after
start-up still ends the process (its hivemind threads are stopped).

The real coordinator app (uvicorn in a thread) serves the run.json under test; the real CLI runs
as a subprocess with a timeout, so a hang fails the test instead of blocking it.
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

import pytest

from crowdtrain.coordinator.db import Store, default_url
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.model.config import get_preset
from crowdtrain.model.info import architecture_fingerprint
from crowdtrain.runspec.swarm import demo_swarm_config
from crowdtrain.swarm.join_info import check_join_info
from crowdtrain.launch import free_port

# A well-formed address of a peer that is not there: nothing may dial it before the config passes.
NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
TIMEOUT_S = 120  # a peer that hangs fails here; a refusal takes a few seconds (torch's import)


def good_info(initial_peers=(NOBODY,)) -> dict:
    """run.json as the auxiliary peer writes it for an open run on generated data."""
    model = get_preset("tiny")
    return {"run_id": "t", "fingerprint": architecture_fingerprint(model), "swarm": demo_swarm_config("t").to_dict(),
            "task": {"name": "dalle", "model": model.to_dict(), "data": "pattern"},
            "initial_peers": list(initial_peers), "text_tokenizer": None, "coordinator_peer_id": "Qm"}


@pytest.fixture
def coordinator(tmp_path):
    """Serve ``coordinator.info`` (set by the test) as the real app's /api/join."""
    import uvicorn

    run = tmp_path / "run"
    run.mkdir()

    class Coordinator:
        url = f"http://127.0.0.1:{free_port()}"

        @staticmethod
        def serve(info) -> None:
            # As the auxiliary peer writes it (the app serves it as it is, but for paths and addresses).
            (run / "run.json").write_text(json.dumps(info))

    app = create_app(run, store=Store(default_url(run)), auth=AuthSettings(key_path=run / "coordinator_key.pem"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(Coordinator.url.rsplit(":", 1)[1]),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield Coordinator
    finally:
        server.should_exit = True
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


@pytest.mark.timeout(4 * TIMEOUT_S)
@pytest.mark.parametrize("name,broken,message", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_run_config_ends_join_with_one_line_naming_the_field(coordinator, name, broken, message):
    coordinator.serve(broken(good_info()))
    out = join(coordinator.url)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and message in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
    if name == "absurd model":
        assert "GiB" in lines[0] and "smaller model" in lines[0] and f"{coordinator.url}/memcalc/" in lines[0]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_bad_model_override_is_refused_the_same_way(coordinator):
    coordinator.serve(good_info())
    out = join(coordinator.url, "--model", "width=-3")
    assert out.returncode == 2 and len(error_lines(out)) == 1, out.stderr[-3000:]
    assert "task.model: model.width must be positive" in error_lines(out)[0]
    out = join(coordinator.url, "--model", 'width="wide"')
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


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_failure_after_start_up_stops_the_hivemind_threads_and_exits(coordinator):
    """The optimizer refusing a setting after the DHT and the progress tracker have started (as
    torch refused lr=-1 before the config was checked): the peer must still exit, not hang on
    the tracker's thread. The refusal is injected where torch raised it."""
    import hivemind

    bootstrap = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        coordinator.serve(good_info(initial_peers=[str(m) for m in bootstrap.get_visible_maddrs()]))
        code = ("import sys; import crowdtrain.swarm.optimizer as o\n"
                "def refuse(*args, **kwargs): raise ValueError('Invalid learning rate: -1')\n"
                "o.make_lamb = refuse\n"
                "from crowdtrain.cli import main; sys.exit(main(sys.argv[1:]))")
        out = join(coordinator.url, code=code)
    finally:
        bootstrap.shutdown()
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out) == ["crowdtrain join: error: Invalid learning rate: -1"], out.stderr[-3000:]


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_what_this_machine_cannot_train_ends_join_before_any_p2p_start_up(coordinator):
    """`--batch-size auto` on too little memory, and fp16 where `--device auto` finds no GPU: one
    line naming the fix, before the DHT starts (crowdtrain.swarm.machine)."""
    coordinator.serve(good_info())
    run = "from crowdtrain.cli import main; sys.exit(main(sys.argv[1:]))"
    out = join(coordinator.url, "--batch-size", "auto", code=(
        "import sys; import crowdtrain.swarm.machine as m\n"
        "m.free_memory = lambda device: (2**20, 'of available RAM')\n" + run))
    assert out.returncode == 2, out.stderr[-3000:]
    lines = error_lines(out)
    assert len(lines) == 1 and "to train at batch size 1" in lines[0] and "smaller model" in lines[0] \
        and f"{coordinator.url}/memcalc/" in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
    out = join(coordinator.url, "--device", "auto", "--precision", "fp16", code=(
        "import sys; import torch; torch.cuda.is_available = lambda: False\n" + run))
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out) == ["crowdtrain join: error: fp16 autocast needs a GPU; use --precision bf16 or fp32 "
                                "on CPU"], out.stderr[-3000:]
    assert "training on the CPU: " in out.stderr and "DHT" not in out.stderr, out.stderr[-3000:]
