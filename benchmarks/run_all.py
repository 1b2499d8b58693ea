"""Every benchmark in turn (``make bench``), each writing its JSON to ``benchmarks/results``.

Run them on a quiet machine, one at a time: the swarm benchmarks start real processes whose
timings suffer from anything else on the CPU. The testbed (``crowdtrain testbed suite``) needs
root and about an hour, `benchmarks/fresh_runs.py` (fresh runs typed at the shell) hours, and
`benchmarks/scale_check.sh` (32 volunteers, the load, the speed-up) wants a 16-core machine; they
are not part of this list.

    python benchmarks/run_all.py [--only bench_model,bench_swarm]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["bench_memcalc", "bench_data", "bench_model", "bench_swarm", "bench_diloco", "bench_robust",
              "bench_allreduce", "bench_state_snapshot", "bench_quality", "bench_diloco_outer", "bench_rate_limiter", "bench_verify"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help=f"comma-separated names from {BENCHMARKS}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else BENCHMARKS
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    failed = []
    for name in names:
        print(f"=== {name}", flush=True)
        if subprocess.run([sys.executable, str(HERE / f"{name}.py")], check=False).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
