"""LocalSwarm benchmarks on 127.0.0.1: wire bytes, heterogeneous throughput, newcomer catch-up.

1. Bytes per averaging round: the serialized size (hivemind's protobuf messages, as sent) of
   one copy of every gradient tensor, and of the full state a newcomer downloads, with the
   paper's compression vs plain fp32. A butterfly all-reduce sends 2(N-1)/N copies per peer
   either way, so the ratio holds for any N.
2. Throughput of 3 peers of different speeds together vs the sum of their solo throughputs,
   and the share of time they spend blocked in the optimizer (waiting on averaging). Each
   peer's step is padded to a fixed time (--simulated-step-s) and uses one thread, so on this
   2-core machine the figure measures the swarm, not CPU contention.
3. A newcomer joining a running demo-preset swarm: seconds from its process start to its first
   contributed epoch.

    python benchmarks/bench_swarm.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from hivemind.compression import CompressionInfo, NoCompression, TensorRole  # noqa: E402

from crowdtrain.model import get_preset  # noqa: E402
from crowdtrain.swarm.compression import PaperCompression  # noqa: E402
from crowdtrain.runspec.swarm import SwarmConfig  # noqa: E402
from crowdtrain.swarm.lamb import make_lamb  # noqa: E402
from crowdtrain.launch import LocalSwarm  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def serialized_bytes(tensors, compression, role=TensorRole.UNSPECIFIED) -> int:
    return sum(compression.compress(t, CompressionInfo.from_tensor(t, role=role)).ByteSize() for t in tensors)


def bench_bytes(preset: str) -> dict:
    """Serialized bytes depend on tensor shapes and dtypes only, so random tensors of the model's
    parameter shapes stand in for real gradients (and the paper model need not run on CPU)."""
    from crowdtrain.model.info import build_meta_model

    torch.manual_seed(0)
    meta = build_meta_model(get_preset(preset))
    params = [torch.nn.Parameter(torch.randn(p.shape) * 0.02) for p in meta.parameters()]
    grads = [torch.randn(p.shape) * 1e-3 for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    optimizer = make_lamb([{"params": params, "weight_decay": 0.0}], SwarmConfig())
    optimizer.step()
    # A state download: the parameters (adaptive compression) and the optimizer's statistics
    # (exact: 8-bit codes, and float scales that fp16 would zero).
    weights = [p.detach() for p in params]
    statistics = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    paper, fp32 = PaperCompression(), NoCompression()
    g_paper, g_fp32 = serialized_bytes(grads, paper), serialized_bytes(grads, fp32)
    s_paper = serialized_bytes(weights, paper) + serialized_bytes(statistics, paper, TensorRole.OPTIMIZER)
    s_fp32 = serialized_bytes(weights + statistics, fp32)
    return {"preset": preset, "params": sum(p.numel() for p in params),
            "grad_round_bytes": g_paper, "grad_round_bytes_fp32": g_fp32, "grad_ratio": g_paper / g_fp32,
            "state_bytes": s_paper, "state_bytes_fp32": s_fp32, "state_ratio": s_paper / s_fp32}


PEERS = [("fast", 16, 0.4), ("medium", 8, 0.4), ("slow", 8, 1.2)]  # name, batch, seconds per step


def run_swarm(tmp: Path, peers, epochs: int, target: int) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(tmp, swarm={"target_batch_size": target, "total_epochs": 1000})
    try:
        swarm.start_coordinator()
        for name, batch, step_s in peers:
            swarm.join(name, batch_size=batch, max_epochs=epochs, extra=["--simulated-step-s", str(step_s)])
        for name, *_ in peers:
            swarm.wait_exit(name, 900)
        return {name: swarm.summary(name) for name, *_ in peers}
    finally:
        swarm.close()


def bench_throughput(tmp: Path, epochs: int, target: int) -> dict:
    solo = {}
    for name, batch, step_s in PEERS:
        s = run_swarm(tmp / f"solo-{name}", [(name, batch, step_s)], epochs=3, target=batch * 8)[name]
        solo[name] = s["samples"] / s["seconds"]
    together = run_swarm(tmp / "swarm", PEERS, epochs=epochs, target=target)
    swarm_rate = sum(s["samples"] / s["seconds"] for s in together.values())
    wait_share = {n: s["wait_s"] / s["seconds"] for n, s in together.items()}
    return {"target_batch_size": target, "epochs": epochs, "solo_samples_per_s": solo,
            "swarm_samples_per_s": swarm_rate,
            "ratio_to_sum_of_solos": swarm_rate / sum(solo.values()), "wait_share": wait_share,
            "rounds_full_share": _full_share(together)}


def _full_share(summaries: dict) -> float:
    rounds = [r for s in summaries.values() for r in s["rounds"] if r["swarm_peers"] >= 2]
    return sum(r["group_size"] >= r["swarm_peers"] for r in rounds) / max(1, len(rounds))


def bench_newcomer(tmp: Path) -> dict:
    (tmp / "newcomer").mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(tmp / "newcomer", preset="demo", swarm={"target_batch_size": 256, "total_epochs": 1000})
    try:
        swarm.start_coordinator()
        swarm.join("a", batch_size=16, max_epochs=1000)
        swarm.join("b", batch_size=16, max_epochs=1000)
        swarm.wait_epoch(3, 600)
        started = time.time()
        epoch_now = swarm.status()["epoch"]
        swarm.join("newcomer", batch_size=16, max_epochs=epoch_now + 3)
        swarm.wait_exit("newcomer", 600)
        s = swarm.summary("newcomer")
        return {"preset": "demo", "joined_epoch": s["joined_epoch"], "state_load_s": s["state_load_s"],
                "start_to_first_epoch_s": s["first_epoch_unix"] - started}
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bytes only (no processes)")
    parser.add_argument("--epochs", type=int, default=4)
    # The swarm makes ~66 samples/s: 1024 samples is an epoch of ~15 s, five matchmaking windows
    # (the paper sized its global batch so an epoch far outlasts a round; 256, ~4 s, does not).
    parser.add_argument("--target", type=int, default=1024, help="the swarm's target_batch_size")
    parser.add_argument("--skip-newcomer", action="store_true")
    args = parser.parse_args()
    results = {"bytes": [bench_bytes(p) for p in ("tiny", "demo", "paper")]}
    print("\nBytes per averaging round (serialized, one copy of every tensor)")
    print(f"{'preset':<8}{'params':>10}{'grads':>12}{'grads fp32':>12}{'ratio':>8}{'state':>12}{'state fp32':>12}{'ratio':>8}")
    for r in results["bytes"]:
        print(f"{r['preset']:<8}{r['params']:>10,}{r['grad_round_bytes']:>12,}{r['grad_round_bytes_fp32']:>12,}"
              f"{r['grad_ratio']:>8.3f}{r['state_bytes']:>12,}{r['state_bytes_fp32']:>12,}{r['state_ratio']:>8.3f}")
    if not args.quick:
        tmp = Path(tempfile.mkdtemp(prefix="bench-swarm-"))
        try:
            results["throughput"] = t = bench_throughput(tmp, args.epochs, args.target)
            print("\nThroughput: 3 peers of different speeds together vs alone (samples/s)")
            for name, rate in t["solo_samples_per_s"].items():
                print(f"  solo {name:<8}{rate:8.1f}   waiting share in swarm {100 * t['wait_share'][name]:5.1f}%")
            print(f"  swarm        {t['swarm_samples_per_s']:8.1f}   = {t['ratio_to_sum_of_solos']:.2f} x the sum of solos;"
                  f" rounds with all peers {100 * t['rounds_full_share']:.0f}%")
            if args.skip_newcomer:
                previous = RESULTS / "bench_swarm.json"
                if previous.is_file() and "newcomer" in json.loads(previous.read_text()):
                    results["newcomer"] = json.loads(previous.read_text())["newcomer"]
                return _write(results)
            results["newcomer"] = n = bench_newcomer(tmp)
            print(f"\nNewcomer (demo preset): first contributed epoch {n['start_to_first_epoch_s']:.1f}s after its start "
                  f"(state download {n['state_load_s']:.1f}s, joined at epoch {n['joined_epoch']})")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _write(results)


def _write(results: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_swarm.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS / 'bench_swarm.json'}")


if __name__ == "__main__":
    main()
