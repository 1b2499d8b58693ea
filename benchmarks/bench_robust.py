"""Robust aggregation: final loss for every attack x aggregation rule, and what centered_clip costs.

Four peers (batch 16) train `tiny` on 127.0.0.1; in the attacked runs one of them sends crafted
tensors in every averaging round (``--inject-fault attack=NAME``, see crowdtrain.swarm.attacks).
The clean run has four honest peers; the ``absent`` row three (the attacker's seat left empty).
Loss = held-out loss of the three honest peers' final weights (mean). Both modes: sync
(gradients; 10 epochs of 384 samples) and DiLoCo (pseudo-gradients; 8 rounds of 768 samples).

Which clean run is the reference: an attacker found suspect stops counting toward the target
batch, so the three honest peers then process the whole target per round, as a swarm of three
would. In sync mode that changes nothing but time (an epoch is one step on 384 samples however
many peers share them). In DiLoCo mode each honest peer then takes a third more inner steps per
round than in the four-peer clean run, and at this early stage of training more inner steps per
round move the loss further: the three-peer run is the reference that isolates the attack.

Every peer pads its steps to ``STEP_S`` seconds (``--simulated-step-s``, one thread). Without
that, four peers flat out on a shared 2-core machine do unequal and run-to-run different numbers
of steps, overshoot the round's target by different amounts, and the final loss of two clean
DiLoCo runs differed by 20%: more than the effect to measure. Each peer also keeps its peer ID
(``--identity``) from run to run, and with it its data order. The clean run is repeated
(``--clean-repeats``) so the table shows the run-to-run spread that is left next to the attacks.

Cost of centered_clip: the time reducers spend aggregating per round (measured in the runs,
mean vs centered_clip), and a micro-benchmark of one reducer's aggregation for the slice a
peer reduces in a 4-peer group, for the tiny, demo and paper presets.

    python benchmarks/bench_robust.py [--modes sync diloco] [--attacks absent scale sign_flip noise nan bias]
                                      [--clean-repeats 3] [--no-clean] [--rules mean centered_clip]

Runs of the modes and attacks not run this time are kept from the last results file, so parts
of the table can run apart.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.swarm_runs import initial_loss, run  # noqa: E402
from crowdtrain.swarm.attacks import ATTACKS  # noqa: E402
from crowdtrain.swarm.robust import CenteredClipAggregator, MeanAggregator  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ABSENT = "absent"  # a clean run of the three honest peers alone
STEP_S = 0.3  # real steps of `tiny` at batch 16 take 0.1-0.3 s here with four peers on two cores
COMMON = {"matchmaking_time_s": 3.0, "averaging_timeout_s": 30.0, "checkpoint_every_epochs": 100000}
MODES = {
    "sync": ({**COMMON, "mode": "sync", "target_batch_size": 384, "lr": 0.01, "warmup_epochs": 1,
              "total_epochs": 10}, 10),
    "diloco": ({**COMMON, "mode": "diloco", "target_batch_size": 768, "lr": 0.003, "warmup_epochs": 1,
                "total_epochs": 8}, 8),
}


def one_run(tmp: Path, mode: str, aggregation: str, attack: str | None, repeat: int = 0) -> dict:
    swarm, epochs = MODES[mode]
    pace = ["--simulated-step-s", str(STEP_S)]
    # The same peer IDs in every run, so the same data order (peers shuffle by their ID); the
    # attacker takes the fourth honest peer's.
    ids = {n: ["--identity", str(tmp / "identities" / f"{n}.key")] for n in ("a", "b", "c", "d")}
    peers = [(n, 16, pace + ids[n]) for n in ("a", "b", "c")]
    if attack != ABSENT:
        peers.append(("evil" if attack else "d", 16,
                      pace + ids["d"] + (["--inject-fault", f"attack={attack}"] if attack else [])))
    result = run(tmp / f"{mode}-{aggregation}-{attack or 'clean'}-{repeat}", swarm={**swarm, "aggregation": aggregation},
                 peers=peers, epochs=epochs)
    honest = {n: result["eval_loss"][n] for n in ("a", "b", "c")}
    reducer_s, rounds, dropped, suspected = 0.0, 0, 0, 0
    round_s = []
    for name in ("a", "b", "c"):
        stats = result["summaries"][name]["averaging"]
        part = stats.get("gradients") or stats.get("pseudo_gradients")
        reducer_s += part["aggregate_s"]
        rounds += part["rounds"]
        dropped += part["parts_dropped"]
        suspected += part.get("suspects_found", 0)
        round_s += [r["seconds"] for r in result["summaries"][name]["rounds"] if "seconds" in r]
    return {"mode": mode, "aggregation": aggregation, "attack": attack or "none",
            "loss": sum(honest.values()) / 3, "losses": honest, "reducer_s_per_round": reducer_s / max(1, rounds),
            "round_s": sum(round_s) / len(round_s) if round_s else None, "parts_dropped": dropped,
            # Rounds (summed over the honest peers) after which a peer found the attacker suspect,
            # and the samples the honest peers processed (with the attacker's counted: 3/4 of the target).
            "suspected": suspected, "honest_samples": sum(result["summaries"][n]["samples"] for n in ("a", "b", "c")),
            "wall_s": result["wall_s"], "codes": result["codes"], "step_s": STEP_S, "epochs": epochs,
            "steps_over_budget": sum(result["summaries"][n].get("over_budget_steps", 0) for n in ("a", "b", "c"))}


def micro(repeats: int = 5) -> list[dict]:
    """Aggregation time for one peer's slice (1/4 of the parameters) from 4 senders."""
    from crowdtrain.model import get_preset
    from crowdtrain.model.info import build_meta_model

    out = []
    part = 2**17  # hivemind's parts: 512 KB of fp32 before compression
    for preset in ("tiny", "demo", "paper"):
        params = sum(p.numel() for p in build_meta_model(get_preset(preset)).parameters())
        per_peer = params // 4
        n_parts = max(1, -(-per_peer // part))
        sample = [torch.randn(min(part, per_peer)) for _ in range(4)]
        weights = [16.0] * 4
        row = {"preset": preset, "params": params, "elements_reduced_per_peer": per_peer}
        for rule in (MeanAggregator(), CenteredClipAggregator(clip_radius=1.0, clip_iterations=3)):
            rule.aggregate(sample, weights)
            t0 = time.perf_counter()
            for _ in range(repeats):
                rule.aggregate(sample, weights)
            row[f"{rule.name}_s_per_round"] = (time.perf_counter() - t0) / repeats * n_parts
        row["extra_s_per_round"] = row["centered_clip_s_per_round"] - row["mean_s_per_round"]
        out.append(row)
    return out


def print_table(mode: str, runs: list[dict], start: float) -> None:
    """Attack x rule -> final loss, each cell vs the mean of the clean runs of the same rule, with
    four peers and (where run) three."""
    mine = [r for r in runs if r["mode"] == mode]

    def mean_loss(attack: str, aggregation: str) -> float | None:
        losses = [r["loss"] for r in mine if r["attack"] == attack and r["aggregation"] == aggregation]
        return sum(losses) / len(losses) if losses else None

    print(f"\n{mode}: final held-out loss of the honest peers (start {start:.3f}); in brackets: vs the mean "
          "of the clean runs with the same rule, four peers / three peers")
    print(f"{'attack':<11}{'mean':>28}{'centered_clip':>28}")
    for attack in ["none", ABSENT, *ATTACKS]:
        rows = [r for r in mine if r["attack"] == attack]
        for repeat in range(max([sum(r["aggregation"] == a for r in rows) for a in ("mean", "centered_clip")])):
            cells = []
            for aggregation in ("mean", "centered_clip"):
                same = [r for r in rows if r["aggregation"] == aggregation]
                if repeat >= len(same):
                    cells.append("-")
                    continue
                loss = same[repeat]["loss"]
                refs = [mean_loss(a, aggregation) for a in ("none", ABSENT)]
                vs = " / ".join("-" if ref is None else f"{100 * (loss / ref - 1):+.0f}%" for ref in refs)
                cells.append(f"{loss:.3f} ({vs})")
            print(f"{attack:<11}{cells[0]:>28}{cells[1]:>28}")
    print("samples the three honest peers processed, and (in brackets) rounds after which an honest peer found the "
          "attacker suspect, summed over them")
    for attack in ["none", ABSENT, *ATTACKS]:
        cells = [", ".join(f"{r.get('honest_samples', '-')} ({r.get('suspected', '-')})" for r in mine
                           if r["attack"] == attack and r["aggregation"] == aggregation) or "-"
                 for aggregation in ("mean", "centered_clip")]
        print(f"{attack:<11}{cells[0]:>30} {cells[1]:>30}")
    per_round = {a: [r["reducer_s_per_round"] for r in mine if r["aggregation"] == a] for a in ("mean", "centered_clip")}
    if all(per_round.values()):
        means = {a: sum(v) / len(v) for a, v in per_round.items()}
        print(f"reducer time per round and peer: mean {means['mean'] * 1e3:.1f} ms, centered_clip "
              f"{means['centered_clip'] * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--attacks", nargs="+", default=[ABSENT, *ATTACKS], choices=[ABSENT, *ATTACKS])
    parser.add_argument("--clean-repeats", type=int, default=3,
                        help="clean runs (four peers, and three: 'absent') per mode and rule (default 3)")
    parser.add_argument("--no-clean", action="store_true", help="skip the four-peer clean runs")
    parser.add_argument("--rules", nargs="+", default=["mean", "centered_clip"], choices=["mean", "centered_clip"])
    parser.add_argument("--micro-only", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"micro": micro()}
    print("centered_clip vs mean, one reducer's slice in a 4-peer group (1 thread):")
    for row in results["micro"]:
        print(f"  {row['preset']:<6}{row['params'] / 1e6:>8.1f}M params: mean {row['mean_s_per_round']:.4f}s, "
              f"centered_clip {row['centered_clip_s_per_round']:.4f}s per round (+{row['extra_s_per_round']:.4f}s)")
    out = RESULTS / "bench_robust.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Runs not asked for this time stay in the table (one mode takes about 25 minutes here).
    planned = ([] if args.no_clean else [None]) + args.attacks
    kept = json.loads(out.read_text()).get("runs", []) if out.is_file() else []
    runs = results["runs"] = [r for r in kept if args.micro_only or r["mode"] not in args.modes
                              or r["attack"] not in [a or "none" for a in planned] or r["aggregation"] not in args.rules]
    if not args.micro_only:
        tmp = Path(tempfile.mkdtemp(prefix="bench-robust-"))
        for mode in args.modes:
            for attack in planned:
                for repeat in range(args.clean_repeats if attack in (None, ABSENT) else 1):
                    for aggregation in args.rules:
                        runs.append(one_run(tmp, mode, aggregation, attack, repeat))
                        print(json.dumps(runs[-1]), flush=True)
                        out.write_text(json.dumps(results, indent=2))
        results["initial_loss"] = initial_loss()
        for mode in sorted({r["mode"] for r in runs}, key=list(MODES).index):
            print_table(mode, runs, results["initial_loss"])
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
