"""`crowdtrain train` (one process) and `crowdtrain demo` (the main job on embedded defaults)."""

from __future__ import annotations

import argparse
import json
import logging

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a model in this one process (no swarm)",
        description="Train a preset on local data in one process: the single-peer reference. "
                    "Writes checkpoints and summary.json to --out.")
    _add_train_args(p)
    p.add_argument("--data", default="shapes",
                   help="'shapes' (the bundled data set, made on first use), a shard folder, an http(s) URL, "
                        "a hub id, or 'synthetic' (random tokens: for throughput only)")
    p.add_argument("--max-steps", type=int, default=1000, help="steps, and the length of the LR schedule")
    p.add_argument("--minutes", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--out", default="runs/train", help="output folder")
    p.set_defaults(handler=_train)

    d = subparsers.add_parser(
        "demo", help="the main job: a local swarm trains the demo model on the bundled shapes data",
        description="Makes the bundled shapes data set if missing, starts a coordinator and N volunteers of "
                    "different speeds and batch sizes on 127.0.0.1, prints a live summary, and at the end the "
                    "epochs reached, the loss from start to end, samples per peer and the share of rounds all "
                    "live peers averaged in; writes summary.json and a grid of samples to --out.")
    d.add_argument("--peers", type=int, default=3, help="volunteer processes (default: 3)")
    d.add_argument("--minutes", type=float, default=5.0, help="training time (default: 5)")
    d.add_argument("--port", type=int, default=8000, help="the coordinator's HTTP port")
    d.add_argument("--dht-port", type=int, default=31337, help="the coordinator's DHT port")
    d.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    d.add_argument("--data", choices=["shapes", "emoji"], default="shapes",
                   help="shapes: the bundled synthetic pictures (default); emoji: real pictures of emoji in six skin "
                        "tones (Debian's fonts-noto-color-emoji), through a learned tokenizer, judged on held-out "
                        "base x tone compositions")
    d.add_argument("--emoji-bases", default=None,
                   help="with --data emoji: which emoji (hands, people, activities joined with '+', or all; "
                        "default: hands)")
    d.add_argument("--emoji-renderings", type=int, default=None,
                   help="with --data emoji: pictures per seen composition in train (default: 200)")
    d.add_argument("--local", action="store_true", help="train in this one process instead of a swarm")
    d.add_argument("--device", default="cpu", help="with --local: cpu or cuda")
    d.set_defaults(handler=_demo)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="demo", help="model preset: tiny, demo or paper")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up, then decay)")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (fp16 only on GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reversible", action="store_true", help="use reversible layers (less activation memory)")
    p.add_argument("--checkpointing", action="store_true", help="use per-layer activation checkpointing")


def _build_task(preset: str, data: str, *, reversible: bool = False, checkpointing: bool = False, out_dir: str = "runs"):
    from crowdtrain.model.config import get_preset
    from crowdtrain.train.task import DalleTask

    overrides = {}
    if reversible:
        overrides["reversible"] = True
    if checkpointing:
        overrides["checkpointing"] = True
    config = get_preset(preset, **overrides)
    assets = None
    if data == "shapes":
        from crowdtrain.data import default_asset_paths, ensure_demo_shards

        data = str(ensure_demo_shards(f"{out_dir}/data/shapes"))
        assets = default_asset_paths()
    elif data != "synthetic":
        from crowdtrain.data import default_asset_paths

        assets = default_asset_paths()
    return DalleTask(config, data=data), assets


def _train(args) -> int:
    from crowdtrain.train.local import LocalTrainConfig, train_local

    task, assets = _build_task(args.preset, args.data, reversible=args.reversible,
                               checkpointing=args.checkpointing, out_dir=args.out)
    config = LocalTrainConfig(batch_size=args.batch_size, max_steps=args.max_steps, max_minutes=args.minutes,
                              lr=args.lr, warmup_steps=args.warmup_steps, device=args.device,
                              precision=args.precision, seed=args.seed, out_dir=args.out)
    summary = train_local(task, config, assets=assets)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def _demo(args) -> int:
    from crowdtrain.data.vq_train import TrainingInterrupted
    from crowdtrain.train.demo import run_local_demo, run_swarm_demo

    options = {k: v for k, v in (("bases", args.emoji_bases), ("renderings", args.emoji_renderings)) if v is not None}
    if options and args.data != "emoji":
        raise ValueError("--emoji-bases and --emoji-renderings go with --data emoji")
    try:
        if args.local:
            run_local_demo(minutes=args.minutes, out_dir=args.out, device=args.device, batch_size=32,
                           data=args.data, data_options=options)
        else:
            run_swarm_demo(peers=args.peers, minutes=args.minutes, port=args.port, dht_port=args.dht_port,
                           out_dir=args.out, data=args.data, data_options=options)
    except TrainingInterrupted as e:  # Ctrl-C while the emoji set's tokenizer trains: its state is kept
        print(f"making the emoji data set: {e}")
        return 130
    return 0
