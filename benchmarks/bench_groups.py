"""Averaging groups smaller than the swarm (hivemind's ``target_group_size``, Moshpit-style): how
far apart 32 peers' parameters stay after a few rounds, with groups of 4 and 8 against one group
of everyone.

Real hivemind averagers (one DHT and one averager process per peer, on 127.0.0.1) average copies
of the ``tiny`` model's parameters that start apart: each peer's copy is the model plus its own
Gaussian noise of 1% of the model's norm (peers whose last steps differed). Every round, all peers
call ``step()`` at once; after each round the spread is ``max_i ||theta_i - mean|| / ||mean||``
over all peers (the mean of all peers is what one group of everyone gives in one round), and the
number of groups hivemind formed.

This is averaging alone, the best case for small groups: in training, every gradient round in
groups also moves the groups apart again (each group steps on its own mean gradient), which is
why crowdtrain refuses ``target_group_size`` (``crowdtrain.runspec.swarm.SwarmConfig``).

    flock /work/heavy.lock nice -n 10 python benchmarks/bench_groups.py --peers 32 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hivemind  # noqa: E402
import torch  # noqa: E402

from crowdtrain.model import DalleTransformer, get_preset  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def spread(vectors: list[torch.Tensor]) -> float:
    mean = torch.stack(vectors).mean(0)
    return max((v - mean).norm().item() for v in vectors) / mean.norm().item()


def grid_bits(i: int, peers: int, group_size: int | None) -> str:
    """Moshpit's grid: ``peers / group_size`` buckets (rounded up to a power of two), peer ``i`` in
    bucket ``i mod buckets``; after each round hivemind replaces one bit by the peer's place in its
    group, so the next round's groups mix the last round's. Without bits every peer looks for a
    group under one key, and the same groups may form again."""
    if not group_size or peers <= group_size:
        return ""
    nbits = math.ceil(math.log2(peers / group_size))
    return format(i % 2**nbits, f"0{nbits}b")


def run_groups(group_size: int | None, *, peers: int, rounds: int, noise: float, matchmaking_s: float,
               grid: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    base = torch.cat([p.detach().flatten() for p in DalleTransformer(get_preset("tiny")).parameters()])
    dhts, averagers = [], []
    try:
        first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(first)
        initial = [str(a) for a in first.get_visible_maddrs()]
        for _ in range(peers - 1):
            dhts.append(hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        for i, dht in enumerate(dhts):
            vector = base + noise * base.norm() / base.numel() ** 0.5 * torch.randn(base.shape)
            averagers.append(hivemind.averaging.DecentralizedAverager(
                [vector], dht, start=True, prefix=f"groups{group_size}{grid}", target_group_size=group_size,
                min_group_size=2, initial_group_bits=grid_bits(i, peers, group_size) if grid else "",
                min_matchmaking_time=matchmaking_s, request_timeout=1.0,
                next_chunk_timeout=30.0, allreduce_timeout=60.0))
        time.sleep(2.0)

        def read() -> list[torch.Tensor]:
            out = []
            for a in averagers:
                with a.get_tensors() as tensors:
                    out.append(tensors[0].clone())
            return out

        rows = [{"round": 0, "spread": spread(read()), "groups": None, "alone": None, "seconds": 0.0}]
        for r in range(1, rounds + 1):
            results: dict[int, object] = {}

            def one(i: int, results: dict = results) -> None:
                try:
                    results[i] = averagers[i].step(timeout=matchmaking_s * 6 + 60)
                except Exception as e:  # a failed round leaves this peer's tensors as they were
                    results[i] = e

            t0 = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(peers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
            groups = {frozenset(g) for g in results.values() if isinstance(g, dict) and g}
            alone = sum(not (isinstance(g, dict) and g) for g in results.values())
            sizes = sorted(len(g) for g in groups)
            rows.append({"round": r, "spread": spread(read()), "groups": len(groups), "group_sizes": sizes,
                         "alone": alone, "seconds": seconds})
            print(f"  groups of {group_size or 'everyone'}{' (grid)' if grid else ''}: round {r}: spread {rows[-1]['spread']:.2e}, "
                  f"{len(groups)} groups {sizes}, {alone} alone, {seconds:.1f} s", flush=True)
        return {"target_group_size": group_size, "grid": grid, "peers": peers, "noise": noise, "rounds": rows,
                "parameters": base.numel()}
    finally:
        for a in averagers:
            a.shutdown()
        for d in dhts:
            d.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sizes", default="0,8,4", help="target_group_size values, 0 for one group of everyone")
    p.add_argument("--noise", type=float, default=0.01, help="each peer's start: the model + this x its norm")
    p.add_argument("--matchmaking-s", type=float, default=5.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        for grid in ((False, True) if size else (False,)):
            results.append(run_groups(size or None, peers=args.peers, rounds=args.rounds, noise=args.noise,
                                      matchmaking_s=args.matchmaking_s, grid=grid))
    print(f"\nparameter spread (max_i ||theta_i - mean|| / ||mean||) across {args.peers} peers, by round")
    print(f"{'groups of':>16} " + " ".join(f"{'round ' + str(r['round']):>10}" for r in results[0]["rounds"]))
    for res in results:
        label = f"{res['target_group_size'] or 'everyone'}{', grid' if res['grid'] else ''}"
        print(f"{label:>16} "
              + " ".join(f"{r['spread']:10.2e}" for r in res["rounds"]))
    print("groups formed per round: " + "; ".join(
        f"{res['target_group_size'] or 'everyone'}{' grid' if res['grid'] else ''}: {[r.get('group_sizes') for r in res['rounds'][1:]]}"
        for res in results))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_groups_{args.peers}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps({"median_round_s": {f"{r['target_group_size']}{' grid' if r['grid'] else ''}": statistics.median(
        x["seconds"] for x in r["rounds"][1:]) for r in results}, "results": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
