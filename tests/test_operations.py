"""Operating mistakes, with real processes on 127.0.0.1: a second coordinator started on a live
run's ports, a volunteer joining at an address where no coordinator listens. Each must be told at
once, in words that name the port, and must leave the live run alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crowdtrain.launch import free_port, get_json
from tests.swarm_harness import process_group, wait_for_groups_to_end

pytestmark = pytest.mark.timeout(240)
# Python start-up and the coordinator's imports on a busy 2-core machine; the clash used to show
# only when uvicorn bound its port, about 40 s in (and a clash on the DHT port alone, never).
REFUSED_WITHIN_S = 20.0


def crowdtrain(args: list[str], *, timeout_s: float, env: dict) -> tuple[int | None, str, float]:
    """Run `crowdtrain ARGS` as a process group; (exit code or None if still running at the
    timeout, its output, seconds it ran). Whatever it started is killed in the end."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, time.monotonic() - started
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - started


def test_a_second_coordinator_on_a_live_runs_ports_is_refused_at_once_and_leaves_the_run_alone(swarm_factory,
                                                                                               tmp_path):
    live = swarm_factory()
    live.start_coordinator()
    run_dir = live.run_dir
    aux_pid = int((run_dir / "aux.pid").read_text())
    keys = {name: (run_dir / name).read_bytes() for name in ("identity.key", "coordinator_key.pem")}
    spec = (run_dir / "coordinator.json").read_text()

    def second(folder: Path, port: int, dht_port: int):
        return crowdtrain(["coordinator", "--run-id", "second", "--preset", "tiny", "--data", "pattern",
                           "--host", "127.0.0.1", "--port", str(port), "--dht-host", "127.0.0.1",
                           "--dht-port", str(dht_port), "--run-dir", str(folder), "--swarm-preset", "demo"],
                          timeout_s=60, env=live.env)

    cases = {  # folder, HTTP port, DHT port, what the message must name
        "another run on both ports": (tmp_path / "second", live.port, live.dht_port,
                                      [f"HTTP port {live.port}", "run 'test'", "/api/join",
                                       f"DHT port {live.dht_port}"]),
        "the live run's own folder": (run_dir, live.port, live.dht_port, [f"HTTP port {live.port}", "run 'test'"]),
        # Only the DHT port: hivemind's daemon would share it (SO_REUSEPORT) and the start would succeed.
        "the DHT port alone": (tmp_path / "third", free_port(), live.dht_port,
                               [f"DHT port {live.dht_port}", "crowdtrain.auxpeer", str(run_dir)]),
    }
    for case, (folder, port, dht_port, named) in cases.items():
        code, out, took = second(folder, port, dht_port)
        assert code == 2 and took < REFUSED_WITHIN_S, (case, code, took, out[-3000:])
        assert "refusing to start: nothing of this run was created" in out and "pass --" in out, (case, out)
        for words in named:
            assert words in out, (case, words, out)
        assert "is up" not in out, (case, out)
        if folder != run_dir:
            assert not folder.exists(), f"{case}: the refused coordinator left {sorted(folder.rglob('*'))}"
        # The live run is untouched: same auxiliary peer, keys and spec, and it still answers.
        assert int((run_dir / "aux.pid").read_text()) == aux_pid and Path(f"/proc/{aux_pid}").exists(), case
        assert {name: (run_dir / name).read_bytes() for name in keys} == keys, case
        assert (run_dir / "coordinator.json").read_text() == spec, case
        assert live.status()["run_id"] == "test", case
        assert get_json(f"{live.url}/api/join")["run_id"] == "test", case
    assert live.procs["coordinator"].poll() is None, live.log("coordinator")[-3000:]


def test_one_port_for_both_http_and_the_dht_is_refused_with_the_flags_to_change(tmp_path):
    from crowdtrain.coordinator.run import CoordinatorConfig

    with pytest.raises(ValueError, match="--port and --dht-port are both 8123"):
        CoordinatorConfig(port=8123, dht_port=8123, run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_crashed_coordinator_restarts_on_its_ports_while_its_auxiliary_peer_still_holds_the_dht_port(
        swarm_factory):
    """The port check must not lock a run out of its own ports: an auxiliary peer that outlives its
    coordinator (it is stopped or hung, so the SIGTERM its coordinator's death sends it does not
    end it; or it is still leaving) holds the DHT port with its p2p daemon, and the restart ends it."""
    swarm = swarm_factory()
    first = swarm.start_coordinator()
    crashed = swarm.procs["coordinator"]
    aux_pid = int((swarm.run_dir / "aux.pid").read_text())
    try:
        os.kill(aux_pid, signal.SIGSTOP)
        os.kill(crashed.pid, signal.SIGKILL)  # the coordinator alone, as a crash would
        crashed.wait(timeout=10)
        assert Path(f"/proc/{aux_pid}").exists(), "the stopped auxiliary peer should outlive its coordinator"
        restarted = swarm.start_coordinator()
        assert restarted["coordinator_peer_id"] == first["coordinator_peer_id"]
        assert "ending the auxiliary peer left over" in swarm.log("coordinator")
        assert "refusing to start" not in swarm.log("coordinator")
        assert int((swarm.run_dir / "aux.pid").read_text()) != aux_pid
    finally:
        # The swarm cleans up the new coordinator's process group; the crashed one's, where the
        # left-over auxiliary peer lives if the restart did not end it, is this test's to end.
        try:
            os.killpg(crashed.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_joining_a_port_where_no_coordinator_listens_says_so_on_the_first_line():
    """A typo'd port used to give two minutes of 'coordinator not answering ... retrying' lines
    before any hint. The first line must say it; the retries go on (the coordinator may be starting)."""
    port = free_port()  # nobody listens here: connections are refused
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", "join", f"http://127.0.0.1:{port}",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines = []
    try:
        # Python and torch imports take a few seconds on a busy 2-core machine; the first retry's
        # line comes 1 s after the first try, so seeing it means the first try is over.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("retrying in" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert proc.poll() is None, "join should keep retrying, not give up:\n" + "".join(lines)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    ours = [line for line in lines if "crowdtrain" in line]
    assert ours, "".join(lines)
    assert f"no coordinator is listening at 127.0.0.1:{port}" in ours[0], "".join(lines)
    assert "check the address" in ours[0], "".join(lines)
    assert any("retrying in" in line for line in ours[1:]), "".join(lines)


@pytest.mark.timeout(240)
def test_a_coordinator_ends_its_auxiliary_peer_on_sigint_sighup_and_its_own_sigkill(swarm_factory, tmp_path):
    """The other ways a coordinator is stopped (Ctrl-C, a closed terminal, the OOM killer), three
    runs at once; SIGTERM is in the churn run (tests/test_swarm.py)."""
    swarms = {sig: swarm_factory() for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGKILL)}
    for sig, swarm in swarms.items():
        swarm.tmp = tmp_path / sig.name
        swarm.tmp.mkdir()
        swarm.run_dir = swarm.tmp / "run"
        swarm.start_coordinator(wait=False)  # three start-ups at once: each mostly waits on imports
    for swarm in swarms.values():
        swarm.coordinator_info()
    top = {sig: swarm.procs["coordinator"].pid for sig, swarm in swarms.items()}
    for sig, pid in top.items():
        assert any("crowdtrain.auxpeer" in c for c in process_group(pid).values()), process_group(pid)
        os.kill(pid, sig)
    wait_for_groups_to_end({sig.name: pid for sig, pid in top.items()}, 90)
