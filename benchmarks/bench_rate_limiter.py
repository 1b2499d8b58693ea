"""The coordinator's token rate limiter under many source addresses: memory and time per call.

A stranger chooses the bucket (its address), so an attacker with many addresses decides how
big the table grows. Measured: 100,000 addresses each making one request within a minute, then
the same after their windows passed, for the limiter as it is (``RateLimiter``) and, as the
baseline, the limiter as it was (it kept every address it saw: its clean-up deleted only empty
queues, which never occur). Memory by tracemalloc (the table's own allocations), time per
``allow`` call over the last 10,000 calls. Prints a table and writes JSON:

    python benchmarks/bench_rate_limiter.py [--addresses 100000]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import tracemalloc
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crowdtrain.coordinator.service import RateLimiter  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class BaselineLimiter:
    """The limiter before it was bounded, kept here as the measurement's baseline."""

    def __init__(self, limit: int, window_s: float = 60.0, clock=time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._events: dict[str, deque] = defaultdict(deque)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._events)

    def allow(self, client: str) -> bool:
        now = self.clock()
        with self._lock:
            events = self._events[client]
            while events and events[0] < now - self.window_s:
                events.popleft()
            if len(events) >= self.limit:
                return False
            events.append(now)
            if len(self._events) > 10_000:
                for key in [k for k, v in self._events.items() if not v]:
                    del self._events[key]
            return True


def measure(make, addresses: int) -> dict:
    now = [0.0]
    tracemalloc.start()
    limiter = make(lambda: now[0])
    base = tracemalloc.get_traced_memory()[0]
    timings = []
    for i in range(addresses):
        now[0] = 50.0 * i / addresses  # all within one minute
        t0 = time.perf_counter()
        limiter.allow(f"address:{i}")
        timings.append(time.perf_counter() - t0)
    live_bytes = tracemalloc.get_traced_memory()[0] - base
    live_entries = len(limiter)
    now[0] = 200.0  # every window has passed
    after = []
    for i in range(10_000):
        t0 = time.perf_counter()
        limiter.allow(f"later:{i}")
        after.append(time.perf_counter() - t0)
    after_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {"entries_live": live_entries, "mib_live": live_bytes / 2**20, "entries_after_window": len(limiter),
            "mib_after_window": after_bytes / 2**20,
            "us_per_call_last_10k": 1e6 * sum(timings[-10_000:]) / 10_000,
            "us_per_call_after_window": 1e6 * sum(after) / len(after)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addresses", type=int, default=100_000)
    args = parser.parse_args()
    rows = {"baseline (before)": measure(lambda clock: BaselineLimiter(10, clock=clock), args.addresses),
            "bounded (now)": measure(lambda clock: RateLimiter(10, clock=clock), args.addresses)}
    print(f"{args.addresses:,} addresses, one request each within a minute, then 10,000 new ones after it\n")
    print("| limiter | entries (live) | MiB (live) | entries after the window | MiB after | us/call live | "
          "us/call after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['entries_live']:,} | {r['mib_live']:.1f} | {r['entries_after_window']:,} | "
              f"{r['mib_after_window']:.1f} | {r['us_per_call_last_10k']:.1f} | {r['us_per_call_after_window']:.1f} |")
    out = RESULTS / "bench_rate_limiter.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"addresses": args.addresses, "rows": rows}, indent=1))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
