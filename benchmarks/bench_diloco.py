"""Sync mode vs DiLoCo mode: loss reached vs bytes communicated, for the same total samples.

Three peers (batch 16, one thread each) train `tiny` on the pattern data on 127.0.0.1:

- sync: ``--epochs`` global epochs of 384 samples (the swarm tests' settings: LAMB lr 0.01);
- DiLoCo with R outer rounds over the same samples: ``target_batch_size = epochs * 384 / R``,
  i.e. H = target / (3 * 16) inner AdamW steps per peer per round (lr 3e-3, linear decay).

Every peer pads its steps to ``STEP_S`` seconds (``--simulated-step-s``, one thread) and keeps
its peer ID (``--identity``), hence its data order, from run to run: unpaced, three peers on two
shared cores do run-to-run different numbers of steps, and two identical DiLoCo runs differed by
7-17% in final loss (bench_robust), more than the differences to measure here.

Bytes are what the averagers put on the wire (serialized protobuf messages, after compression,
summed over peers): gradients + parameter averaging in sync mode, pseudo-gradients in DiLoCo
mode; matchmaking and DHT traffic are not counted. Loss is the held-out loss of each peer's
final weights (mean over peers). Compute utilization is measured on loopback (1 - time blocked
in averaging / total) and projected for a 10 Mbit/s uplink by adding each round's bytes / 1.25
MB/s to the blocked time; the measured 10 Mbit/s figures are in docs/testbed.md.

``--overlap-rounds`` adds DiLoCo runs with ``overlap_outer_round`` (inner steps go on during
each round, one-round-late outer steps) at those R, to show what the overlap costs in loss.

    python benchmarks/bench_diloco.py [--epochs 50] [--rounds 1 2 5 10] [--overlap-rounds 5 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.swarm_runs import initial_loss, run  # noqa: E402
from crowdtrain.model import get_preset  # noqa: E402
from crowdtrain.swarm.compression import wire_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEP_S = 0.3  # real steps of `tiny` at batch 16 take 0.1-0.3 s here with three peers on two cores
SYNC_TARGET = 384
UPLINK_BYTES_PER_S = 10e6 / 8
COMMON = {"matchmaking_time_s": 3.0, "averaging_timeout_s": 30.0, "checkpoint_every_epochs": 100000}


def paced_peers(tmp: Path) -> list[tuple[str, int, list[str]]]:
    return [(n, 16, ["--simulated-step-s", str(STEP_S), "--identity", str(tmp / "identities" / f"{n}.key")])
            for n in ("a", "b", "c")]


def summarise(label: str, result: dict, *, rounds_expected: int, h: float | None) -> dict:
    summaries = result["summaries"]
    samples = sum(s["samples"] for s in summaries.values())
    sent = sum(s["averaging"]["bytes_sent"] for s in summaries.values())
    grads = sum(s["averaging"].get("gradients", {}).get("bytes_sent", 0) for s in summaries.values())
    utilization, projected = [], []
    for s in summaries.values():
        blocked = s["averaging"].get("blocked_s", s["wait_s"])
        utilization.append(1 - blocked / s["seconds"])
        transfer = s["averaging"]["bytes_sent"] / UPLINK_BYTES_PER_S
        projected.append((s["seconds"] - blocked) / (s["seconds"] + transfer))
    losses = result["eval_loss"]
    return {"run": label, "h": h, "rounds": rounds_expected, "samples": samples, "bytes": sent,
            "gradient_bytes": grads, "loss": sum(losses.values()) / len(losses), "losses": losses,
            "wall_s": result["wall_s"], "utilization_loopback": sum(utilization) / len(utilization),
            "utilization_10mbit_projected": sum(projected) / len(projected), "codes": result["codes"]}


def paper_scale_note(h_steps: int = 500, step_s: float = 1.0) -> list[dict]:
    """Transfer time of one DiLoCo round per peer at 10 Mbit/s for bigger presets (no run)."""
    from crowdtrain.model.info import build_meta_model

    out = []
    for preset in ("demo", "paper"):
        numels = [p.numel() for p in build_meta_model(get_preset(preset)).parameters()]
        per_round = 2 * wire_bytes(numels)  # a peer sends at most 2 (N-1)/N < 2 copies
        transfer_s = per_round / UPLINK_BYTES_PER_S
        out.append({"preset": preset, "params": sum(numels), "bytes_per_round_per_peer": per_round,
                    "transfer_s_at_10mbit": transfer_s,
                    "compute_s_for_0.95_blocking": 19 * transfer_s,
                    "utilization_blocking_h500_1s_steps": h_steps * step_s / (h_steps * step_s + transfer_s)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=50, help="sync-mode global epochs (of 384 samples)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 2, 5, 10], help="DiLoCo outer rounds")
    parser.add_argument("--overlap-rounds", type=int, nargs="*", default=[5, 10],
                        help="DiLoCo outer rounds to also run with overlap_outer_round")
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_diloco.json", help="results JSON")
    args = parser.parse_args()
    total = args.epochs * SYNC_TARGET
    tmp = Path(tempfile.mkdtemp(prefix="bench-diloco-"))
    peers = paced_peers(tmp)
    rows = []
    if not args.skip_sync:
        result = run(tmp / "sync", swarm={**COMMON, "mode": "sync", "target_batch_size": SYNC_TARGET, "lr": 0.01,
                                          "warmup_epochs": 1, "total_epochs": args.epochs},
                     peers=peers, epochs=args.epochs)
        rows.append(summarise("sync", result, rounds_expected=args.epochs, h=SYNC_TARGET / 48))
        print(json.dumps(rows[-1]), flush=True)
    for r, overlap in [(r, False) for r in args.rounds] + [(r, True) for r in args.overlap_rounds]:
        target = total // r
        label = f"diloco R={r}" + (" ovl" if overlap else "")
        result = run(tmp / label.replace(" ", "-").replace("=", ""),
                     swarm={**COMMON, "mode": "diloco", "target_batch_size": target, "lr": 0.003,
                            "warmup_epochs": 0, "total_epochs": r, "overlap_outer_round": overlap},
                     peers=peers, epochs=r)
        rows.append(summarise(label, result, rounds_expected=r, h=target / 48))
        print(json.dumps(rows[-1]), flush=True)
    start = initial_loss()
    sync = next((row for row in rows if row["run"] == "sync"), None)
    print(f"\ntiny, 3 peers x batch 16, {total} samples in all; held-out loss at start {start:.3f}")
    print(f"{'run':<18}{'H':>7}{'rounds':>8}{'samples':>9}{'loss':>8}{'vs sync':>9}{'MB sent':>10}"
          f"{'x fewer':>9}{'util lo':>9}{'util 10M*':>10}")
    for row in rows:
        rel = f"{100 * (row['loss'] / sync['loss'] - 1):+.1f}%" if sync else "-"
        fewer = f"{sync['bytes'] / row['bytes']:.0f}x" if sync and row["bytes"] else "-"
        print(f"{row['run']:<18}{row['h']:>7.0f}{row['rounds']:>8}{row['samples']:>9}{row['loss']:>8.3f}{rel:>9}"
              f"{row['bytes'] / 1e6:>10.2f}{fewer:>9}{row['utilization_loopback']:>9.3f}"
              f"{row['utilization_10mbit_projected']:>10.3f}")
    print("* projected: each round's bytes at 10 Mbit/s added to the measured blocked time (overlapped "
          "rounds block only where they outlast an epoch: the projection overstates their cost); "
          "docs/testbed.md has the measured figures")
    notes = paper_scale_note()
    for n in notes:
        print(f"{n['preset']}: {n['params'] / 1e6:.0f}M params, {n['bytes_per_round_per_peer'] / 1e6:.0f} MB per round "
              f"per peer, {n['transfer_s_at_10mbit']:.0f}s at 10 Mbit/s; blocking rounds need "
              f"{n['compute_s_for_0.95_blocking']:.0f}s of compute between them for 0.95")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"total_samples": total, "initial_loss": start, "step_s": STEP_S, "runs": rows,
                               "bigger_presets": notes},
                              indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
