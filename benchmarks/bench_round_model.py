"""The round model (``crowdtrain.testbed.roundmodel``) against the testbed, then the ``paper`` preset
at 100 and 1,000 peers.

1. Measured rows: the stored suite rows (``tests/fixtures/testbed_rounds.json``, N = 2, 4, 8 and
   the 1 Gbit/s control) plus every testbed run folder given with ``--runs`` (what
   ``crowdtrain testbed run`` writes: ``run.json``), e.g. the N = 16 rows::

       sudo env PATH=$PATH flock /work/heavy.lock python -m crowdtrain.cli testbed run --peers 16 \\
           --rate 100mbit --minutes 4 --step-s 10 --target-batch-size 96 --out runs/tb-r100-n16

2. With ``--fit``: the constants fitted again (least squares on the log of measured / predicted
   round time over ``roundmodel.FIT_ROWS``; a grid, deterministic), printed beside the module's.
3. The check table: measured vs predicted round time and bytes per peer, and the ratio.
4. The table for the ``paper`` preset at N = 100 and 1,000 on 10 and 100 Mbit/s links, the whole
   swarm in one group and groups of 16 and 32: bytes and seconds per round, what takes the largest
   share of its capacity, and each capacity's load.

    python benchmarks/bench_round_model.py [--runs runs/tb-r100-n16 runs/tb-r1000-n16 ...] [--fit] [--record-sizes]

JSON in benchmarks/results/bench_round_model.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crowdtrain.testbed import roundmodel as rm

FIXTURE = ROOT / "tests" / "fixtures" / "testbed_rounds.json"
RESULTS = ROOT / "benchmarks" / "results"


def stored_rows() -> tuple[list[dict], dict]:
    data = json.loads(FIXTURE.read_text())
    return [{**r, "source": "stored"} for r in data["rows"]], data


def run_row(folder: Path) -> dict:
    """A measured row from a ``testbed run`` folder (its raw ``run.json``)."""
    from crowdtrain.testbed import analysis

    raw = json.loads((folder / "run.json").read_text())
    s = analysis.round_stats(raw)
    plan = raw["plan"]
    peers = plan["peers"]
    groups = sorted({r["group_size"] for r in s["rounds"]}, reverse=True)
    # The analysis counts a round whose members all report the same group; the model is of the
    # whole swarm's round, so a smaller group (a swarm that split) is no row to check.
    s["rounds"] = [r for r in s["rounds"] if r.get("full") and r["group_size"] == len(peers)]
    if not s["rounds"]:
        raise ValueError(f"{folder}: no round of all {len(peers)} peers (groups formed: {groups})")
    full = s["rounds"]
    s.update(round_s_median=statistics.median(r["round_s"] for r in full),
             floor_s=statistics.median(r["floor_s"] for r in full), ratio_best=min(r["ratio"] for r in full),
             upload_volume_ratio=statistics.median(r["uploaded_bytes"] / r["expected_upload_bytes"] for r in full),
             full_rounds=len(full))
    over = sum((raw["peers"].get(p["name"]) or {}).get("over_budget_steps", 0) for p in peers)
    steps = sum((raw["peers"].get(p["name"]) or {}).get("steps", 0) for p in peers)
    return {"name": folder.name, "peers": len(peers), "rate_bps": min(min(p["up_bps"], p["down_bps"]) for p in peers),
            "step_s": peers[0]["step_s"], "round_s": s["round_s_median"], "floor_s": s["floor_s"],
            "bytes_ratio": s["upload_volume_ratio"], "wire_bytes": s["gradient_wire_bytes"],
            "full_rounds": s["full_rounds"], "all_rounds": s["all_rounds"], "ratio_best": s["ratio_best"],
            "matchmaking_s": statistics.median(r["matchmaking_s"] for r in s["rounds"] if r.get("full")),
            "over_budget_steps": over, "steps": steps, "source": str(folder)}


def predict(row: dict, cores: float, step_compute_s: float) -> dict:
    n = row["peers"]
    wire = row.get("wire_bytes") or row["floor_s"] * row["rate_bps"] / 8 / rm.butterfly_fraction(n)
    t = rm.round_time_s(n, wire, row["rate_bps"], cores=cores, step_share=step_compute_s / row["step_s"])
    up = rm.bytes_per_peer(n, wire)["server_up"]
    return {"round_s": t, "up_bytes": up, "floor_s": rm.link_floor_s(n, wire, row["rate_bps"]),
            "cpu_s": rm.cpu_s(n, wire, cores=cores, step_share=step_compute_s / row["step_s"])}


def fit(rows: list[dict], cores: float, step_compute_s: float) -> dict:
    """Grid search of (CPU_S_PER_WIRE_BYTE, OVERLAP, BACKGROUND_CORES_PER_PEER) minimising the sum of
    squared log ratios over ``rows``. Restores the module's constants before returning."""
    saved = rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER
    best = None
    try:
        for c in [i * 1e-9 for i in range(5, 61)]:
            for k in (1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0):
                for b in [i * 0.01 for i in range(21)]:
                    rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER = c, k, b
                    err = sum(math.log(predict(r, cores, step_compute_s)["round_s"] / r["round_s"]) ** 2
                              for r in rows)
                    if best is None or err < best[0]:
                        best = (err, c, k, b)
    finally:
        rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER = saved
    return {"cpu_s_per_wire_byte": best[1], "overlap": best[2], "background_cores_per_peer": best[3],
            "rms_log_error": math.sqrt(best[0] / len(rows)), "rows": [r["name"] for r in rows]}


