"""The Internet testbed: namespaces, shaped links checked with real transfers, tear-down.

The smoke test needs root (CI runs as root): it fails, never skips, when it cannot build the
testbed, so a CI machine that lost root or iproute2 shows up red.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from crowdtrain.testbed import analysis, linkcheck, netns
from crowdtrain.testbed.links import LinkSpec, parse_rate, tbf_args
from crowdtrain.testbed.netns import Testbed, list_namespaces, sweep_stale


def test_link_specs():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9 and parse_rate("10") == 10e6
    assert LinkSpec.parse("10mbit/50mbit") == LinkSpec(10e6, 50e6)
    assert str(LinkSpec.parse("100mbit")) == "100mbit"
    for bad in ("fast", "10mbit/20mbit/30mbit", "50kbit", "10mb"):
        with pytest.raises(ValueError):
            LinkSpec.parse(bad)
    args = tbf_args(10e6)
    assert args[:2] == ["rate", "10000000bit"] and int(args[3]) >= 16 * 1024


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="must run as root"):
        Testbed({"p1": LinkSpec(1e6, 1e6)}).up()


def test_butterfly_floor_and_round_grouping():
    # N peers each send 2(N-1)/N copies of the compressed model: 4 peers, 10 MB, 100 Mbit/s -> 1.2 s.
    assert analysis.butterfly_floor_s(4, 10_000_000, 100e6) == pytest.approx(1.2)
    rounds = {"a": {"rounds": [{"done_unix": 10.0, "allreduce_unix": 8.0, "triggered_unix": 7.0, "group_size": 2},
                               {"done_unix": 40.0, "allreduce_unix": 39.0, "triggered_unix": 38.0, "group_size": 2}]},
              "b": {"rounds": [{"done_unix": 14.5, "allreduce_unix": 8.5, "triggered_unix": 8.4, "group_size": 2},
                               {"done_unix": 41.0, "allreduce_unix": 39.2, "triggered_unix": 39.1, "group_size": 2}]}}
    grouped = analysis.cluster_rounds(rounds)
    assert [sorted(m["peer"] for m in r) for r in grouped] == [["a", "b"], ["a", "b"]]
    # A reading taken after a groupmate had finished (a starved background thread) is left out.
    late = {"a": rounds["a"], "b": {"rounds": [{"done_unix": 14.0, "allreduce_unix": 12.0, "triggered_unix": 12.0,
                                                "group_size": 2}]}}
    plan = {"name": "x", "preset": "tiny", "model": {}, "swarm": {},
            "peers": [{"name": n, "link": "10mbit", "up_bps": 1e7, "down_bps": 1e7} for n in ("a", "b")]}
    first = analysis.round_stats({"plan": plan, "peers": late, "counters": []})["rounds"][0]
    assert first["round_s"] == pytest.approx(2.0) and first["late_readings"] == 1


def _root_addresses() -> str:
    return subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True, check=True).stdout


@pytest.mark.timeout(90)
def test_smoke_two_peers_shaped_links_and_teardown():
    """Build coordinator + 2 peers, measure the slow peer's upload and download with real TCP
    transfers (within 15% of what was asked), then check nothing is left behind."""
    before_addr = _root_addresses()
    slow = LinkSpec.parse("4mbit/8mbit")
    start = time.monotonic()
    with Testbed({"coord": LinkSpec.parse("100mbit"), "p1": slow, "p2": LinkSpec.parse("40mbit")}) as tb:
        made = {tb.hub, *(n.namespace for n in tb.nodes.values())}
        assert made <= set(list_namespaces())
        qdiscs = subprocess.run(tb.exec_argv("p1", ["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True,
                                text=True).stdout
        assert "tbf" in qdiscs and "rate 4Mbit" in qdiscs, qdiscs
        up = linkcheck.measure(tb, "p1", "p2", seconds=3)  # limited by p1's 4 Mbit/s upload
        down = linkcheck.measure(tb, "p2", "p1", seconds=3)  # limited by p1's 8 Mbit/s download
    assert abs(up / slow.up_bps - 1) < 0.15, f"upload measured {up / 1e6:.2f} Mbit/s, asked 4"
    assert abs(down / slow.down_bps - 1) < 0.15, f"download measured {down / 1e6:.2f} Mbit/s, asked 8"
    assert not (made & set(list_namespaces())), "namespaces left behind"
    assert _root_addresses() == before_addr, "the root namespace's addresses changed"
    assert time.monotonic() - start < 60


HOLD = """
import sys, time
from crowdtrain.testbed.netns import Testbed
from crowdtrain.testbed.links import LinkSpec
with Testbed({"p1": LinkSpec(1e7, 1e7), "p2": LinkSpec(1e7, 1e7)}) as tb:
    tb.spawn("p1", ["sleep", "600"])
    print("READY", tb.hub, flush=True)
    time.sleep(600)
"""


def _holder():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # SIGINT back to its default in the child: a shell's background job (or CI runner) may ignore
    # it, and Python then installs no KeyboardInterrupt handler, unlike in a terminal.
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = proc.stdout.readline().split()
    assert line and line[0] == "READY", "the testbed did not come up"
    return proc, line[1].rsplit("-", 1)[0]


def _mine(tag: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(tag + "-")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_tears_down(sig):
    proc, tag = _holder()
    try:
        assert len(_mine(tag)) == 3
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        assert _mine(tag) == [], f"namespaces left after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_namespaces_of_a_killed_testbed_are_swept():
    proc, tag = _holder()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=10)
        assert len(_mine(tag)) == 3
        removed = sweep_stale()
        assert set(_mine(tag)) == set() and len([n for n in removed if n.startswith(tag)]) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for name in _mine(tag):
            netns.remove_namespace(name)


def test_round_summary_from_a_recorded_run():
    """The analysis of a two-peer run: full rounds, the floor of the model, utilization."""
    plan = {"name": "x", "preset": "tiny", "model": {}, "swarm": {"target_batch_size": 8},
            "peers": [{"name": n, "link": "10mbit", "up_bps": 1e7, "down_bps": 1e7} for n in ("p1", "p2")]}
    epochs = [{"epoch": e, "samples": 20 * e, "unix": 100.0 + 20 * e, "compute_s": 18.0 * e, "wait_s": 1.0 * e}
              for e in range(1, 5)]
    peer = {"rounds": [{"done_unix": 111.0 + 20 * e, "allreduce_unix": 110.0 + 20 * e, "triggered_unix": 110.0 + 20 * e,
                        "group_size": 2} for e in range(1, 4)],
            "epochs": epochs, "seconds": 40.0, "compute_s": 36.0, "samples": 40, "steps": 40}
    result = {"plan": plan, "peers": {"p1": peer, "p2": json.loads(json.dumps(peer))}, "counters": [],
              "metrics": [], "events": [], "t0": 100.0}
    s = analysis.summarize(result)
    assert s["rounds"]["full_rounds"] == 3 and s["rounds"]["round_s_median"] == pytest.approx(1.0)
    params, wire = analysis.model_size(plan)
    assert s["rounds"]["floor_s"] == pytest.approx(wire * 8 / 1e7)
    assert s["utilization_mean"] == pytest.approx(0.9) and s["swarm_samples_per_s"] == pytest.approx(2.0)

