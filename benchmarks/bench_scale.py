"""A swarm of tens of volunteers on this machine: real ``crowdtrain join`` processes (the launcher,
``tiny``, one thread each, compute padded with ``--simulated-step-s``), and a storm of newcomers
arriving at once into the running swarm.

``--peers 32 --storm 8``: 24 volunteers join one after the other (``--stagger-s`` apart: importing
torch in 24 processes at once starves 2 cores for minutes), train until the swarm is a few epochs
past the last of them, then 8 more start at the same moment. Every peer leaves at the same epoch.

What it reports:

- **memory per volunteer**: each process tree (the peer, its DHT and averager children, their
  p2p daemons) in RSS (pages shared with the parent counted in every process: an upper bound) and
  PSS (shared pages split among the processes that map them: what the volunteers really cost
  together), and how many volunteers the machine's available memory would hold at that PSS;
- **rounds with every live peer**: the share of a peer's rounds whose group held every peer the
  swarm reported at the round's start, before and after the storm;
- **round time** (sync mode: from the last member's start of the all-reduce to the last member's
  end, ``crowdtrain.testbed.analysis``; DiLoCo mode: each peer's own sync-to-outer-step time)
  against the testbed's bandwidth floor for that many peers at 100 Mbit/s
  (``butterfly_floor_s``; on loopback the link is not the limit, so a ratio far above 1 is what
  this machine's CPU costs);
- **the auxiliary peer's lag**: from a peer's metrics record (its ``time``) to the coordinator's
  status showing it (``updated`` of ``/api/status``, polled every second);
- **the ledger identity**: the leaderboard's samples per user against the peers' own ledgers, and
  per round the members' credited weights against what the reducers averaged (``round_weight``);
- **the storm**: per newcomer, the state download, the epochs from joining to its first credited
  round, and the time to its first step.

A volunteer's process tree takes about 850 MiB (PSS) here, so 24 GiB holds 24 of them, not 32
(``docs/scale.md``); on this machine run

    flock /work/heavy.lock nice -n 10 python benchmarks/bench_scale.py --mode sync --peers 16 --storm 4 --target 512 --storm-at 3 --epochs-after 4
    flock /work/heavy.lock nice -n 10 python benchmarks/bench_scale.py --mode sync --peers 32 --storm 8   # 48 GiB or more
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from crowdtrain.launch import LocalSwarm, get_json  # noqa: E402
from crowdtrain.testbed.analysis import butterfly_floor_s, cluster_rounds, gradient_wire_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def tree_memory(pid: int) -> dict:
    """RSS and PSS (bytes) of a process and all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"processes": 0, "rss": 0, "pss": 0}
    rss = pss = count = 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss, count = rss + info.rss, pss + info.pss, count + 1
    return {"processes": count, "rss": rss, "pss": pss}