def leave_one_out(rows: list[dict], cores: float, step_compute_s: float) -> list[dict]:
    """Each row predicted by the constants fitted on the other rows: how the model does on a row
    it has not seen."""
    out = []
    saved = rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER
    for r in rows:
        f = fit([o for o in rows if o is not r], cores, step_compute_s)
        try:
            rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER = (
                f["cpu_s_per_wire_byte"], f["overlap"], f["background_cores_per_peer"])
            p = predict(r, cores, step_compute_s)["round_s"]
        finally:
            rm.CPU_S_PER_WIRE_BYTE, rm.OVERLAP, rm.BACKGROUND_CORES_PER_PEER = saved
        out.append({"row": r["name"], "measured_s": r["round_s"], "predicted_s": p, "ratio": r["round_s"] / p,
                    "fit": f})
    return out


def check_table(rows: list[dict], cores: float, step_compute_s: float) -> tuple[str, list[dict]]:
    out = [(f"{'row':<16} {'N':>3} {'link':>8} {'step s':>6} {'measured s':>10} {'predicted s':>11} {'ratio':>6} "
           f"{'floor s':>7} {'cpu s':>6} {'bytes/butterfly':>15} {'fit?':>4}")]
    checked = []
    for r in rows:
        p = predict(r, cores, step_compute_s)
        ratio = r["round_s"] / p["round_s"]
        checked.append({**r, "predicted_round_s": p["round_s"], "predicted_cpu_s": p["cpu_s"],
                        "measured_over_predicted": ratio, "fitted_on": r["name"] in rm.FIT_ROWS})
        rate = f"{r['rate_bps'] / 1e6:g}mbit" if r["rate_bps"] < 1e9 else f"{r['rate_bps'] / 1e9:g}gbit"
        out.append(f"{r['name']:<16} {r['peers']:>3} {rate:>8} {r['step_s']:>6.0f} {r['round_s']:>10.2f} "
                   f"{p['round_s']:>11.2f} {ratio:>6.2f} {p['floor_s']:>7.2f} {p['cpu_s']:>6.2f} "
                   f"{r['bytes_ratio']:>15.3f} {'yes' if r['name'] in rm.FIT_ROWS else '':>4}")
    out.append(f"bytes/butterfly: measured upload per round / 2(N-1)/N x wire bytes (the model uses "
               f"{rm.FRAMING}); cpu s: the model's CPU term on {cores:g} shared cores")
    return "\n".join(out), checked


SHORT = {"gradient round / epoch": "round/epoch", "round / averaging_timeout_s": "round/timeout",
         "progress key: a replica's uplink": "progress key", "progress reads: a peer's downlink": "progress reads",
         "group key in matchmaking: a replica's uplink": "group key", "metrics key: a replica's uplink": "metrics key",
         "coordinator HTTP: one core": "HTTP", "newcomer's state download / epoch": "state/epoch"}


