"""Where a gradient round's CPU goes: N peers all-reduce a 22.2M-parameter model on 127.0.0.1.

The testbed's 1 Gbit/s control row showed a round of four peers taking 12x its link floor on this
2-core machine: the round is CPU-bound. This benchmark isolates the all-reduce: N processes, each a
hivemind DHT plus crowdtrain's gradient averager class (robust reducer, the paper's compression)
over tensors of the testbed model's shapes (``MODEL_22M``), no training. Every round starts at the
same moment on every peer (matchmaking is done before it: ``require_trigger``), so the time is
the all-reduce alone. Between a round's start and 4 s later the CPU time of every process of the
machine is read from /proc, split into the Python processes and the p2p daemons.

Four variants, alternated run by run in one session (this machine is shared and noisy), each
adding one change to the one before. Every one runs the gradient averager's way: results as values
(each reducer sends back its result).
- ``hivemind``: hivemind's UNIFORM_8BIT encoder and decoder, an elementwise NaN/inf check of each
  part in the reducer, each result encoded once per groupmate, and hivemind's re-declaration of
  the averager as a state donor in the DHT after every averaged tensor;
- ``codec``: :class:`crowdtrain.swarm.compression.Uniform8Bit` and
  :func:`crowdtrain.swarm.robust.finite_part`;
- ``encode-once``: each result encoded once for all groupmates;
- ``crowdtrain``: and the gradient averager does not declare itself a state donor at all (what
  crowdtrain runs).

    python benchmarks/bench_allreduce.py [--peers 4] [--rounds 6] [--repeats 2]
    python benchmarks/bench_allreduce.py [--peers 4] [--rounds 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS = Path(__file__).parent / "results"
PERIOD_S = 6.0  # between round starts; a round takes 1.5-2.5 s here
CODECS = ("hivemind", "codec", "encode-once", "crowdtrain")


def use_codec(codec: str) -> None:
    """Put the named codec in place in this peer process, before it starts its averager (which forks)."""
    from hivemind.compression import Uniform8BitQuantization

    import crowdtrain.swarm.compression as compression
    import crowdtrain.swarm.hivemind_seam.averaging as seam
    import crowdtrain.swarm.robust as robust
    from crowdtrain.swarm.hivemind_seam.p2p import replace_decoder

    # The variants before ``crowdtrain`` recreate hivemind's own code paths inside the seam's classes.
    if codec == "hivemind":
        assert replace_decoder("UNIFORM_8BIT", Uniform8BitQuantization(),
                               replaces=(compression.Uniform8Bit, Uniform8BitQuantization))
        compression.Uniform8Bit.quantize = Uniform8BitQuantization.quantize
        robust.finite_part = lambda part: bool(robust.torch.isfinite(part).all())
    else:
        assert compression.install_fast_decoder()
    if codec in ("hivemind", "codec"):
        def encode_per_taker(self, part_index, result, compression_type):
            return asyncio.get_event_loop().run_in_executor(None, seam.serialize_torch_tensor, result,
                                                            compression_type)
        seam.RobustAllReduceRunner._result_message = encode_per_taker
    if codec != "crowdtrain":  # hivemind's averager: "state updated" after every averaged tensor
        run_allreduce, averaging = seam.RobustAveragerMixin._run_allreduce_inplace_, []

        async def run_allreduce_declaring_per_tensor(self, *args, **kwargs):
            averaging.append(self)
            try:
                return await run_allreduce(self, *args, **kwargs)
            finally:
                averaging.remove(self)

        async def azip_declaring(*iterables):
            async for items in azip(*iterables):
                yield items
                averaging[-1]._state_updated.set()

        azip = seam.azip
        seam.azip = azip_declaring
        seam.RobustAveragerMixin._run_allreduce_inplace_ = run_allreduce_declaring_per_tensor


def peer(index: int, n: int, rounds: int, codec: str, addrs: mp.Queue, ready: mp.Queue, start: mp.Queue,
         results: mp.Queue) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.utils import get_dht_time

    from crowdtrain.model.config import get_preset
    from crowdtrain.model.info import build_meta_model
    from crowdtrain.swarm.compression import PaperCompression
    from crowdtrain.swarm.hivemind_seam.averaging import robust_averager_class
    from crowdtrain.testbed.swarm import MODEL_22M

    torch.set_num_threads(1)
    use_codec(codec)
    model = build_meta_model(get_preset("demo", **MODEL_22M))
    gen = torch.Generator().manual_seed(index)
    tensors = [torch.randn(p.shape, generator=gen) * 1e-3 for p in model.parameters()]
    dht = hivemind.DHT(start=True, initial_peers=addrs.get() if index else None,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if index == 0:
        for _ in range(n - 1):
            addrs.put([str(a) for a in dht.get_visible_maddrs()])
    averager = robust_averager_class(DecentralizedAverager)(
        averaged_tensors=tensors, dht=dht, prefix="bench", target_group_size=n, min_group_size=n,
        min_matchmaking_time=2.0, request_timeout=3.0, compression=PaperCompression(), results_as_values=True,
        allow_state_sharing=codec != "crowdtrain", start=True)
    ready.put(index)
    start_at = start.get()
    seconds = []
    for r in range(rounds):
        at = start_at + r * PERIOD_S
        time.sleep(max(0.0, at - 3.5 - time.time()))
        control = averager.step(wait=False, timeout=60, scheduled_time=get_dht_time() + 3.0, require_trigger=True)
        time.sleep(max(0.0, at - time.time()))
        t0 = time.perf_counter()
        control.allow_allreduce()
        control.result()
        seconds.append(time.perf_counter() - t0)
    results.put((index, seconds, averager.wire_stats.snapshot()))
    time.sleep(1.0)
    averager.shutdown()
    dht.shutdown()


def cpu_by_process() -> dict[int, tuple[str, float]]:
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for d in glob.glob("/proc/[0-9]*"):
        try:
            stat = open(d + "/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(d[6:])] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return out


def one_run(codec: str, n: int, rounds: int) -> dict:
    ctx = mp.get_context("fork")
    addrs, ready, start, results = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=peer, args=(i, n, rounds, codec, addrs, ready, start, results)) for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    start_at = time.time() + 5.0
    for _ in procs:
        start.put(start_at)
    cpu = {"python": [], "p2pd": []}
    for r in range(rounds):
        time.sleep(max(0.0, start_at + r * PERIOD_S - 0.3 - time.time()))
        before = cpu_by_process()
        time.sleep(max(0.0, start_at + r * PERIOD_S + 4.0 - time.time()))
        after = cpu_by_process()
        spent = {"python": 0.0, "p2pd": 0.0}
        for pid, (comm, seconds) in after.items():
            if comm in spent and pid in before:
                spent[comm] += seconds - before[pid][1]
        for k in cpu:
            cpu[k].append(spent[k])
    out = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    # A round lasts until its last peer has the result; the first round warms up (skipped).
    round_s = [max(seconds[r] for _, seconds, _ in out) for r in range(1, rounds)]
    return {"codec": codec, "peers": n, "round_s": round_s, "median_round_s": statistics.median(round_s),
            "python_cpu_s": statistics.median(cpu["python"][1:]), "p2pd_cpu_s": statistics.median(cpu["p2pd"][1:]),
            "aggregate_s_per_peer_round": sum(s["aggregate_s"] for _, _, s in out) / sum(s["rounds"] for _, _, s in out),
            "bytes_sent_per_peer_round": sum(s["bytes_sent"] for _, _, s in out) / sum(s["rounds"] for _, _, s in out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_allreduce.json")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    runs = []
    for repeat in range(args.repeats):
        for codec in CODECS:
            run = one_run(codec, args.peers, args.rounds)
            runs.append({**run, "repeat": repeat})
            print(f"{codec:>11} repeat {repeat}: round {run['median_round_s']:.2f} s, CPU python "
                  f"{run['python_cpu_s']:.2f} s + p2pd {run['p2pd_cpu_s']:.2f} s", flush=True)
    summary = {}
    for codec in CODECS:
        mine = [r for r in runs if r["codec"] == codec]
        summary[codec] = {k: statistics.median(r[k] for r in mine)
                          for k in ("median_round_s", "python_cpu_s", "p2pd_cpu_s", "aggregate_s_per_peer_round")}
    base = summary["hivemind"]
    print(f"\nAll-reduce of a 22.2M-parameter model, {args.peers} peers on 127.0.0.1 (medians over runs)")
    print(f"{'variant':>11}  {'round s':>7}  {'x':>5}  {'python CPU s':>12}  {'p2pd CPU s':>10}  {'reduce s/peer':>13}")
    for codec in CODECS:
        s = summary[codec]
        print(f"{codec:>11}  {s['median_round_s']:7.2f}  {s['median_round_s'] / base['median_round_s']:5.2f}  "
              f"{s['python_cpu_s']:12.2f}  {s['p2pd_cpu_s']:10.2f}  {s['aggregate_s_per_peer_round']:13.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "summary": summary, "peers": args.peers}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