class StatusPoller(threading.Thread):
    """Polls ``/api/status`` every second: when a peer's record shows a new ``time``, the lag is
    the status's ``updated`` minus that time (the auxiliary peer's fetch, screening, database
    writes and status file, plus up to its 2 s refresh period)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.seen: dict[str, float] = {}
        self.lags: list[tuple[float, float, int]] = []  # (unix, lag s, live peers in status)
        self.failures = 0

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                status = get_json(f"{self.url}/api/status", timeout=10)
            except OSError:
                self.failures += 1
                continue
            updated = status.get("updated") or time.time()
            peers = status.get("peers", [])
            for p in peers:
                t = p.get("time")
                if t and self.seen.get(p["peer_id"]) != t:
                    self.seen[p["peer_id"]] = t
                    self.lags.append((time.time(), updated - t, len(peers)))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def full_share(summaries: dict, *, after_unix: float | None = None, before_unix: float | None = None) -> dict:
    rounds = [r for s in summaries.values() for r in s.get("rounds", []) if r["swarm_peers"] >= 2
              and (after_unix is None or (r.get("done_unix") or 0) >= after_unix)
              and (before_unix is None or (r.get("done_unix") or 0) < before_unix)]
    full = sum(r["group_size"] >= r["swarm_peers"] for r in rounds)
    shared = sum(r["group_size"] >= 2 for r in rounds)
    return {"rounds": len(rounds), "full": full, "shared": shared,
            "full_share": full / len(rounds) if rounds else None,
            "mean_group_over_swarm": (statistics.mean(r["group_size"] / r["swarm_peers"] for r in rounds)
                                      if rounds else None)}


def round_times(summaries: dict, mode: str) -> dict:
    """Sync: per clustered round, last start to last end (as the testbed measures it); DiLoCo:
    each peer's seconds from its sync point to its outer step. The median over rounds, and the
    group sizes they had."""
    if mode == "diloco":
        secs = [r["seconds"] for s in summaries.values() for r in s.get("rounds", []) if r.get("seconds")]
        sizes = [r["group_size"] for s in summaries.values() for r in s.get("rounds", []) if r.get("seconds")]
        return {"median_s": statistics.median(secs) if secs else None, "p90_s": percentile(secs, 0.9),
                "n": len(secs), "median_group": statistics.median(sizes) if sizes else None}
    rows = []
    for members in cluster_rounds(summaries):
        started = [m["allreduce_unix"] for m in members if m.get("allreduce_unix")]
        if len(started) < 2:
            continue
        rows.append({"members": len(members), "group": max(m["group_size"] for m in members),
                     "seconds": max(m["done_unix"] for m in members) - max(started),
                     "wait_s": max(started) - min(m["triggered_unix"] for m in members if m.get("triggered_unix"))})
    secs = [r["seconds"] for r in rows]
    return {"median_s": statistics.median(secs) if secs else None, "p90_s": percentile(secs, 0.9), "n": len(rows),
            "median_group": statistics.median(r["group"] for r in rows) if rows else None,
            "median_trigger_to_start_s": statistics.median(r["wait_s"] for r in rows) if rows else None}


def param_spread(tmp: Path, names) -> dict | None:
    """max_i ||theta_i - mean|| / ||mean|| over the peers' final parameters (``--save-final``),
    the whole model as one vector."""
    import torch
    from safetensors.torch import load_file

    vectors = {}
    for name in names:
        path = tmp / f"{name}.safetensors"
        if path.exists():
            tensors = load_file(str(path))
            vectors[name] = torch.cat([tensors[k].flatten().double() for k in sorted(tensors)])
    if len(vectors) < 2:
        return None
    mean = torch.stack(list(vectors.values())).mean(0)
    apart = {n: ((v - mean).norm() / mean.norm()).item() for n, v in vectors.items()}
    return {"max": max(apart.values()), "median": statistics.median(apart.values()), "peers": len(apart),
            "distinct": len({v.sum().item() for v in vectors.values()})}


def ledger_check(swarm: LocalSwarm, summaries: dict, timeout: float = 60.0) -> dict:
    """The leaderboard against the peers' ledgers (waiting for the auxiliary peer to read the last
    records), and rounds whose members' weights add up to their reducers' count."""
    expected = {name: s["credited_samples"] for name, s in summaries.items()}
    deadline = time.monotonic() + timeout
    while True:
        board = {row["user"]: row for row in get_json(f"{swarm.url}/api/leaderboard", timeout=30)}
        got = {name: board.get(name, {}).get("samples", 0) for name in summaries}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    by_epoch: dict[int, list[dict]] = {}
    for s in summaries.values():
        for r in s["rounds"]:
            if "round_weight" in r:
                by_epoch.setdefault(r["epoch"], []).append(r)
    checked = agreed = 0
    for rounds in by_epoch.values():
        seen = max(r["round_weight"] for r in rounds)
        groups = {r["group_size"] for r in rounds}
        if (seen > 0 and len(groups) == 1 and len(rounds) == groups.pop() and all(r["credited"] for r in rounds)
                and not any(r.get("partial") for r in rounds)):
            checked += 1
            agreed += sum(r["weight"] for r in rounds) == seen
    return {"leaderboard_sum": sum(got.values()), "ledgers_sum": sum(expected.values()),
            "users_exact": sum(got[n] == expected[n] for n in expected), "users": len(expected),
            "mismatches": {n: (got[n], expected[n]) for n in expected if got[n] != expected[n]},
            "rounds_checked": checked, "rounds_weights_exact": agreed}


def run(args, tmp: Path) -> dict:
    base = [f"v{i + 1:02d}" for i in range(args.peers - args.storm)]
    new = [f"n{i + 1:02d}" for i in range(args.storm)]
    swarm = LocalSwarm(tmp, swarm={
        "mode": args.mode, "target_batch_size": args.target, "lr": 0.01, "total_epochs": 1000, "warmup_epochs": 1,
        "matchmaking_time_s": args.matchmaking_s, "averaging_timeout_s": args.averaging_timeout_s,
        "checkpoint_every_epochs": 1000, **json.loads(args.swarm)})
    step = ["--simulated-step-s", str(args.step_s)]
    end = args.storm_at + args.epochs_after
    poller = StatusPoller(swarm.url)
    memory: dict[str, dict] = {}
    events: dict[str, float] = {}
    try:
        info = swarm.start_coordinator(timeout=300)
        poller.start()
        t0 = time.time()
        for name in base:
            swarm.join(name, batch_size=args.batch, max_epochs=end, extra=step)
            time.sleep(args.stagger_s)
        events["base_started_s"] = time.time() - t0
        # The storm comes once every base peer reports a record, and the swarm is at storm_at.
        deadline = time.monotonic() + args.timeout_s
        while True:
            status = swarm.status()
            live = {p.get("user") for p in status.get("peers", [])}
            if set(base) <= live and status.get("epoch", 0) >= args.storm_at:
                break
            if time.monotonic() > deadline or any(swarm.procs[n].poll() is not None for n in base):
                raise RuntimeError(f"the base swarm did not form: {sorted(set(base) - live)} missing, "
                                   f"epoch {status.get('epoch')}")
            time.sleep(2)
        for name in base:
            memory[name] = tree_memory(swarm.procs[name].pid)
        memory["coordinator"] = tree_memory(swarm.procs["coordinator"].pid)
        storm_epoch, t_storm = status["epoch"], time.time()
        events["storm_epoch"], events["storm_s"] = storm_epoch, t_storm - t0
        if storm_epoch + 3 > end:
            raise RuntimeError(f"the storm came at epoch {storm_epoch}, too late for --storm-at "
                               f"{args.storm_at} + --epochs-after {args.epochs_after}: raise --epochs-after")
        for name in new:
            swarm.join(name, batch_size=args.batch, max_epochs=end, extra=step)
        if new:
            time.sleep(90)
            for name in new:
                memory[name] = tree_memory(swarm.procs[name].pid)
        codes = {name: swarm.procs[name].wait(timeout=max(60, args.timeout_s - (time.time() - t0)))
                 for name in base + new}
        events["wall_s"] = time.time() - t0
        summaries = {}
        for name in base + new:
            try:
                summaries[name] = swarm.summary(name)
            except (OSError, ValueError):
                pass
        ledger = ledger_check(swarm, summaries)
        spread = param_spread(tmp, base + new)
        poller.stop.set()
        status = swarm.status()
    finally:
        poller.stop.set()
        swarm.close()
    names = {s["peer_id"]: n for n, s in summaries.items()}
    names[info["coordinator_peer_id"]] = "coordinator"
    storm = {}
    for name in new:
        s = summaries.get(name, {})
        credited = [c["epoch"] for c in s.get("credits", []) if c["credited"]]
        storm[name] = {"exit_code": codes[name], "joined_epoch": s.get("joined_epoch"),
                       "state_load_s": s.get("state_load_s"), "first_epoch_s": s.get("first_epoch_s"),
                       "epochs_to_contribute": credited[0] - s["joined_epoch"] if credited and "joined_epoch" in s
                       else None}
    peers_mem = [m for n, m in memory.items() if n != "coordinator" and m["processes"]]
    available = psutil.virtual_memory().total
    mean_pss = statistics.mean(m["pss"] for m in peers_mem) if peers_mem else None
    _, wire = gradient_wire_bytes("{}", "tiny", 2**16)
    rt = round_times(summaries, args.mode)
    lags = [lag for t, lag, _ in poller.lags if t > t0]
    lags_full = [lag for t, lag, n in poller.lags if n >= args.peers - 1]
    return {
        "mode": args.mode, "peers": args.peers, "storm": args.storm, "step_s": args.step_s, "batch": args.batch,
        "target_batch_size": args.target, "matchmaking_time_s": args.matchmaking_s, "swarm": json.loads(args.swarm),
        "events": events, "exit_codes": codes, "summaries_read": len(summaries),
        "memory": memory,
        "memory_per_volunteer": {"rss_mean": statistics.mean(m["rss"] for m in peers_mem) if peers_mem else None,
                                 "pss_mean": mean_pss,
                                 "processes_mean": statistics.mean(m["processes"] for m in peers_mem)
                                 if peers_mem else None,
                                 "machine_total": available,
                                 "volunteers_that_fit": int(available * 0.9 // mean_pss) if mean_pss else None},
        "rounds_before_storm": full_share(summaries, before_unix=t_storm),
        "rounds_after_storm": full_share(summaries, after_unix=t_storm + 120),
        "rounds_all": full_share(summaries),
        "round_time": rt, "floor_100mbit_s": butterfly_floor_s(args.peers, wire, 100e6),
        "floor_1gbit_s": butterfly_floor_s(args.peers, wire, 1e9), "wire_bytes": wire,
        "aux_lag_s": {"median": statistics.median(lags) if lags else None, "p90": percentile(lags, 0.9),
                      "max": max(lags) if lags else None, "n": len(lags),
                      "median_at_full_swarm": statistics.median(lags_full) if lags_full else None,
                      "status_poll_failures": poller.failures},
        "ledger": ledger, "param_spread": spread, "storm_newcomers": storm,
        "final_epochs": {n: s.get("final_epoch") for n, s in summaries.items()},
        "status_rounds": status.get("rounds"),
        "state_uploads": {n: s.get("state_uploads") for n, s in summaries.items()},
        "peer_names": names,
    }


def report(r: dict) -> None:
    mb = 2**20
    m = r["memory_per_volunteer"]
    print(f"\n{r['mode']}: {r['peers']} volunteers ({r['peers'] - r['storm']} + a storm of {r['storm']} at epoch "
          f"{r['events'].get('storm_epoch')}), step {r['step_s']} s x batch {r['batch']}, "
          f"target batch {r['target_batch_size']}; exit codes {sorted(set(r['exit_codes'].values()))}")
    if m["pss_mean"]:
        print(f"memory per volunteer (process tree, {m['processes_mean']:.1f} processes): RSS {m['rss_mean'] / mb:.0f} MiB,"
              f" PSS {m['pss_mean'] / mb:.0f} MiB -> about {m['volunteers_that_fit']} fit in "
              f"{m['machine_total'] / 2**30:.0f} GiB")
    for label in ("rounds_before_storm", "rounds_after_storm", "rounds_all"):
        f = r[label]
        share = f"{100 * f['full_share']:.0f}%" if f["full_share"] is not None else "-"
        print(f"{label:<20} {f['rounds']:5d} peer-rounds, with every live peer {share}, with others "
              f"{f['shared']}, mean group / swarm {f['mean_group_over_swarm'] or 0:.2f}")
    rt = r["round_time"]
    if rt["median_s"] is not None:
        print(f"round time median {rt['median_s']:.2f} s (p90 {rt['p90_s']:.2f}, {rt['n']} rounds, median group "
              f"{rt['median_group']}); floor at 100 Mbit/s {r['floor_100mbit_s']:.3f} s -> "
              f"{rt['median_s'] / r['floor_100mbit_s']:.0f}x")
    lag = r["aux_lag_s"]
    if lag["median"] is not None:
        print(f"auxiliary peer's lag: median {lag['median']:.1f} s, p90 {lag['p90']:.1f} s, max {lag['max']:.1f} s "
              f"({lag['n']} records)")
    led = r["ledger"]
    print(f"leaderboard {led['leaderboard_sum']} samples vs ledgers {led['ledgers_sum']}: {led['users_exact']}/"
          f"{led['users']} users exact; rounds' weights exact {led['rounds_weights_exact']}/{led['rounds_checked']}")
    if r.get("param_spread"):
        ps = r["param_spread"]
        print(f"final parameters: max ||theta_i - mean|| / ||mean|| {ps['max']:.2e} (median {ps['median']:.2e}) over "
              f"{ps['peers']} peers, {ps['distinct']} distinct")
    for name, n in r["storm_newcomers"].items():
        print(f"  {name}: joined epoch {n['joined_epoch']}, state {n['state_load_s'] or 0:.1f} s, first step "
              f"{n['first_epoch_s'] or 0:.1f} s, epochs to contribute {n['epochs_to_contribute']}, exit {n['exit_code']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("sync", "diloco"), default="sync")
    p.add_argument("--peers", type=int, default=32)
    p.add_argument("--storm", type=int, default=8, help="of --peers, how many arrive at once into the running rest")
    p.add_argument("--step-s", type=float, default=15.0, help="--simulated-step-s of every volunteer")
    p.add_argument("--batch", type=int, default=8)
    # 24 volunteers at 8 samples / 15 s: 12.8 samples/s, an epoch of 60 s (32: 45 s), many
    # matchmaking windows, and longer than a state download on this machine.
    p.add_argument("--target", type=int, default=768)
    p.add_argument("--matchmaking-s", type=float, default=5.0)
    p.add_argument("--averaging-timeout-s", type=float, default=90.0)
    p.add_argument("--stagger-s", type=float, default=5.0)
    p.add_argument("--storm-at", type=int, default=3)
    p.add_argument("--epochs-after", type=int, default=6)
    p.add_argument("--swarm", default="{}", help="more swarm settings, JSON")
    p.add_argument("--timeout-s", type=float, default=1500)
    p.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-scale-{args.mode}-"))
    try:
        result = run(args, tmp)
    finally:
        if args.keep:
            print(f"logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(result)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_scale_{args.mode}_{args.peers}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