def _loads(loads: dict, limit: float = 0.5) -> str:
    """The loads at or over ``limit``, largest first."""
    over = sorted(((v, k) for k, v in loads.items() if v >= limit), reverse=True)
    return ", ".join(f"{SHORT[k]} {v:.2f}" for v, k in over) or "-"


def paper_table(peers=(100, 1000), rates=(10e6, 100e6), groups=(None, 32, 16), **kw) -> tuple[str, list[dict]]:
    rows = []
    out = [(f"{'N':>5} {'link':>7} {'group':>5} {'mix':>3} {'MB up':>6} {'round s':>7} {'epoch s':>7} {'hops':>4} "
           f"{'HTTP/s':>6}  loads >= 0.5, largest (first to break) first")]
    for n in peers:
        for rate in rates:
            for g in groups:
                c = rm.swarm_costs(rm.Swarm(peers=n, rate_bps=rate, group=g, **kw))
                rows.append(c)
                out.append(f"{n:>5} {rate / 1e6:>4g}Mb {g or 'all':>5} {c['mixing_rounds']:>3} "
                           f"{c['up_bytes_per_round'] / 1e6:>6.0f} {c['round_s']:>7.1f} {c['epoch_s']:>7.1f} "
                           f"{c['dht_hops']:>4} {c['http_requests_per_s']:>6.0f}  {_loads(c['loads'])}")
    return "\n".join(out), rows


def settings_table(peers=(100, 1000), rates=(10e6, 100e6), dht_rates=(None, 1e9), samples_per_s: float = 1.0):
    rows = []
    out = [(f"{'N':>5} {'link':>7} {'DHT servers':>11} {'batch':>8} {'epoch s':>7} {'round s':>7} {'timeout s':>9} "
           f"{'match s':>7} {'token s':>7}  loads >= 0.5 with these settings")]
    for n in peers:
        for rate in rates:
            for dht in dht_rates:
                r = rm.recommend(n, rate, dht_server_rate_bps=dht, samples_per_s_per_peer=samples_per_s)
                st, c = r["settings"], r["costs"]
                rows.append({**r, "peers": n, "rate_bps": rate, "dht_server_rate_bps": dht})
                out.append(f"{n:>5} {rate / 1e6:>4g}Mb {'1 Gbit/s' if dht else 'volunteers':>11} "
                           f"{st['target_batch_size']:>8} {c['epoch_s']:>7.0f} {c['round_s']:>7.1f} "
                           f"{st['averaging_timeout_s']:>9.0f} {st['matchmaking_time_s']:>7.0f} "
                           f"{st['token_lifetime_s']:>7.0f}  {_loads(c['loads'])}")
    return "\n".join(out), rows


