"""A coordinator outage with real processes: the volunteers ride it out and come back to it.

The coordinator serves the run's data shards over HTTP, so while it is down every shard fetch
fails. The data set here is small (300 rows in two shards) so that each peer starts a new pass
over it, and fetches the shards again, every few seconds: the outage certainly hits fetches, and
the test checks the peers' logs to be sure it did.
"""

import re
import signal
import time

import pytest

OUTAGE_S = 25.0
STEP_LINE = re.compile(r"epoch (\d+) \| loss [\d.]+ \| .* peers in last round (\d+)/\d+")


def _steps(text: str) -> list[tuple[int, int]]:
    """(epoch, peers in the last round) of each step line in a volunteer's log."""
    return [(int(m[1]), int(m[2])) for m in STEP_LINE.finditer(text)]


@pytest.mark.timeout(420)
def test_volunteers_ride_out_a_coordinator_outage_and_reconnect(swarm_factory, tmp_path):
    from crowdtrain.data import ensure_demo_shards

    shards = ensure_demo_shards(tmp_path / "shapes", num_train=300)
    # total_epochs: the volunteers train until the test stops them, never to the run's last epoch.
    swarm = swarm_factory(data=str(shards), swarm={"total_epochs": 100_000})
    # tiny, with the shapes tokenizer's codes
    shapes_model = ["--model", "image_vocab_size=1280", "--model", "image_code_factors=[256,5]"]
    first = swarm.start_coordinator(extra=shapes_model)
    assert first["task"]["data"].endswith("/shards"), "the volunteers stream from the coordinator"
    peers = ("a", "b")
    for name in peers:
        swarm.join(name, batch_size=16, max_epochs=1000)
    swarm.wait_in_step(list(peers), 180)  # both training, both seen by the coordinator
    swarm.wait_epoch(swarm.status()["epoch"] + 1, 90)

    # The logs' lengths before the kill: a peer may fail its first fetch while the coordinator is
    # still shutting down.
    at_kill = {n: len(swarm.log(n)) for n in peers}
    swarm.kill("coordinator", signal.SIGTERM)
    down_unix = time.time()
    time.sleep(OUTAGE_S)  # the outage itself: nothing to poll for while the coordinator is down
    for name in peers:
        assert swarm.procs[name].poll() is None, f"{name} died during the outage:\n{swarm.log(name)[-3000:]}"
    restarted = swarm.start_coordinator(extra=shapes_model)
    up_unix = time.time()
    assert restarted["coordinator_peer_id"] == first["coordinator_peer_id"]

    for name in peers:
        during = swarm.log(name)[at_kill[name]:]
        assert "the data source" in during and "does not answer" in during, \
            f"{name} never failed a fetch during the outage:\n{during[-3000:]}"
        assert re.search(r"data source still down after \d+ s: retry \d+", during), during[-3000:]
        assert _steps(swarm.log(name)[:at_kill[name]]), swarm.log(name)[-3000:]
        assert "skipping shard" not in swarm.log(name), "an outage is not broken data"

    # The restarted coordinator finds the volunteers again (through the peers it saw last time).
    deadline = time.monotonic() + 90
    seen = set()
    while time.monotonic() < deadline:
        try:
            seen = {p["user"] for p in swarm.status().get("peers", []) if p["time"] > up_unix}
        except OSError:
            seen = set()
        if seen >= set(peers):
            break
        time.sleep(1)
    assert seen >= set(peers), f"the restarted coordinator sees {seen}\n" + swarm.log("coordinator")[-2000:]
    # ... and the data streams again: at the next retry, at most retry_max_delay_s (30 s) after the
    # last, later when the shuffle buffer pulls rows in bursts (up to half of it between pulls).
    deadline = time.monotonic() + 120
    while not all("answers again" in swarm.log(n)[at_kill[n]:] for n in peers):
        assert time.monotonic() < deadline, {n: swarm.log(n)[-1500:] for n in peers}
        time.sleep(1)

    codes = swarm.interrupt_all(list(peers))
    assert codes == {"a": 0, "b": 0}, {n: swarm.log(n)[-2000:] for n in peers}
    for name in peers:
        summary = swarm.summary(name)
        # Rounds averaged while the coordinator was down: with both volunteers, several epochs on.
        outage_rounds = [r for r in summary["rounds"] if down_unix < r["done_unix"] < down_unix + OUTAGE_S]
        assert sum(r["group_size"] == 2 for r in outage_rounds) >= 2, (name, outage_rounds)
        epochs = [r["epoch"] for r in outage_rounds]
        assert max(epochs) - min(epochs) >= 1, (name, outage_rounds)
