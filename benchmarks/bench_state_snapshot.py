"""What serving a copy of the training state costs a donor: the 22.2M-parameter testbed model.

A peer asked for its state (by a newcomer, a peer that fell behind, the coordinator's
checkpointer) answers from ``get_current_state`` in its training process. hivemind's
``TrainingStateAverager`` hands over its live tensors, which the download then compresses one by
one as the stream reaches them: over a home link that is minutes, during which the optimizer steps
and averaging rounds rewrite them, so the newcomer got a mix of every epoch the download spanned.
``crowdtrain.swarm.hivemind_seam.state.ConsistentStateAverager`` copies them under the optimizer's and the
tensors' locks instead. This measures the price of that copy, in the same process, alternating the
two, on the state a volunteer serves: the parameters plus the 8-bit LAMB's statistics (the paper's
optimizer, offloaded to the CPU as the paper runs it).

    python benchmarks/bench_state_snapshot.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import hivemind
    import torch
    from hivemind.optim.state_averager import TrainingStateAverager

    from crowdtrain.model.config import get_preset
    from crowdtrain.model.transformer import DalleTransformer
    from crowdtrain.optim import param_groups
    from crowdtrain.runspec.swarm import SwarmConfig
    from crowdtrain.swarm.lamb import make_lamb
    from crowdtrain.swarm.hivemind_seam.state import ConsistentStateAverager
    from crowdtrain.testbed.swarm import MODEL_22M

    torch.set_num_threads(1)
    swarm = SwarmConfig()
    model = DalleTransformer(get_preset("demo", **MODEL_22M))
    n_params = sum(p.numel() for p in model.parameters())
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = ConsistentStateAverager(
        dht=dht, prefix="bench_state_averager", optimizer=lambda params: make_lamb(params, swarm),
        params=param_groups(model, swarm.weight_decay), offload_optimizer=True, custom_gradients=True, start=True)
    try:
        variants = {"hivemind (live tensors)": lambda: TrainingStateAverager.get_current_state(averager),
                    "crowdtrain (a copy)": averager.get_current_state}
        times = {name: [] for name in variants}
        state_bytes = 0
        for _ in range(args.repeats):
            for name, get_state in variants.items():
                t0 = time.perf_counter()
                _, tensors, _ = get_state()
                times[name].append(time.perf_counter() - t0)
                state_bytes = sum(t.numel() * t.element_size() for t in tensors)
                del tensors
    finally:
        averager.shutdown()
        dht.shutdown()

    base = statistics.median(times["hivemind (live tensors)"])
    rows = [{"variant": name, "median_s": statistics.median(ts), "min_s": min(ts),
             "extra_s": statistics.median(ts) - base} for name, ts in times.items()]
    print(f"state served: {n_params / 1e6:.1f}M parameters + 8-bit LAMB statistics = {state_bytes / 2**20:.0f} MiB; "
          f"{args.repeats} repeats, alternated")
    print(f"{'variant':<26}{'median s':>10}{'min s':>10}{'extra s':>10}")
    for row in rows:
        print(f"{row['variant']:<26}{row['median_s']:>10.4f}{row['min_s']:>10.4f}{row['extra_s']:>10.4f}")
    print(f"a copy costs {rows[1]['extra_s']:.3f} s per download and {state_bytes / 2**20:.0f} MiB held while it "
          "streams (against a download of minutes over a home link)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench_state_snapshot.json"
    out.write_text(json.dumps({"parameters": n_params, "state_bytes": state_bytes, "repeats": args.repeats,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
