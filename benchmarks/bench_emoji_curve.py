"""Which model, how much data and how long a schedule for the real-picture demo
(``crowdtrain demo --data emoji``): validation loss against samples for a few model sizes, in one
process on the emoji shards the demo makes.

Each arm trains the ``demo`` preset with some fields replaced (``ARMS``), AdamW at the laptop
preset's inner rate (3e-3, what every DiLoCo peer runs), batch 32, with the learning rate sized to
decay to zero at ``--samples``; a checkpoint every ``--samples / --points`` samples. Each
checkpoint is scored on the fixed rows of every split: ``train`` (a fixed 512-row subset: the
training loss without the noise of a batch), ``valid`` (fresh renderings of seen compositions)
and ``heldout`` (compositions never trained on), and the last one also by the data's judge
(``crowdtrain eval``: seen prompts recognisable, held-out compositions right in both parts).

One process at batch 32 stands in for the swarm: a DiLoCo swarm takes about as many inner steps
per sample (tests/test_diloco.py and bench_quality.py compare the two), so a curve's samples are
what a swarm of the same total speed processes. A 3-peer swarm on this 2-core machine does
about 80 samples/s, so 30 minutes are about 140k samples.

    python benchmarks/bench_emoji_curve.py [--arms demo,w96,w192] [--samples 60000] [--points 6]

Writes ``benchmarks/results/bench_emoji_curve_<time>.json`` and the plot ``docs/img/emoji-curve.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"
PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "emoji-curve.png"
# Fields of the demo preset replaced per arm. The demo preset: width 128, 8 layers (5 unique:
# four shared axial layers and one conv-like), 4 heads of 32.
ARMS = {
    "demo": {},
    "w96": {"width": 96, "heads": 4, "head_dim": 24},
    "w192": {"width": 192, "heads": 6, "head_dim": 32},
    "unshared": {"share_ids": tuple(range(8))},
}


def model_config(shards: Path, overrides: dict):
    """The demo preset sized to the shards' tokenizers, as the coordinator sizes it."""
    from crowdtrain.coordinator.run import image_tokenizer_layout, text_vocab_size
    from crowdtrain.model.config import get_preset

    vocab, factors = image_tokenizer_layout(shards / "image_tokenizer.safetensors")
    return get_preset("demo", image_vocab_size=vocab, image_code_factors=factors, **overrides), \
        text_vocab_size(shards / "text_tokenizer.json")


