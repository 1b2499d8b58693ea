"""DiLoCo's outer step for a laptop swarm: which outer learning rate and momentum, and how often to
sync, at the demo's scale, in one process.

The demo's swarm syncs every 768 samples: with three peers at batch 16 that is H = 16 inner AdamW
steps per peer per round, against DiLoCo's H = 500 for which its outer Nesterov SGD (lr 0.7,
momentum 0.9) was chosen. This runs the DiLoCo arithmetic of ``crowdtrain.swarm.diloco`` exactly
(the same inner and outer optimizers, parameter groups, gradient clipping and per-epoch learning
rate schedule) with the peers simulated one after another in this process, so every arm sees the
same batches and no arm pays for process start-up, matchmaking or a busy machine; what is left
is the optimisation itself. The real swarm adds compression (8-bit pseudo-gradients) and the
delays of real rounds on top (``bench_quality.py``'s ``diloco`` arm measures those).

Arms (``--arms``), each over ``--samples`` samples of the demo data, all peers together:

- ``solo``: one process, AdamW at batch 32 (the shape of ``crowdtrain train``'s best settings);
- ``LR:MOMENTUM[@TARGET][/INNER_LR]``: three peers at batch 16 with that outer learning rate and
  momentum, syncing every TARGET samples (default ``--target``), at the ``laptop`` preset's inner
  AdamW rate or INNER_LR. ``1:0`` is plain parameter averaging.

Every arm's schedule spans its samples and decays linearly to zero at the end, as the demo sizes
it. Warm-up: the swarm arms ramp from zero over the ``laptop`` preset's ``warmup_epochs`` rounds
(at most a fifth of the run), keyed on the fractional round as DiLoCo's inner rate is; ``solo``
over the first 8% of its steps, stepwise, as ``crowdtrain train``. Held-out loss is taken on the
demo's valid split at ``--points`` evenly spaced sample counts.

    python benchmarks/bench_diloco_outer.py [--samples 12000] [--arms solo,0.7:0.9,1:0,1:0.5]

Writes ``benchmarks/results/bench_diloco_outer.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PEERS, PEER_BATCH, SOLO_BATCH = 3, 16, 32
WARMUP_SHARE = 0.08


def parse_arm(arm: str, default_target: int) -> dict:
    if arm == "solo":
        return {"name": arm, "peers": 1, "batch": SOLO_BATCH, "target": SOLO_BATCH, "outer_lr": 1.0,
                "outer_momentum": 0.0, "inner_lr": None}
    try:
        rest, _, inner_lr = arm.partition("/")
        rates, _, target = rest.partition("@")
        lr, momentum = (float(x) for x in rates.split(":"))
        target = int(target) if target else default_target
        inner_lr = float(inner_lr) if inner_lr else None
    except ValueError:
        raise SystemExit(f"arm {arm!r}: expected 'solo' or LR:MOMENTUM[@TARGET][/INNER_LR], e.g. 0.7:0.9@768/3e-3") from None
    return {"name": arm, "peers": PEERS, "batch": PEER_BATCH, "target": target, "outer_lr": lr,
            "outer_momentum": momentum, "inner_lr": inner_lr}


def run_arm(arm: dict, *, data: str, samples: int, points: int, rows, seed: int = 0) -> list[dict]:
    from crowdtrain.model.config import get_preset
    from crowdtrain.optim.schedule import linear_warmup_decay, param_groups, warmup_decay_at
    from crowdtrain.runspec.swarm import laptop_swarm_config
    from crowdtrain.swarm.diloco import make_inner_optimizer, make_outer_optimizer
    from crowdtrain.train.task import DalleTask
    from crowdtrain.train.validate import valid_loss

    config = dataclasses.replace(laptop_swarm_config(), outer_lr=arm["outer_lr"],
                                 outer_momentum=arm["outer_momentum"], target_batch_size=arm["target"])
    if arm["inner_lr"] is not None:
        config = dataclasses.replace(config, lr=arm["inner_lr"])
    task = DalleTask(get_preset("demo", token_shift=True), data=data)
    torch.manual_seed(seed)
    model = task.build_model()
    peers = [copy.deepcopy(model) for _ in range(arm["peers"])]
    inners = [make_inner_optimizer(param_groups(p, config.weight_decay), config) for p in peers]
    streams = [task.batches(batch_size=arm["batch"], seed_key=f"bench-diloco-outer-{i}") for i in range(arm["peers"])]
    outer = make_outer_optimizer([p.detach().clone() for p in model.parameters()], config)
    global_params = outer.param_groups[0]["params"]  # the optimizer's own Parameters: their .grad is read
    steps_per_round = max(1, arm["target"] // (arm["peers"] * arm["batch"]))
    round_samples = steps_per_round * arm["peers"] * arm["batch"]
    total_rounds = max(1, samples // round_samples)
    if arm["peers"] == 1:
        warmup = max(1, round(WARMUP_SHARE * total_rounds))
        schedule = lambda r, s: linear_warmup_decay(r, warmup_steps=warmup, total_steps=total_rounds)  # noqa: E731
    else:
        warmup = min(config.warmup_epochs, total_rounds // 5)
        schedule = lambda r, s: warmup_decay_at(r + s / steps_per_round, warmup=warmup, total=total_rounds)  # noqa: E731
    marks = {round(total_rounds * (k + 1) / points) for k in range(points)}
    results, t0 = [], time.perf_counter()
    for r in range(total_rounds):
        for peer, inner, stream in zip(peers, inners, streams):
            for s in range(steps_per_round):
                for group in inner.param_groups:
                    group["lr"] = config.lr * schedule(r, s)
                loss = task.loss(peer, next(stream))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(peer.parameters(), config.clip_grad_norm)
                inner.step()
                inner.zero_grad(set_to_none=True)
        with torch.no_grad():
            for g, *local in zip(global_params, *(peer.parameters() for peer in peers)):
                g.grad = torch.stack([g - p for p in local]).mean(0)  # the averaged pseudo-gradient
            outer.step()
            for peer in peers:
                for p, g in zip(peer.parameters(), global_params):
                    p.copy_(g)
        if r + 1 in marks:
            peers[0].eval()
            loss = valid_loss(peers[0], rows)
            peers[0].train()
            results.append({"samples": (r + 1) * round_samples, "valid_loss": loss,
                            "seconds": time.perf_counter() - t0})
            print(f"  {arm['name']:>14s}  {(r + 1) * round_samples:6d} samples  valid loss {loss:.4f}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=12_000)
    parser.add_argument("--arms", default="solo,0.7:0.9,1:0,1:0.5")
    parser.add_argument("--target", type=int, default=768, help="samples between syncs (the laptop preset's)")
    parser.add_argument("--points", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for the demo shards (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from crowdtrain.data import default_text_tokenizer, ensure_demo_shards
    from crowdtrain.model.config import get_preset
    from crowdtrain.train.validate import valid_rows

    work = Path(args.out or tempfile.mkdtemp(prefix="bench_diloco_outer_"))
    data = str(ensure_demo_shards(work / "data", progress=True))
    rows = valid_rows(data, text_tokenizer=default_text_tokenizer(),
                      model_config=get_preset("demo", token_shift=True))
    arms = [parse_arm(a, args.target) for a in args.arms.split(",") if a]
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "samples": args.samples, "arms": {}}
    for arm in arms:
        results["arms"][arm["name"]] = {**arm, "points": run_arm(arm, data=data, samples=args.samples,
                                                                points=args.points, rows=rows)}
    print(f"\n{'arm':>14s} {'H':>4s} {'samples':>8s} {'valid loss':>11s} {'vs solo':>8s}")
    solo = results["arms"].get("solo", {}).get("points")
    for name, arm in results["arms"].items():
        last = arm["points"][-1]
        h = max(1, arm["target"] // (arm["peers"] * arm["batch"]))
        ratio = f"{last['valid_loss'] / solo[-1]['valid_loss']:.3f}" if solo else "-"
        print(f"{name:>14s} {h:4d} {last['samples']:8d} {last['valid_loss']:11.4f} {ratio:>8s}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_diloco_outer.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
