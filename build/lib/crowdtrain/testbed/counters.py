"""Byte counters of every node's link, sampled from the hub namespace.

On a hub-side port ``v-NAME``, ``rx_bytes`` is what the node uploaded and ``tx_bytes`` what it
downloaded (counted after the shaper). One JSON line per sample: ``{"t": unix time,
"NAME": [uploaded, downloaded], ...}``. Runs inside the hub namespace, where ``/sys/class/net``
shows the hub's interfaces:

    ip netns exec HUB python -m crowdtrain.testbed.counters OUT.jsonl [INTERVAL_S]
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

NET = Path("/sys/class/net")


def read_counters() -> dict[str, list[int]]:
    out = {}
    for port in NET.glob("v-*"):
        stats = port / "statistics"
        try:
            out[port.name[2:]] = [int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())]
        except OSError:  # the port went away (tear-down)
            pass
    return out


def sample(path: Path, interval_s: float) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    with open(path, "a") as f:
        while not stop:
            f.write(json.dumps({"t": time.time(), **read_counters()}) + "\n")
            f.flush()
            time.sleep(interval_s)


def load(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the end of the run
            pass
    return rows


def bytes_between(rows: list[dict], node: str, t0: float, t1: float) -> tuple[int, int]:
    """(uploaded, downloaded) bytes of ``node`` between the samples nearest to t0 and t1."""
    before = [r for r in rows if r["t"] <= t0 and node in r] or [r for r in rows if node in r][:1]
    after = [r for r in rows if r["t"] >= t1 and node in r] or [r for r in rows if node in r][-1:]
    if not before or not after:
        return 0, 0
    a, b = before[-1][node], after[0][node]
    return b[0] - a[0], b[1] - a[1]


def rates(rows: list[dict], node: str, window_s: float = 1.0) -> tuple[list[float], list[float], list[float]]:
    """Times and upload/download rates (bits/s) of ``node``, averaged over ``window_s``."""
    pts = [(r["t"], r[node]) for r in rows if node in r]
    times, up, down = [], [], []
    j = 0
    for i, (t, (u, d)) in enumerate(pts):
        while pts[j][0] < t - window_s:
            j += 1
        if i == j:
            continue
        dt = t - pts[j][0]
        times.append(t)
        up.append(8 * (u - pts[j][1][0]) / dt)
        down.append(8 * (d - pts[j][1][1]) / dt)
    return times, up, down


if __name__ == "__main__":
    sample(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.2)
