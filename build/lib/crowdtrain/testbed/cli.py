"""`crowdtrain testbed`: a swarm on emulated home links (network namespaces + tc; needs root)."""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "testbed", help="run a swarm on emulated home links and measure where it loses time (root)",
        description="Put the coordinator and every peer in its own network namespace on a link shaped by tc "
                    "token-bucket filters, run `crowdtrain coordinator` and `crowdtrain join` there, and "
                    "measure averaging rounds against the bandwidth floor, compute utilization and throughput. "
                    "Needs root. Only bandwidth is emulated (netem is not available: no added latency).")
    sub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)

    run = sub.add_parser("run", help="one swarm: N peers on one link rate",
                         description="Run N equal peers for some minutes; print and save the table "
                                     "(run.json, summary.json, table.txt, timeline.png in --out).")
    run.add_argument("--peers", type=int, default=4, help="number of peers")
    run.add_argument("--rate", default="100mbit", help="each peer's link: RATE or UP/DOWN, e.g. 100mbit, 10mbit/50mbit")
    run.add_argument("--minutes", type=float, default=3.0, help="measure for this long once every peer trains")
    run.add_argument("--epochs", type=int, default=None, help="or stop when the swarm reaches this epoch")
    run.add_argument("--step-s", type=float, default=3.0,
                     help="each peer's computation per step, padded to this (--simulated-step-s)")
    run.add_argument("--target-batch-size", type=int, default=None,
                     help="global batch (default: 30 s of computation per epoch, as in `testbed suite`)")
    run.add_argument("--no-delay", action="store_true", help="turn delayed parameter updates off")
    run.add_argument("--swarm", action="append", metavar="KEY=VALUE", help="other swarm settings (SwarmConfig)")
    run.add_argument("--model", action="append", metavar="KEY=VALUE",
                     help="model overrides on top of the 22M-parameter testbed model")
    run.add_argument("--out", default="runs/testbed", help="output folder")
    run.set_defaults(handler=_run)

    suite = sub.add_parser("suite", help="the benchmark matrix: N=2,4,8 at 100/10 Mbit/s, utilization, "
                                         "heterogeneity, churn (about an hour)")
    suite.add_argument("--out", default="runs/testbed-suite", help="output folder")
    suite.add_argument("--only", default=None, help="comma-separated run names (e.g. r100-n4,churn)")
    suite.add_argument("--scale", type=float, default=1.0, help="multiply every run's duration")
    suite.set_defaults(handler=_suite)

    rep = sub.add_parser("report", help="recompute a suite's tables and plot from its runs' raw results")
    rep.add_argument("--out", default="runs/testbed-suite", help="the suite's output folder")
    rep.set_defaults(handler=_report)

    check = sub.add_parser("check", help="build a 2-peer testbed and measure its links with real transfers")
    check.add_argument("--rate", default="20mbit/40mbit", help="the first peer's link (UP/DOWN)")
    check.set_defaults(handler=_check)

    clean = sub.add_parser("cleanup", help="delete namespaces left behind by a testbed that was killed")
    clean.add_argument("--all", action="store_true", help="also those of testbeds still running")
    clean.set_defaults(handler=_cleanup)


def _run(args) -> int:
    from crowdtrain.runspec.overrides import parse_overrides
    from crowdtrain.testbed import analysis, plot, report, suite
    from crowdtrain.testbed.links import LinkSpec
    from crowdtrain.testbed.netns import require_root
    from crowdtrain.testbed.swarm import MODEL_22M, PeerPlan, RunPlan, run_plan

    require_root()
    if args.peers < 1:
        raise ValueError(f"--peers must be >= 1, got {args.peers}")
    link = LinkSpec.parse(args.rate)
    swarm = {"target_batch_size": args.target_batch_size or suite.paper_batch(args.peers, step_s=args.step_s),
             "delay_optimizer_step": not args.no_delay, **parse_overrides(args.swarm, flag="--swarm")}
    plan = RunPlan(f"n{args.peers}-{link}".replace("/", "-"),
                   [PeerPlan(f"p{i + 1}", link, step_s=args.step_s) for i in range(args.peers)],
                   minutes=args.minutes, epochs=args.epochs, swarm=swarm,
                   model={**MODEL_22M, **parse_overrides(args.model, flag="--model")})
    out = Path(args.out)
    raw = run_plan(plan, out)
    summary = analysis.summarize(raw)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = report.run_table(summary)
    (out / "table.txt").write_text(table + "\n")
    png = plot.plot_run(raw, summary, out / "timeline.png")
    print("\n" + table + f"\n\nwrote {out / 'summary.json'}, {out / 'table.txt'}, {png}")
    return 0


def _suite(args) -> int:
    from crowdtrain.testbed import plot, report, suite
    from crowdtrain.testbed.netns import require_root

    require_root()
    out = Path(args.out)
    results = suite.run_suite(out, only=args.only.split(",") if args.only else None, scale=args.scale)
    tables = report.suite_tables(results)
    (out / "tables.txt").write_text(tables + "\n")
    png = plot.plot_suite(results, out, out / "suite.png")
    print("\n" + tables + f"\n\nwrote {out / 'suite.json'}, {out / 'tables.txt'}, {png}")
    return 0


def _report(args) -> int:
    from crowdtrain.testbed import plot, report, suite

    out = Path(args.out)
    results = suite.reanalyze(out)
    tables = report.suite_tables(results)
    (out / "tables.txt").write_text(tables + "\n")
    png = plot.plot_suite(results, out, out / "suite.png")
    print(tables + f"\n\nwrote {out / 'suite.json'}, {out / 'tables.txt'}, {png}")
    return 0


def _check(args) -> int:
    from crowdtrain.testbed import linkcheck
    from crowdtrain.testbed.links import LinkSpec, format_rate
    from crowdtrain.testbed.netns import Testbed

    link = LinkSpec.parse(args.rate)
    fast = LinkSpec(4 * max(link.up_bps, link.down_bps), 4 * max(link.up_bps, link.down_bps))
    with Testbed({"p1": link, "p2": fast}) as tb:
        up = linkcheck.measure(tb, "p1", "p2")
        down = linkcheck.measure(tb, "p2", "p1")
    print(f"p1 upload   {format_rate(up):>12} measured, {format_rate(link.up_bps)} asked ({up / link.up_bps:.2f}x)")
    print(f"p1 download {format_rate(down):>12} measured, {format_rate(link.down_bps)} asked "
          f"({down / link.down_bps:.2f}x)")
    return 0


def _cleanup(args) -> int:
    from crowdtrain.testbed.netns import require_root, sweep_stale

    require_root()
    removed = sweep_stale(everything=args.all)
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
    return 0
