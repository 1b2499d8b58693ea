"""Does training together produce a model that works? Held-out loss and prompt adherence against
samples processed and wall time, for one process and for 3-peer swarms, on the demo model and data.

Arms (``--arms``), each on this machine, each for ``--minutes`` (schedules sized to that time):

- ``solo``: one process, AdamW, batch 32, lr 3e-3 (``crowdtrain train``), two threads;
- ``sync``: three peers in sync mode with the ``demo`` swarm preset (LAMB 8-bit, lr 0.1, a
  256-sample global batch, delayed updates), the paper's way of training together;
- ``diloco``: three peers in DiLoCo mode with the ``laptop`` preset (AdamW inner steps at lr 3e-3,
  the peers' models averaged every 768 samples): what ``crowdtrain demo`` runs.

Equivalence (``solo-lamb`` and ``sync-equal``, by epochs, not minutes): the same optimizer and
schedule, the same global batch of 256, the same number of steps (``--equal-epochs``), no delayed
update: one process with the whole batch and a 3-peer sync swarm whose peers split it unevenly
(batches 32, 16 and a slow 8). The swarm's held-out loss should be that of the one process
(tests/test_equivalence.py checks the maths of one round exactly).

The swarms are the ``crowdtrain demo`` launcher's: a coordinator and three volunteers as real
processes (batch 32, 16, and 8 on a slow device padded to 1.5 s a step). Points on the curves
are checkpoints (every few epochs for swarms, every ``--save-every-s`` seconds' worth of steps
for one process), each scored afterwards on the 256-image valid split and on the 16 fixed eval
prompts (``crowdtrain eval``, ``--samples-per-prompt`` samples each). Samples processed at a
swarm's checkpoint is what its peers had contributed by then (from their per-epoch records).

Factors (``f-*`` arms, one process, ``--factor-samples`` each): what sync mode's settings cost
per sample, one at a time: the shipped 150-epoch schedule, the global batch of 256 against
8x more updates at 32, LAMB against AdamW (see ``FACTORS``).

    python benchmarks/bench_quality.py [--arms solo,sync,diloco,solo-lamb,sync-equal] [--minutes 5]
    python benchmarks/bench_quality.py --arms f-shipped,f-sized,f-lamb-b32,f-adamw-b256,f-adamw-b32

Writes ``benchmarks/results/bench_quality_<time>.json`` and the plot ``docs/img/quality.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "quality.png"
ARMS = ("solo", "sync", "diloco", "solo-lamb", "sync-equal")
# What makes sync mode learn less per sample, one change at a time, in one process (the maths of
# a sync swarm without its network: tests/test_equivalence.py), for ``--factor-samples`` samples:
# (optimizer, batch, peak lr, warm-up steps, schedule length in steps or None = the run's length).
FACTORS = {
    "f-shipped": ("lamb8bit", 256, 0.01, 5, 150),  # the shipped demo's sync settings
    "f-sized": ("lamb8bit", 256, 0.01, 5, None),  # ... with the schedule ending when the run does
    "f-lamb-b32": ("lamb8bit", 32, 0.01, 40, None),  # ... and 8x the updates (an 8x smaller global batch)
    "f-lamb-lr0.03": ("lamb8bit", 256, 0.03, 5, None),  # f-sized at 3x and 10x LAMB's rate: the real LAMB
    "f-lamb-lr0.1": ("lamb8bit", 256, 0.1, 5, None),  # moves each layer by about lr times its norm a step
    "f-adamw-b256": ("adamw", 256, 3e-3, 5, None),  # the demo's optimizer at the sync batch
    "f-adamw-b32": ("adamw", 32, 3e-3, 40, None),  # one process's best (= the solo arm, by samples)
    # The paper's model options on the demo model, against f-adamw-b32:
    "f-token-shift": ("adamw", 32, 3e-3, 40, None, {"token_shift": True}),
    "f-layer-scale": ("adamw", 32, 3e-3, 40, None, {"layer_scale": True}),
    "f-both": ("adamw", 32, 3e-3, 40, None, {"token_shift": True, "layer_scale": True}),
}
EQUAL = {"target_batch_size": 256, "lr": 0.01, "warmup_epochs": 5, "delay_optimizer_step": False,
         "checkpoint_every_epochs": 5}


def run_solo(out: Path, data: str, *, minutes: float | None, optimizer: str, batch_size: int, lr: float,
             max_steps: int, warmup_steps: int, save_every_steps: int, schedule_steps: int | None = None,
             model_overrides: dict | None = None) -> list[dict]:
    from crowdtrain.data import default_asset_paths
    from crowdtrain.model.config import get_preset
    from crowdtrain.train.local import LocalTrainConfig, train_local
    from crowdtrain.train.task import DalleTask

    task = DalleTask(get_preset("demo", **(model_overrides or {})), data=data)
    config = LocalTrainConfig(batch_size=batch_size, max_steps=max_steps, max_minutes=minutes, lr=lr,
                              optimizer=optimizer, warmup_steps=warmup_steps, save_every_steps=save_every_steps,
                              schedule_steps=schedule_steps, out_dir=str(out), log_every=50)
    train_local(task, config, assets=default_asset_paths())
    from crowdtrain.checkpoint import list_checkpoints, read_meta

    points = []
    for ckpt in list_checkpoints(out / "checkpoints"):
        run = read_meta(ckpt)["run"]
        points.append({"checkpoint": str(ckpt), "samples": run["samples"], "seconds": run["seconds"]})
    return points


def run_swarm(out: Path, *, minutes: float, swarm_preset: str, overrides: dict, max_epochs: int | None = None,
              port: int, dht_port: int) -> list[dict]:
    from crowdtrain.checkpoint import list_checkpoints, read_meta
    from crowdtrain.train.demo import run_swarm_demo

    started = time.time()
    run_swarm_demo(minutes=minutes, port=port, dht_port=dht_port, out_dir=str(out), swarm_preset=swarm_preset,
                   swarm_overrides=overrides, evaluate=False, max_epochs=max_epochs,
                   coordinator_args=["--keep-checkpoints", "1000", "--samples-every", "0"])
    peers = [json.loads(p.read_text()) for p in sorted(out.glob("peer*.json"))]
    points = []
    for ckpt in list_checkpoints(out / "run" / "checkpoints"):
        meta = read_meta(ckpt)
        at = meta["time"]
        samples = 0
        for peer in peers:
            done = [e["samples"] for e in peer.get("epochs", []) if e["unix"] <= at]
            samples += done[-1] if done else 0
        points.append({"checkpoint": str(ckpt), "epoch": meta["step"], "samples": samples, "seconds": at - started})
    return points


def score(points: list[dict], data: str, *, samples_per_prompt: int, max_points: int) -> list[dict]:
    """Evaluate up to ``max_points`` checkpoints, evenly spread, always the last."""
    from crowdtrain.train.validate import evaluate_quality

    if len(points) > max_points:
        step = (len(points) - 1) / (max_points - 1)
        points = [points[round(i * step)] for i in range(max_points)]
    for p in points:
        q = evaluate_quality(p["checkpoint"], data=data, samples_per_prompt=samples_per_prompt)
        p.update({k: q[k] for k in ("valid_loss", "adherence_seen", "adherence_heldout", "objects_seen",
                                    "objects_heldout")})
        logging.info("%s: %d samples, %.0f s: held-out loss %.4f, adherence %.2f seen / %.2f held-out",
                     Path(p["checkpoint"]).name, p["samples"], p["seconds"], p["valid_loss"], p["adherence_seen"],
                     p["adherence_heldout"])
    return points


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for i, (arm, r) in enumerate(results["arms"].items()):
        color = f"C{i}"
        pts = r["points"]
        x_samples = [p["samples"] / 1000 for p in pts]
        x_minutes = [p["seconds"] / 60 for p in pts]
        style = "--" if arm in ("solo-lamb", "sync-equal") else "-"
        axes[0][0].plot(x_samples, [p["valid_loss"] for p in pts], style, marker="o", label=arm, color=color)
        axes[0][1].plot(x_minutes, [p["valid_loss"] for p in pts], style, marker="o", label=arm, color=color)
        axes[1][0].plot(x_samples, [p["adherence_seen"] for p in pts], style, marker="o", label=f"{arm} seen",
                        color=color)
        axes[1][0].plot(x_samples, [p["adherence_heldout"] for p in pts], ":", marker="x", label=f"{arm} held-out",
                        color=color)
        axes[1][1].plot(x_minutes, [p["adherence_seen"] for p in pts], style, marker="o", label=f"{arm} seen",
                        color=color)
    axes[0][0].set(xlabel="thousand samples processed", ylabel="held-out loss")
    axes[0][1].set(xlabel="minutes", ylabel="held-out loss")
    axes[1][0].set(xlabel="thousand samples processed", ylabel="prompt adherence", ylim=(-0.02, 1.02))
    axes[1][1].set(xlabel="minutes", ylabel="prompt adherence (seen)", ylim=(-0.02, 1.02))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"demo model on shapes, 2-core CPU ({results['date']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def table(results: dict) -> str:
    lines = [f"{'arm':13s} {'minutes':>7s} {'samples':>8s} {'held-out loss':>13s} {'seen':>5s} {'held-out':>8s}"]
    for arm, r in results["arms"].items():
        last = r["points"][-1]
        lines.append(f"{arm:13s} {last['seconds'] / 60:7.1f} {last['samples']:8d} {last['valid_loss']:13.4f} "
                     f"{last['adherence_seen']:5.2f} {last['adherence_heldout']:8.2f}")
    if {"solo-lamb", "sync-equal"} <= set(results["arms"]):
        # At the swarm's last checkpoint, against one process at the same samples (interpolated
        # between its checkpoints): a swarm's epochs hold a little more than the target (peers
        # overshoot it), and the coordinator's checkpoints land between epochs.
        swarm = results["arms"]["sync-equal"]["points"][-1]
        solo = results["arms"]["solo-lamb"]["points"]
        a = _interpolate([(p["samples"], p["valid_loss"]) for p in solo], swarm["samples"])
        b = swarm["valid_loss"]
        lines.append(f"equivalence: at {swarm['samples']} samples, sync swarm {b:.4f} / one process {a:.4f} "
                     f"held-out loss = {b / a:.3f} ({100 * (b / a - 1):+.1f}%)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--minutes", type=float, default=5.0, help="training time of each timed arm")
    parser.add_argument("--equal-epochs", type=int, default=40, help="steps of the two equivalence arms")
    parser.add_argument("--factor-samples", type=int, default=15_000, help="samples of each f-* arm")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--points", type=int, default=4, help="checkpoints scored per arm")
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--replot", default=None, metavar="JSON", help="only re-draw the table and plot of a result")
    args = parser.parse_args()
    if args.replot:
        results = json.loads(Path(args.replot).read_text())
        print(table(results))
        plot(results, PLOT)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS) - set(FACTORS))
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {ARMS + tuple(FACTORS)}")

    from crowdtrain.data import ensure_demo_shards

    work = Path(args.out or tempfile.mkdtemp(prefix="bench_quality_"))
    data = str(ensure_demo_shards(work / "data", progress=True))
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "minutes": args.minutes, "equal_epochs": args.equal_epochs,
               "samples_per_prompt": args.samples_per_prompt, "arms": {}}
    steps_for_5_points = None
    for i, arm in enumerate(arms):
        out = work / arm
        t0 = time.time()
        swarm_ports = {"port": args.port + i, "dht_port": args.port + 100 + i}
        if arm in FACTORS:
            optimizer, batch, lr, warmup, schedule, *model = FACTORS[arm]
            steps = max(warmup + 1, args.factor_samples // batch)
            points = run_solo(out, data, minutes=None, optimizer=optimizer, batch_size=batch, lr=lr, max_steps=steps,
                              warmup_steps=warmup, save_every_steps=max(1, steps // 3), schedule_steps=schedule,
                              model_overrides=model[0] if model else {})
        elif arm == "solo":
            points = run_solo(out, data, minutes=args.minutes, optimizer="adamw", batch_size=32, lr=3e-3,
                              max_steps=100_000, warmup_steps=50, save_every_steps=int(args.minutes * 60 * 1.6 / 6)
                              or 1)
        elif arm == "solo-lamb":
            steps_for_5_points = max(1, args.equal_epochs // 5)
            points = run_solo(out, data, minutes=None, optimizer="lamb8bit", batch_size=EQUAL["target_batch_size"],
                              lr=EQUAL["lr"], max_steps=args.equal_epochs, warmup_steps=EQUAL["warmup_epochs"],
                              save_every_steps=steps_for_5_points)
        elif arm == "sync":
            points = run_swarm(out, minutes=args.minutes, swarm_preset="demo", overrides={}, **swarm_ports)
        elif arm == "diloco":
            points = run_swarm(out, minutes=args.minutes, swarm_preset="laptop", overrides={}, **swarm_ports)
        else:  # sync-equal
            overrides = {**EQUAL, "total_epochs": args.equal_epochs, "checkpoint_every_epochs":
                         max(1, args.equal_epochs // 5)}
            points = run_swarm(out, minutes=60, swarm_preset="demo", overrides=overrides,
                               max_epochs=args.equal_epochs, **swarm_ports)
        if not points:
            raise RuntimeError(f"arm {arm} wrote no checkpoint; see {out}")
        results["arms"][arm] = {"train_s": time.time() - t0,
                                "points": score(points, data, samples_per_prompt=args.samples_per_prompt,
                                                max_points=args.points)}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_quality_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"results: {path}")
    if len(results["arms"]) >= 1:
        plot(results, PLOT)
        print(f"plot: {PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
