"""The promise of the project, measured: does a run reach a held-out loss sooner with more volunteers?

For each swarm size N (``--volunteers 1,2,4,8``) and mode (``--modes sync,diloco``): a fresh run
(a real ``crowdtrain coordinator`` on the bundled shapes, checkpointing and evaluating its held-out
split every epoch) and N ``crowdtrain join`` processes, each pinned to its own ``--cores`` cores
with ``taskset`` and as many torch threads, all joined at once. The clock starts when the last
volunteer joined; it stops at the first checkpoint whose held-out loss is at or below
``--target-loss``. The swarm's batch per epoch (``target_batch_size``) is the same for every N: more
volunteers fill it sooner, so the speed-up is the run's, with every round's cost in it.

It needs ``N * cores`` free cores for the largest N (plus one or two for the coordinator): a
16-core machine for 8 volunteers of 2 cores. Pick ``--target-loss`` from a pilot with one
volunteer (what it reaches in a few minutes): a target no N reaches within ``--budget-min`` is
reported as not reached.

    python benchmarks/bench_speedup.py --volunteers 1,2 --modes sync --budget-min 4   # 2 cores here: a smoke run
    python benchmarks/bench_speedup.py                                               # 16 cores: the table

Prints a table (time to the target, speed-up against one volunteer, epochs) and writes JSON under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crowdtrain.launch import LocalSwarm, cli, get_json, join_args, spawn, stop_all  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def first_below(history: list[dict], target: float) -> dict | None:
    """The first point of ``/api/history`` whose held-out loss is at or below ``target``."""
    for point in history:
        losses = [v for v in (point.get("valid_loss") or {}).values() if isinstance(v, (int, float))]
        if losses and sum(losses) / len(losses) <= target:
            return point
    return None


def one_run(n: int, mode: str, *, cores: int, target_loss: float, budget_s: float, batch: int, target_batch: int,
            folder: Path) -> dict:
    # The coordinator's presets for each mode (crowdtrain.runspec.swarm: demo for sync, laptop for
    # DiLoCo), over LocalSwarm's test defaults; a checkpoint (and held-out evaluation) every epoch.
    settings = ({"lr": 0.1, "warmup_epochs": 5, "target_batch_size": target_batch} if mode == "sync" else
                {"mode": "diloco", "inner_optimizer": "adamw", "lr": 3e-3, "target_batch_size": 3 * target_batch})
    swarm = LocalSwarm(folder, preset="demo", data="shapes", swarm={
        **settings, "checkpoint_every_epochs": 1, "total_epochs": 10_000})
    folder.mkdir(parents=True, exist_ok=True)
    preset = "demo" if mode == "sync" else "laptop"
    available = sorted(os.sched_getaffinity(0))
    try:
        swarm.start_coordinator(timeout=600, extra=["--swarm-preset", preset])
        for i in range(n):
            mine = available[(i * cores) % len(available):][:cores] or available[:cores]
            argv = ["taskset", "-c", ",".join(map(str, mine)),
                    *cli(*join_args(swarm.url, user=f"v{i}", batch_size=batch, host="127.0.0.1", threads=cores,
                                    summary_file=folder / f"v{i}.json"))]
            swarm.procs[f"v{i}"] = spawn(argv, folder / f"v{i}.log", env=swarm.env)
        start = time.monotonic()
        started_unix = time.time()
        reached = None
        while time.monotonic() - start < budget_s and reached is None:
            time.sleep(5)
            history = [p for p in get_json(f"{swarm.url}/api/history", timeout=30) if p.get("time", 0) >= started_unix]
            reached = first_below(history, target_loss)
            if any(p.poll() is not None for name, p in swarm.procs.items() if name != "coordinator"):
                break
        return {"volunteers": n, "mode": mode, "cores_each": cores, "target_loss": target_loss,
                "reached": reached is not None,
                "seconds": round(reached["time"] - started_unix, 1) if reached else None,
                "epoch": reached.get("epoch") if reached else None,
                "valid_loss": reached.get("valid_loss") if reached else None}
    finally:
        stop_all(swarm.procs.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--volunteers", default="1,2,4,8")
    parser.add_argument("--modes", default="sync,diloco")
    parser.add_argument("--cores", type=int, default=2, help="cores (and torch threads) per volunteer")
    parser.add_argument("--target-loss", type=float, default=3.0, help="the held-out loss to reach")
    parser.add_argument("--budget-min", type=float, default=20.0, help="per run; not reached after it: reported so")
    parser.add_argument("--batch", type=int, default=16, help="each volunteer's batch")
    parser.add_argument("--target-batch", type=int, default=256,
                        help="the swarm's batch per epoch in sync mode, for every N (DiLoCo: three times it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = [int(x) for x in args.volunteers.split(",")]
    rows = []
    out = Path(args.out) if args.out else RESULTS / f"bench_speedup_{time.strftime('%Y%m%d_%H%M%S')}.json"
    with tempfile.TemporaryDirectory(prefix="speedup-") as tmp:
        for mode in args.modes.split(","):
            for n in sizes:
                row = one_run(n, mode, cores=args.cores, target_loss=args.target_loss, budget_s=60 * args.budget_min,
                              batch=args.batch, target_batch=args.target_batch, folder=Path(tmp) / f"{mode}-{n}")
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    print(f"\n| mode | volunteers ({args.cores} cores each) | time to held-out loss {args.target_loss:g} | "
          "speed-up vs 1 | epoch |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        one = next((o for o in rows if o["mode"] == r["mode"] and o["volunteers"] == 1 and o["reached"]), None)
        speedup = f"{one['seconds'] / r['seconds']:.2f}x" if one and r["reached"] else "-"
        took = f"{r['seconds']:.0f} s" if r["reached"] else f"not within {args.budget_min:g} min"
        print(f"| {r['mode']} | {r['volunteers']} | {took} | {speedup} | {r['epoch'] if r['reached'] else '-'} |")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