def record_sizes() -> dict:
    """Bytes of one signed record of each hot DHT key as the DHT stores and returns it: the subkey
    (the signer's RSA public key), the value with its RSA signature, the expiration. Needs
    hivemind (``roundmodel`` keeps the results as constants)."""
    import time

    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.optim.progress_tracker import LocalTrainingProgress
    from hivemind.utils.crypto import RSAPrivateKey
    from hivemind.utils.serializer import MSGPackSerializer

    from crowdtrain.swarm import metrics

    signer, identity = RSASignatureValidator(), RSAPrivateKey()
    subkey = MSGPackSerializer.dumps(signer.local_public_key)

    def size(key: str, value: dict) -> int:
        record = DHTRecord(key=DHTID.generate(source=key).to_bytes(), subkey=subkey,
                           value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 60)
        return len(subkey) + len(signer.sign_value(record)) + 8

    now = time.time()
    progress = LocalTrainingProgress(peer_id=b"\x00\x25" + b"x" * 36, epoch=1234, samples_accumulated=100,
                                     samples_per_second=1.5, time=now, client_mode=False).dict()
    record = metrics.PeerMetrics(
        peer_id="Qm" + "x" * 44, epoch=1234, samples=123456, samples_per_second=1.5, loss=3.21, steps=1000, time=now,
        client_mode=False, last_round_peers=32, swarm_peers=1000, fingerprint="f" * 64, user="volunteer-123",
        maddrs=["/ip4/203.0.113.7/tcp/31337/p2p/Qm" + "x" * 44], session="a" * 16, credited_samples=100000,
        credited_steps=900, **metrics.endorsement(identity, "crowdtrain", signer))
    counts = metrics.RoundCounts(session="a" * 16, time=now, rounds=1000, rounds_apart=3)
    return {"progress": size("crowdtrain_progress", progress), "metrics": size("crowdtrain_metrics", record.dict()),
            "round_counts": size("crowdtrain_round_counts", counts.dict())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="*", default=[], help="testbed run folders (with run.json) to check too")
    ap.add_argument("--fit", action="store_true", help="fit the constants again on roundmodel.FIT_ROWS")
    ap.add_argument("--samples-per-s", type=float, default=1.0,
                    help="paper table: one volunteer's samples/s (sets the epoch: target batch / (N x this))")
    ap.add_argument("--target-batch-size", type=int, default=4096, help="paper table: the global batch")
    ap.add_argument("--record-sizes", action="store_true",
                    help="measure the hot DHT keys' record sizes with hivemind (roundmodel's constants)")
    ap.add_argument("--out", default=str(RESULTS / "bench_round_model.json"))
    args = ap.parse_args(argv)

    rows, meta = stored_rows()
    unusable = {}
    for folder in args.runs:
        try:
            row = run_row(Path(folder))
        except ValueError as e:  # a run whose swarm never averaged as one group: say so, go on
            print(f"not checked: {e}")
            unusable[folder] = str(e)
            continue
        rows = [r for r in rows if r["name"] != row["name"]] + [row]
    cores, step_compute_s = meta["cores"], meta["step_compute_s"]
    result = {"constants": {"framing": rm.FRAMING, "cpu_s_per_wire_byte": rm.CPU_S_PER_WIRE_BYTE,
                            "overlap": rm.OVERLAP, "background_cores_per_peer": rm.BACKGROUND_CORES_PER_PEER,
                            "fit_rows": list(rm.FIT_ROWS)}, "runs_not_checked": unusable}
    if args.record_sizes:
        result["record_sizes"] = record_sizes()
        print(f"signed DHT records, bytes: {result['record_sizes']} (roundmodel: progress "
              f"{rm.PROGRESS_RECORD_BYTES}, metrics + round counts {rm.METRICS_RECORD_BYTES})\n")
    if args.fit:
        fit_rows = [r for r in rows if r["name"] in rm.FIT_ROWS]
        result["fit"] = fit(fit_rows, cores, step_compute_s)
        result["fit_all"] = fit(rows, cores, step_compute_s)
        print(f"fit on {result['fit']['rows']}: {result['fit']}")
        print(f"fit on every row: {result['fit_all']}")
        result["leave_one_out"] = leave_one_out(fit_rows, cores, step_compute_s)
        print("each fitted row predicted by the constants fitted on the others: " + ", ".join(
            f"{x['row']} {x['measured_s']:.2f} s vs {x['predicted_s']:.2f} s ({x['ratio']:.2f})"
            for x in result["leave_one_out"]) + "\n")
    table, checked = check_table(rows, cores, step_compute_s)
    print("Round time, testbed (measured) vs the model (predicted)\n" + table + "\n")
    result["check"] = checked
    kw = {"samples_per_s_per_peer": args.samples_per_s, "target_batch_size": args.target_batch_size}
    table, paper = paper_table(**kw)
    print(f"paper preset ({rm.MODELS['paper'].params / 1e6:.1f}M parameters, "
          f"{rm.MODELS['paper'].wire_bytes / 1e6:.1f} MB per gradient copy), target batch {args.target_batch_size}, "
          f"{args.samples_per_s:g} samples/s per peer, RTT 50 ms\n" + table)
    table, settings = settings_table(samples_per_s=args.samples_per_s)
    print("\nThe whole swarm in one group (crowdtrain refuses smaller groups), the settings roundmodel.recommend() "
          "picks; DHT servers: whose links hold the DHT's records (the volunteers', or 1 Gbit/s hosts with "
          "volunteers' DHT in client mode)\n" + table)
    result.update(paper=paper, paper_settings=kw, settings_that_work=settings)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