def train_arm(out: Path, shards: Path, *, overrides: dict, samples: int, points: int, batch_size: int,
              lr: float, seed: int) -> list[dict]:
    from crowdtrain.checkpoint import list_checkpoints, read_meta
    from crowdtrain.train.local import LocalTrainConfig, train_local
    from crowdtrain.train.task import DalleTask

    config, n_text = model_config(shards, overrides)
    assert n_text <= config.text_vocab_size, (n_text, config.text_vocab_size)
    task = DalleTask(config, data=str(shards), text_tokenizer=shards / "text_tokenizer.json")
    steps = max(1, samples // batch_size)
    train_local(task, LocalTrainConfig(batch_size=batch_size, max_steps=steps, lr=lr, warmup_steps=max(1, steps // 20),
                                       save_every_steps=max(1, steps // points), out_dir=str(out), seed=seed,
                                       log_every=100),
                assets={"text_tokenizer.json": shards / "text_tokenizer.json",
                        "image_tokenizer.safetensors": shards / "image_tokenizer.safetensors"})
    found = []
    for ckpt in list_checkpoints(out / "checkpoints"):
        run = read_meta(ckpt)["run"]
        found.append({"checkpoint": str(ckpt), "samples": run["samples"], "seconds": run["seconds"]})
    return found


def score(points: list[dict], shards: Path, *, judge_samples: int) -> list[dict]:
    from crowdtrain.checkpoint import load_checkpoint
    from crowdtrain.data.tokenizers import load_text_tokenizer
    from crowdtrain.train.validate import evaluate_quality, valid_loss, valid_rows

    train_rows = None
    for i, p in enumerate(points):
        last = i == len(points) - 1
        q = evaluate_quality(p["checkpoint"], data=str(shards), max_rows=512, adherence=last,
                             samples_per_prompt=judge_samples)
        model, _ = load_checkpoint(p["checkpoint"])
        if train_rows is None:
            train_rows = valid_rows(shards, text_tokenizer=load_text_tokenizer(shards / "text_tokenizer.json"),
                                    model_config=model.config, split="train", max_rows=512)
        p["train_loss"] = valid_loss(model, train_rows)
        p["losses"] = {split: v["loss"] for split, v in q["losses"].items()}
        if last:
            p["adherence_seen"], p["adherence_heldout"] = q["adherence_seen"], q["adherence_heldout"]
            p["judge"] = q.get("judge")
            p["adherence"] = q.get("adherence")
        logging.info("%s: %d samples: train %.4f, %s%s", Path(p["checkpoint"]).name, p["samples"], p["train_loss"],
                     ", ".join(f"{k} {v:.4f}" for k, v in p["losses"].items()),
                     f"; judge {p['adherence_seen']:.2f} seen / {p['adherence_heldout']:.2f} held-out" if last
                     and p.get("adherence_seen") is not None else "")
    return points


def plot(results: dict, path: Path) -> None:
    """One panel per schedule length: arms that ran the same number of samples share axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict = {}
    for arm, r in results["arms"].items():
        panels.setdefault(round(r["points"][-1]["samples"] / 1000), []).append((arm, r))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (k, arms) in zip(axes[0], sorted(panels.items())):
        for i, (arm, r) in enumerate(arms):
            pts = r["points"]
            xs = [p["samples"] / 1000 for p in pts]
            ax.plot(xs, [p["train_loss"] for p in pts], ":", color=f"C{i}",
                    label=f"{arm} ({r['parameters'] / 1e6:.1f}M): train")
            ax.plot(xs, [p["losses"].get("valid") for p in pts], "-o", color=f"C{i}", label=f"{arm}: valid")
            if any("heldout" in p["losses"] for p in pts):
                ax.plot(xs, [p["losses"].get("heldout") for p in pts], "--", color=f"C{i}",
                        label=f"{arm}: held-out")
        ax.set_xlabel("samples (thousands)")
        ax.set_ylabel("loss")
        ax.set_title(f"schedules of {k}k samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("emoji data: loss against samples, one process, AdamW 3e-3, batch 32")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def _renderings(data: str) -> str:
    recipe = Path(data) / "emoji.json"
    if recipe.exists():
        return f"{json.loads(recipe.read_text()).get('renderings', '?')}r"
    match = re.search(r"x(\d+)-", data)  # the demo cache names its folder <bases>-<n>x<renderings>-<hash>
    return f"{match.group(1)}r" if match else "?r"


def merge(paths: list, *, out: Path, plot_path: Path) -> int:
    """Several runs (arms at different schedule lengths or data sizes) as one table and plot."""
    merged = {"merged_from": [], "arms": {}}
    for path in paths:
        r = json.loads(Path(path).read_text())
        merged["merged_from"].append({"file": Path(path).name, "data": r["data"], "samples": r["samples"],
                                      "batch_size": r["batch_size"], "lr": r["lr"], "threads": r["threads"],
                                      "started": r["started"]})
        for arm, a in r["arms"].items():
            merged["arms"][f"{arm} {_renderings(r['data'])} {r['samples'] // 1000}k"] = a
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1))
    print_table(merged)
    plot(merged, plot_path)
    print(f"wrote {out} and {plot_path}")
    return 0


def print_table(results: dict) -> None:
    print(f"\n{'arm':18} {'params':>8} {'samples':>8} {'s':>6} {'train':>7} {'valid':>7} {'heldout':>7} "
          f"{'v/t':>5} {'seen':>5} {'held':>5}")
    for arm, r in results["arms"].items():
        for p_ in r["points"]:
            v = p_["losses"].get("valid")
            print(f"{arm:18} {r['parameters'] / 1e6:7.2f}M {p_['samples']:8d} {p_['seconds']:6.0f} "
                  f"{p_['train_loss']:7.4f} {v if v is not None else float('nan'):7.4f} "
                  f"{p_['losses'].get('heldout', float('nan')):7.4f} "
                  f"{(v / p_['train_loss']) if v else float('nan'):5.2f} "
                  f"{p_.get('adherence_seen') if p_.get('adherence_seen') is not None else '':>5} "
                  f"{p_.get('adherence_heldout') if p_.get('adherence_heldout') is not None else '':>5}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="emoji shard folder (default: the demo's, made once)")
    p.add_argument("--arms", default="demo,w96,w192")
    p.add_argument("--samples", type=int, default=60_000, help="samples per arm (the schedule's length)")
    p.add_argument("--points", type=int, default=6, help="checkpoints per arm")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--judge-samples", type=int, default=8, help="samples per prompt for the judge (last point)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/bench_emoji_curve_<time>.json)")
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--merge", nargs="+", metavar="RESULTS.json", default=None,
                   help="train nothing: join earlier results (arms named '<arm> <renderings>r <samples/1000>k') "
                        "into --out and plot them together")
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, out=Path(args.out) if args.out else RESULTS / "bench_emoji_curve_merged.json",
                     plot_path=Path(args.plot))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import torch

    from crowdtrain.model.transformer import DalleTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.data:
        shards = Path(args.data)
    else:
        from crowdtrain.data.emoji import ensure_emoji_shards

        shards = Path(ensure_emoji_shards(Path(tempfile.gettempdir()) / "crowdtrain-emoji", progress=True))
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; choose from {sorted(ARMS)}")
    results = {"data": str(shards), "samples": args.samples, "batch_size": args.batch_size, "lr": args.lr,
               "threads": torch.get_num_threads(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "arms": {}}
    out = Path(args.out) if args.out else RESULTS / f"bench_emoji_curve_{time.strftime('%Y%m%d_%H%M%S')}.json"
    for arm in arms:
        config, _ = model_config(shards, ARMS[arm])
        parameters = sum(p.numel() for p in DalleTransformer(config).parameters())
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"emoji-curve-{arm}-") as tmp:
            points = train_arm(Path(tmp), shards, overrides=ARMS[arm], samples=args.samples, points=args.points,
                               batch_size=args.batch_size, lr=args.lr, seed=args.seed)
            train_s = time.perf_counter() - t0
            points = score(points, shards, judge_samples=args.judge_samples)
        for p_ in points:
            p_.pop("checkpoint", None)
        results["arms"][arm] = {"overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in ARMS[arm].items()},
                                "parameters": parameters, "train_s": train_s, "points": points}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))  # after every arm: a long run keeps what it measured
    print_table(results)
    plot(results, Path(args.plot))
    print(f"wrote {out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
