"""Hours-long run on 127.0.0.1: does any process grow, and does the coordinator lose anything?

A coordinator and volunteers on the `tiny` model, for ``--minutes`` (120 by default): one
"anchor" volunteer stays the whole run, two churning volunteers are replaced every
``--churn-min`` minutes (the oldest is SIGKILLed, as a crash or a lost connection, and a new one
joins), and the coordinator is restarted once (SIGTERM, then the same command) at
``--restart-min``. Steps are padded to ``--step-s`` seconds so the run is bounded by the swarm's
machinery (matchmaking, averaging, metrics, checkpoints) rather than by two shared CPU cores.

Every ``--sample-s`` seconds it records, for every process of the run (each command's whole
process tree: the coordinator's web process, its auxiliary peer, hivemind's DHT and averager
children, the p2p daemons): resident memory, open file descriptors and threads; and the
database's size and row counts.

Reported: growth per hour over the last ``--window-min`` minutes (least squares) for every
process that lived through that window, with the verdict "flat" when the fitted growth over the
window is below ``max(5% of the mean, 16 MB)`` for memory (and below 5% + 4 for fds and threads);
the peak memory of each churned volunteer; and whether every metrics row, contribution and
checkpoint seen during the run was still in the database (and on disk, for checkpoints the run
keeps) at the end.

    python benchmarks/soak.py                  # 2 hours; JSON in benchmarks/results/soak_*.json
    python benchmarks/soak.py --minutes 6 --churn-min 2 --restart-min 1.5 --window-min 3   # a quick try
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crowdtrain.launch import LocalSwarm  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
RESULTS = Path(__file__).resolve().parent / "results"


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process we can read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        table[int(entry)] = (ppid, cmd)
    return table


def _tree(root: int, table: dict[int, tuple[int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def _role(pid: int, root: int, cmd: str) -> str:
    if pid == root:
        return "main"
    if "p2pd" in cmd:
        return "p2pd"
    if "crowdtrain.auxpeer" in cmd:
        return "aux"
    return "child"


def _usage(pid: int) -> dict | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        threads = int(fields[17])
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        pss = next((int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                    if line.startswith("Pss:")), 0)
    except (OSError, ValueError, IndexError):
        return None
    # RSS is what `top` shows; PSS splits pages shared between forked processes, so it adds up.
    return {"rss_mb": rss / 2**20, "pss_mb": pss / 2**20, "fds": fds, "threads": threads}


def sample_processes(owners: dict[str, int]) -> dict[str, dict]:
    """For each owner (a command we started) every process of its tree, keyed 'owner/role/pid'."""
    table = _proc_table()
    out = {}
    for owner, root in owners.items():
        for pid in _tree(root, table):
            use = _usage(pid)
            if use is not None:
                out[f"{owner}/{_role(pid, root, table[pid][1])}/{pid}"] = use
    return out


def sample_db(run_dir: Path) -> dict:
    """Row counts and identities, read-only, while the coordinator writes (SQLite in WAL mode)."""
    path = run_dir / "coordinator.sqlite"
    if not path.exists():
        return {}
    size = sum(p.stat().st_size for p in run_dir.glob("coordinator.sqlite*"))
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        metrics = con.execute("SELECT count(*), coalesce(max(id), 0) FROM metrics").fetchone()
        contributions = dict(con.execute("SELECT peer_id || '@' || epoch, samples FROM contributions").fetchall())
        checkpoints = {name: bool(pruned) for name, pruned in con.execute("SELECT name, pruned FROM checkpoints")}
        points = con.execute("SELECT count(*) FROM swarm_points").fetchone()[0]
    except sqlite3.Error as e:  # a table not created yet, or a write lock held past the timeout
        return {"size_bytes": size, "error": repr(e)}
    finally:
        con.close()
    return {"size_bytes": size, "metrics_rows": metrics[0], "metrics_max_id": metrics[1],
            "contributions": contributions, "checkpoints": checkpoints, "swarm_points": points}


def metrics_ids(run_dir: Path) -> set[int]:
    con = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return {row[0] for row in con.execute("SELECT id FROM metrics")}
    finally:
        con.close()


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) in value per hour."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mt) * (v - mv) for t, v in points) / var * 3600


def growth_report(samples: list[dict], window_s: float, *, min_points: int = 5) -> list[dict]:
    """Per process alive for the whole last window: mean, fitted growth per hour, and a verdict."""
    end = samples[-1]["t"]
    window = [s for s in samples if s["t"] >= end - window_s]
    if len(window) < min_points:
        return []
    keys = set(window[0]["procs"])
    for s in window[1:]:
        keys &= set(s["procs"])
    rows = []
    for key in sorted(keys):
        row = {"process": key}
        for metric, floor, rel in (("rss_mb", 16.0, 0.05), ("fds", 4.0, 0.05), ("threads", 4.0, 0.05)):
            pts = [(s["t"], s["procs"][key][metric]) for s in window]
            mean = sum(v for _, v in pts) / len(pts)
            per_h = slope_per_hour(pts)
            over_window = per_h * window_s / 3600
            row[metric] = {"mean": round(mean, 1), "first": pts[0][1], "last": pts[-1][1],
                           "per_hour": round(per_h, 2), "flat": abs(over_window) <= max(rel * mean, floor)}
        rows.append(row)
    return rows


def run(args) -> dict:
    tmp = Path(args.out).resolve()
    if tmp.exists() and any(tmp.iterdir()):
        raise SystemExit(f"{tmp} is not empty: give a new --out (a soak starts a fresh run)")
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(tmp, swarm={"target_batch_size": args.target_batch, "total_epochs": 10**6, "warmup_epochs": 5,
                              "lr": 0.01, "checkpoint_every_epochs": args.checkpoint_every,
                              "averaging_timeout_s": 60.0})
    step = ["--simulated-step-s", str(args.step_s)]
    owners: dict[str, int] = {}
    events: list[dict] = []
    samples: list[dict] = []
    churn: list[str] = []
    next_churn_id = 0
    peaks: dict[str, float] = {}

    def join(name: str) -> None:
        owners[name] = swarm.join(name, batch_size=args.batch, max_epochs=10**9, extra=step).pid

    def new_churner() -> None:
        nonlocal next_churn_id
        next_churn_id += 1
        name = f"churn{next_churn_id}"
        join(name)
        churn.append(name)
        events.append({"t": time.monotonic() - t0, "event": "join", "peer": name})

    t0 = time.monotonic()
    try:
        swarm.start_coordinator()
        owners["coordinator"] = swarm.procs["coordinator"].pid
        join("anchor")
        new_churner()
        new_churner()
        restarted = False
        next_churn = args.churn_min * 60
        next_sample = 0.0
        db_seen = {"metrics_max_id": 0, "contributions": {}, "checkpoints": set()}
        ids_before_restart: set[int] = set()
        print(f"soak: {args.minutes} min in {tmp}; a line every {args.sample_s:.0f} s", flush=True)
        while (now := time.monotonic() - t0) < args.minutes * 60:
            if not restarted and now >= args.restart_min * 60:
                ids_before_restart = metrics_ids(swarm.run_dir)
                swarm.kill("coordinator", signal.SIGTERM)
                swarm.start_coordinator()
                owners["coordinator"] = swarm.procs["coordinator"].pid
                restarted = True
                events.append({"t": now, "event": "coordinator restart",
                               "metrics_rows_before": len(ids_before_restart)})
            if now >= next_churn:
                victim = churn.pop(0)
                swarm.kill(victim, signal.SIGKILL)
                owners.pop(victim)
                events.append({"t": now, "event": "kill -9", "peer": victim})
                new_churner()
                next_churn += args.churn_min * 60
            if now >= next_sample:
                procs = sample_processes(owners)
                db = sample_db(swarm.run_dir)
                samples.append({"t": now, "procs": procs, "db": {k: v for k, v in db.items()
                                                                 if k not in ("contributions", "checkpoints")}})
                if "metrics_max_id" in db:
                    db_seen["metrics_max_id"] = max(db_seen["metrics_max_id"], db["metrics_max_id"])
                    for key, value in db["contributions"].items():
                        db_seen["contributions"][key] = max(value, db_seen["contributions"].get(key, 0))
                    db_seen["checkpoints"] |= set(db["checkpoints"])
                for key, use in procs.items():
                    owner = key.split("/")[0]
                    if owner.startswith("churn"):
                        peaks[owner] = max(peaks.get(owner, 0.0), use["rss_mb"])
                total = sum(u["pss_mb"] for u in procs.values())
                try:
                    epoch = swarm.status().get("epoch")
                except OSError:
                    epoch = None
                print(f"  {now / 60:6.1f} min  epoch {epoch}  processes {len(procs)}  pss {total:7.1f} MB  "
                      f"db {db.get('size_bytes', 0) / 2**20:6.2f} MB  metrics {db.get('metrics_rows')}", flush=True)
                next_sample += args.sample_s
            time.sleep(1.0)
        final = sample_db(swarm.run_dir)
        final_ids = metrics_ids(swarm.run_dir)
        status = swarm.status()
    finally:
        swarm.close()

    lost_contributions = {k: v for k, v in db_seen["contributions"].items() if final["contributions"].get(k, -1) < v}
    kept = [name for name, pruned in final["checkpoints"].items() if not pruned]
    missing_on_disk = [name for name in kept if not (swarm.run_dir / "checkpoints" / name).exists()]
    survival = {
        "metrics_rows_final": final["metrics_rows"],
        "metrics_rows_lost_at_restart": len(ids_before_restart - final_ids),
        "metrics_max_id_seen": db_seen["metrics_max_id"], "metrics_max_id_final": final["metrics_max_id"],
        "contributions_final": len(final["contributions"]), "contributions_lost_or_shrunk": lost_contributions,
        "checkpoints_seen": len(db_seen["checkpoints"]),
        "checkpoints_lost": sorted(db_seen["checkpoints"] - set(final["checkpoints"])),
        "checkpoints_kept_on_disk_missing": missing_on_disk,
    }
    survival["nothing_lost"] = (not survival["metrics_rows_lost_at_restart"] and not lost_contributions
                                and not survival["checkpoints_lost"] and not missing_on_disk
                                and final["metrics_max_id"] >= db_seen["metrics_max_id"])
    window_s = args.window_min * 60
    growth = growth_report(samples, window_s)
    db_window = [(s["t"], s["db"].get("size_bytes", 0)) for s in samples if s["t"] >= samples[-1]["t"] - window_s]
    return {"args": vars(args), "events": events, "final_epoch": status.get("epoch"), "growth": growth,
            "all_flat": all(r[m]["flat"] for r in growth for m in ("rss_mb", "fds", "threads")),
            "db_growth_mb_per_hour": round(slope_per_hour(db_window) / 2**20, 3) if len(db_window) > 1 else None,
            "db_final_mb": round(final["size_bytes"] / 2**20, 2), "churned_peak_rss_mb": peaks,
            "survival": survival, "samples": samples}


def print_report(result: dict) -> None:
    print(f"\nfinal epoch {result['final_epoch']}; growth over the last {result['args']['window_min']:.0f} min "
          f"(per hour; 'flat' = within noise)")
    print(f"{'process':34s} {'RSS MB':>8s} {'MB/h':>8s} {'fds':>5s} {'fds/h':>7s} {'thr':>5s} {'thr/h':>7s}  verdict")
    for row in result["growth"]:
        flat = all(row[m]["flat"] for m in ("rss_mb", "fds", "threads"))
        print(f"{row['process']:34s} {row['rss_mb']['mean']:8.1f} {row['rss_mb']['per_hour']:8.2f} "
              f"{row['fds']['mean']:5.0f} {row['fds']['per_hour']:7.2f} {row['threads']['mean']:5.0f} "
              f"{row['threads']['per_hour']:7.2f}  {'flat' if flat else 'GROWS'}")
    print(f"database: {result['db_final_mb']} MB at the end, {result['db_growth_mb_per_hour']} MB/h")
    peaks = result["churned_peak_rss_mb"]
    if peaks:
        print("churned volunteers' peak RSS (MB, whole tree): "
              + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    s = result["survival"]
    print(f"survival: {s['metrics_rows_final']} metrics rows ({s['metrics_rows_lost_at_restart']} lost at the restart), "
          f"{s['contributions_final']} contributions ({len(s['contributions_lost_or_shrunk'])} lost or shrunk), "
          f"{s['checkpoints_seen']} checkpoints seen ({len(s['checkpoints_lost'])} lost, "
          f"{len(s['checkpoints_kept_on_disk_missing'])} kept ones missing on disk): "
          f"{'nothing lost' if s['nothing_lost'] else 'LOST DATA'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=120.0)
    p.add_argument("--window-min", type=float, default=90.0, help="growth is fitted over this last stretch")
    p.add_argument("--churn-min", type=float, default=10.0, help="kill one volunteer and start one this often")
    p.add_argument("--restart-min", type=float, default=20.0, help="restart the coordinator at this minute")
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--step-s", type=float, default=0.5, help="each volunteer's step is padded to this")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--target-batch", type=int, default=1024)
    p.add_argument("--checkpoint-every", type=int, default=20, help="epochs between the coordinator's checkpoints")
    p.add_argument("--out", default=f"/tmp/crowdtrain-soak-{time.strftime('%Y%m%d_%H%M%S')}")
    args = p.parse_args(argv)
    if args.restart_min * 60 >= args.minutes * 60 - args.window_min * 60 and args.restart_min < args.minutes:
        print("note: the coordinator restart falls inside the growth window; its new process is fitted "
              "only if it lived through the whole window", flush=True)
    result = run(args)
    print_report(result)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"soak_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0 if result["survival"]["nothing_lost"] and result["all_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
