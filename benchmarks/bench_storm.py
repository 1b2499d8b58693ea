"""A newcomer storm on home links: four volunteers join a three-peer run at the same moment.

Runs in the testbed (``crowdtrain.testbed``: network namespaces, shaped links; needs root), on a
5.6M-parameter model: three peers on 10/50 Mbit/s links train; after their first step, four more
join at once and each downloads the state through some peer's 10 Mbit/s uplink (about 20 s
alone). Epochs of the grown swarm last about 25 s, longer than a download, as a run should be
sized (``crowdtrain.testbed.suite.storm``). Two
settings: ``max_state_uploads=1`` (crowdtrain's, a busy donor turns a newcomer to the next) and
unbounded (hivemind's: a donor chosen by several newcomers splits its uplink between them).

Per newcomer: the donor, the download time, the time from its start to its first step with the
swarm, and how many epochs after joining its samples were first credited (the target: within 2).

    python benchmarks/bench_storm.py [--minutes 4] [--repeats 1]   # JSON in benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crowdtrain.swarm.hivemind_seam.state import DOWNLOADED_FROM  # noqa: E402
from crowdtrain.testbed.suite import storm  # noqa: E402
from crowdtrain.testbed.swarm import run_plan  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def storm_stats(raw: dict, out_dir: Path) -> dict:
    summaries = {name: s for name, s in raw["peers"].items() if s}
    names = {s["peer_id"]: name for name, s in summaries.items()}
    run = json.loads((out_dir / "run" / "run.json").read_text())
    names[run["coordinator_peer_id"]] = "coordinator"
    joins = {e["peer"]: e["unix"] for e in raw["events"] if e["event"] == "join" and e["unix"] >= raw["t0"]}
    newcomers = {}
    for name, joined_unix in joins.items():
        s = summaries.get(name, {})
        log = (out_dir / "logs" / f"{name}.log").read_text(errors="replace")
        downloads = [(float(t), names.get(peer, peer[-8:])) for t, peer in DOWNLOADED_FROM.findall(log)]
        credited = [c["epoch"] for c in s.get("credits", []) if c["credited"]]
        newcomers[name] = {
            "donor": downloads[0][1] if downloads else None, "download_s": downloads[0][0] if downloads else None,
            "downloads": len(downloads), "state_load_s": s.get("state_load_s"),
            "first_step_s": s["first_epoch_unix"] - joined_unix if s.get("first_epoch_unix") else None,
            "epochs_to_contribute": credited[0] - s["joined_epoch"] if credited and "joined_epoch" in s else None}
    donors: dict[str, int] = {}
    for r in newcomers.values():
        if r["donor"]:
            donors[r["donor"]] = donors.get(r["donor"], 0) + 1
    return {"newcomers": newcomers, "donors": donors,
            "uploads": {name: s.get("state_uploads") for name, s in summaries.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default="runs/bench-storm")
    args = p.parse_args(argv)
    results = []
    for repeat in range(args.repeats):
        for label, limit in (("crowdtrain (max_state_uploads=1)", 1), ("hivemind (unbounded)", 1000)):
            plan = storm(args.minutes, max_state_uploads=limit, name=f"storm-{limit}-{repeat}")
            out_dir = Path(args.out) / plan.name
            raw = run_plan(plan, out_dir)
            results.append({"setting": label, "max_state_uploads": limit, "repeat": repeat,
                            **storm_stats(raw, out_dir)})
    print(f"\n{'setting':34s} {'newcomer':8s} {'donor':12s} {'download s':>10s} {'first step s':>12s} "
          f"{'epochs to credit':>16s}")
    for r in results:
        for name, n in r["newcomers"].items():
            def fmt(v, spec):
                return format(v, spec) if v is not None else "-"
            print(f"{r['setting']:34s} {name:8s} {str(n['donor']):12s} {fmt(n['download_s'], '10.1f')} "
                  f"{fmt(n['first_step_s'], '12.1f')} {fmt(n['epochs_to_contribute'], '16d')}")
        print(f"{'':34s} donors: {r['donors']}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_storm_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
