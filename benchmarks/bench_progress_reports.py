"""What reporting training progress costs a peer's DHT: hivemind's reporter against crowdtrain's.

Every peer publishes its progress (epoch, samples so far, speed) in the DHT, and the others read
it to see when the swarm has its target batch. hivemind's ``ProgressTracker`` stores a record at
every local step; ``crowdtrain.swarm.hivemind_seam.optimizer.SuspectAwareProgressTracker`` stores
one per ``min_refresh_period`` (0.5 s, as often as the others read) and a new epoch at once. Each
store is a few RPCs whose records are RSA-signed.

This starts a small DHT of real processes (each DHT is a process with its own p2pd, with a run's
record validators as volunteers install them), runs one tracker per DHT stepping every
``--step-s``, and measures the CPU the DHT processes and their daemons spend. The two trackers
are alternated ``--repeats`` times; the table gives the median and the spread.

    python benchmarks/bench_progress_reports.py [--peers 3] [--seconds 10] [--step-s 0.1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants (a DHT process and its p2pd)."""
    import psutil

    total = 0.0
    process = psutil.Process(pid)
    for p in [process, *process.children(recursive=True)]:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def peer(tracker_name: str, initial_peers: list[str], seconds: float, step_s: float, results) -> None:
    """One peer in its own process (hivemind signs a process's records with one key per process):
    a DHT with the run's validators, a tracker, a step every ``step_s``."""
    import hivemind
    from hivemind.optim.progress_tracker import ProgressTracker

    from crowdtrain.swarm.hivemind_seam.optimizer import SuspectAwareProgressTracker
    from crowdtrain.swarm.metrics import make_validators
    from crowdtrain.swarm.robust import SuspectPeers

    run_id = "bench_reports"
    validators, _ = make_validators(run_id)
    dht = hivemind.DHT(initial_peers=initial_peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       record_validators=validators)
    kwargs = {"suspects": SuspectPeers()} if tracker_name == "crowdtrain" else {}
    cls = SuspectAwareProgressTracker if tracker_name == "crowdtrain" else ProgressTracker
    tracker = cls(dht=dht, prefix=run_id, target_batch_size=10**9, min_refresh_period=0.5, max_refresh_period=3.0,
                  default_refresh_period=0.5, start=True, **kwargs)
    results.put(("maddrs", [str(m) for m in dht.get_visible_maddrs()]))
    try:
        time.sleep(3.0)  # every peer up and its first records out, not measured
        before, started, step = cpu_s(dht.pid), time.monotonic(), 0
        while time.monotonic() - started < seconds:
            step += 1
            tracker.report_local_progress(0, step * 8)
            time.sleep(step_s)
        spent, elapsed = cpu_s(dht.pid) - before, time.monotonic() - started
        results.put(("done", {"dht_cpu_s": spent, "elapsed_s": elapsed, "steps": step,
                              "peers_seen": tracker.global_progress.num_peers}))
    finally:
        tracker.shutdown(5)
        dht.shutdown()


def run_once(tracker_name: str, peers: int, seconds: float, step_s: float) -> dict:
    import multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    first = context.Process(target=peer, args=(tracker_name, [], seconds + 1.0, step_s, results))
    first.start()
    kind, maddrs = results.get(timeout=120)
    assert kind == "maddrs"
    others = [context.Process(target=peer, args=(tracker_name, maddrs, seconds, step_s, results))
              for _ in range(peers - 1)]
    for p in others:
        p.start()
    done = []
    while len(done) < peers:
        kind, value = results.get(timeout=seconds + 120)
        if kind == "done":
            done.append(value)
    for p in [first, *others]:
        p.join(30)
    return {"dht_cpu_s": sum(d["dht_cpu_s"] for d in done), "elapsed_s": statistics.mean(d["elapsed_s"] for d in done),
            "peers_seen": min(d["peers_seen"] for d in done)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    variants = {"hivemind (every step)": "hivemind", "crowdtrain (per refresh period)": "crowdtrain"}
    runs = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, tracker_name in variants.items():
            runs[name].append(run_once(tracker_name, args.peers, args.seconds, args.step_s))

    def share(run: dict) -> float:  # of one core, per DHT
        return run["dht_cpu_s"] / run["elapsed_s"] / args.peers

    base = statistics.median(share(r) for r in runs["hivemind (every step)"])
    rows = []
    for name, rs in runs.items():
        shares = [share(r) for r in rs]
        rows.append({"variant": name, "core_share_per_dht_median": statistics.median(shares),
                     "core_share_per_dht_min": min(shares), "core_share_per_dht_max": max(shares),
                     "ratio_to_hivemind": statistics.median(shares) / base,
                     "peers_seen_min": min(r["peers_seen"] for r in rs)})
    print(f"{args.peers} DHT processes, a step every {args.step_s} s for {args.seconds:.0f} s, {args.repeats} "
          "repeats alternated; CPU of the DHT processes and their p2pd, as a share of one core per peer")
    print(f"{'variant':<32}{'median':>9}{'min':>9}{'max':>9}{'ratio':>8}")
    for row in rows:
        print(f"{row['variant']:<32}{row['core_share_per_dht_median']:>9.3f}{row['core_share_per_dht_min']:>9.3f}"
              f"{row['core_share_per_dht_max']:>9.3f}{row['ratio_to_hivemind']:>8.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_progress_reports.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
