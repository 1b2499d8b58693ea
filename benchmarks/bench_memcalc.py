"""Estimate vs measured peak memory of training steps, for every case in crowdtrain.memcalc.validate.

    python benchmarks/bench_memcalc.py [--device cuda] [--only gpt2]

CPU: tensor bytes from torch's MemTracker; CUDA: torch.cuda.max_memory_allocated. Prints a
table and writes benchmarks/results/bench_memcalc.json. Target: |error| < 15% everywhere.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from crowdtrain.memcalc.validate import CASES, measure_case

MIB = 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_memcalc.json")
    args = p.parse_args()
    rows = []
    print(f"{'config':32}{'estimate MiB':>14}{'measured MiB':>14}{'error':>9}  peak in")
    for case in CASES:
        if args.only not in case.name:
            continue
        start = time.time()
        r = measure_case(case, args.device)
        r["seconds"] = time.time() - start
        rows.append(r)
        print(f"{r['case']:32}{r['estimate_bytes'] / MIB:14.1f}{r['measured_bytes'] / MIB:14.1f}"
              f"{100 * r['error']:+8.1f}%  {r['peak_phase']}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error| {100 * worst:.1f}% over {len(rows)} configs on {args.device} (target < 15%)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0 if worst < 0.15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
