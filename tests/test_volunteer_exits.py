"""A volunteer ends, whatever it waits on: when its DHT or an averager process dies (a crash, the
OOM killer), it stops with an error naming the process; after SIGTERM it is gone within
``join --leave-within`` even when every DHT read hangs (its DHT process frozen with SIGSTOP);
and a DHT read that gets no answer gives up instead of waiting forever
(crowdtrain.swarm.hivemind_seam.records.read_latest, crowdtrain.lifecycle.Deadline/ChildWatch).

Before these, a volunteer whose DHT process was gone stayed up for good, ignoring SIGTERM, its
main thread in hivemind's DHT.get.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from crowdtrain.launch import LocalSwarm

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    # Long epochs: the volunteers below are stopped mid-epoch, before any round.
    swarm = LocalSwarm(tmp_path_factory.mktemp("exits"), swarm={"target_batch_size": 100_000})
    swarm.start_coordinator(timeout=300)
    yield swarm
    swarm.close()


def _training(swarm, name: str, *, extra=(), timeout: float = 240.0) -> dict[str, int]:
    """Start a volunteer; once it trains, its child processes by role (from its log's line)."""
    proc = swarm.join(name, batch_size=8, max_epochs=1000, extra=list(extra))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        log = swarm.log(name)
        found = re.search(r"processes: (.*)", log)
        if found and re.search(r"epoch \d+ \| loss", log):
            return {role.strip(): int(pid) for role, pid in re.findall(r"([\w ]+?) pid (\d+)", found.group(1))}
        time.sleep(0.5)
    pytest.fail(f"{name} did not start training:\n{swarm.log(name)[-3000:]}")


def _exit_within(swarm, name: str, bound_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        code = swarm.procs[name].wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(swarm.procs[name].pid, signal.SIGKILL)
        pytest.fail(f"{name} was still running {bound_s:.0f} s later:\n{swarm.log(name)[-3000:]}")
    return code, time.monotonic() - t0


@pytest.mark.parametrize("role", ["DHT", "gradient averager"])
def test_a_volunteer_whose_dht_or_averager_process_dies_stops_with_an_error_naming_it(swarm, role):
    name = f"loses-{role.split()[0].lower()}"
    children = _training(swarm, name)
    assert role in children, children
    os.kill(children[role], signal.SIGKILL)
    code, took = _exit_within(swarm, name, 60)
    log = swarm.log(name)
    assert code != 0, log[-3000:]
    assert f"this volunteer's {role} process (pid {children[role]}) has stopped: killed by SIGKILL" in log, log[-3000:]
    assert "OOM killer" in log, log[-3000:]
    remaining = [pid for pid in children.values() if os.path.exists(f"/proc/{pid}")
                 and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not remaining, f"processes of {name} outlived it: {remaining}"


def test_sigterm_ends_a_volunteer_within_its_bound_even_when_its_dht_is_frozen(swarm):
    children = _training(swarm, "frozen", extra=["--leave-within", "15"])
    os.kill(children["DHT"], signal.SIGSTOP)  # every DHT call now waits: the hang, without the death
    try:
        time.sleep(1)
        os.kill(swarm.procs["frozen"].pid, signal.SIGTERM)
        code, took = _exit_within(swarm, "frozen", 45)
    finally:
        try:
            os.kill(children["DHT"], signal.SIGCONT)
            os.kill(children["DHT"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = swarm.log("frozen")
    assert took < 15 + 10, f"took {took:.0f} s to exit after SIGTERM with --leave-within 15"
    assert "asked to leave (SIGTERM)" in log or "credited on the leaderboard" in log, log[-3000:]


def test_ctrl_c_ends_a_training_volunteer_cleanly_within_ten_seconds(swarm):
    _training(swarm, "interrupted")
    os.kill(swarm.procs["interrupted"].pid, signal.SIGINT)
    code, took = _exit_within(swarm, "interrupted", 60)
    log = swarm.log("interrupted")
    assert code == 0 and "credited on the leaderboard" in log, log[-3000:]
    assert took < 10, f"Ctrl-C took {took:.1f} s to leave"
    print(f"Ctrl-C to exit: {took:.1f} s")


def test_the_deadline_ends_a_process_blocked_for_good_and_its_forks():
    code = textwrap.dedent("""
        import multiprocessing, threading, time
        from crowdtrain.lifecycle import Deadline
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
        child.start()
        print(child.pid, flush=True)
        Deadline().start("a test's wait", 1.0)
        threading.Event().wait()  # blocked for good, as on a DHT read that never returns
    """)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert done.returncode == 1 and "a test's wait; still not gone at the bound: exiting now" in done.stderr, done
    assert took < 15, took
    child = int(done.stdout.split()[0])
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z", \
        "the fork outlived its parent"


def test_a_dht_read_without_an_answer_gives_up():
    from concurrent.futures import Future

    from crowdtrain.swarm.hivemind_seam.records import progress_records, read_latest

    class Frozen:  # a DHT whose process never answers
        def get(self, key, latest=False, return_future=False):
            assert return_future, "a blocking get would wait forever"
            return Future()

    with pytest.raises(TimeoutError):
        read_latest(Frozen(), "k", timeout_s=0.2)
    tracker = type("T", (), {"dht": Frozen(), "training_progress_key": "k"})()
    from crowdtrain.swarm.hivemind_seam import records
    saved, records.DHT_READ_TIMEOUT_S = records.DHT_READ_TIMEOUT_S, 0.2
    try:
        t0 = time.monotonic()
        assert progress_records(tracker) is None, "no answer: None, as a DHT that does not answer"
    finally:
        records.DHT_READ_TIMEOUT_S = saved
    assert time.monotonic() - t0 < 5
