"""Prompt adherence of one trained checkpoint under several sampling filters.

The sampler is part of what a user sees: the same weights give different pictures under top-k,
nucleus (top-p) or a lower temperature. This evaluates one checkpoint (``crowdtrain eval``'s
prompts, analyser and seeds) under each arm with ``--seeds`` different sampling seeds and prints
the mean and range of seen and held-out adherence, so the default filter
(``crowdtrain.model.config.DEFAULT_TOP_K`` / ``DEFAULT_TOP_P``) is chosen by measurement. No
training happens here: make a checkpoint first, e.g. with ``crowdtrain demo --out runs/demo``.

Arms (``--arms``, comma-separated): ``kN`` top-k N, ``pX`` top-p X, either followed by ``tY`` for
temperature Y (``k256``, ``p0.75``, ``p0.9t0.8``).

    python benchmarks/bench_sampling.py runs/demo/run/checkpoints/step-0000032 [--arms k256,p0.75] [--seeds 4]

Writes ``benchmarks/results/bench_sampling.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"
ARM_RE = re.compile(r"^(?:k(?P<k>\d+)|p(?P<p>0?\.\d+|1(?:\.0*)?))(?:t(?P<t>\d*\.?\d+))?$")


def parse_arm(name: str) -> dict:
    m = ARM_RE.match(name)
    if m is None:
        raise SystemExit(f"bench_sampling: arm {name!r} is not kN or pX, optionally followed by tY "
                         "(e.g. k256, p0.75, p0.9t0.8)")
    return {"name": name, "top_k": int(m["k"]) if m["k"] else None, "top_p": float(m["p"]) if m["p"] else None,
            "temperature": float(m["t"]) if m["t"] else 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--arms", default="k256,p0.9,p0.75,p0.6,k256t0.8")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "bench_sampling.json"))
    args = parser.parse_args()
    arms = [parse_arm(a) for a in args.arms.split(",") if a]

    from crowdtrain.data.evaluate import evaluate_generator
    from crowdtrain.data.generate import Generator

    gen = Generator.from_checkpoint(args.checkpoint, device="cpu")
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "checkpoint": args.checkpoint, "step": gen.meta.get("step"),
               "seeds": args.seeds, "samples_per_prompt": args.samples_per_prompt, "arms": []}
    print(f"{'arm':10s} {'seen':>6s} {'range':>11s} {'held-out':>8s} {'range':>11s}")
    for arm in arms:
        seen, held = [], []
        for seed in range(args.seeds):
            r = evaluate_generator(gen, samples_per_prompt=args.samples_per_prompt, top_k=arm["top_k"],
                                   top_p=arm["top_p"], temperature=arm["temperature"], seed=1000 * seed)
            seen.append(r["groups"]["seen"]["adherence"])
            held.append(r["groups"]["heldout"]["adherence"])
        results["arms"].append({**arm, "seen": seen, "heldout": held})
        print(f"{arm['name']:10s} {statistics.mean(seen):6.3f} {min(seen):5.2f}-{max(seen):5.2f} "
              f"{statistics.mean(held):8.3f} {min(held):5.2f}-{max(held):5.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
