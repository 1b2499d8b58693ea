"""From a run's raw results (peer summaries, byte counters, metrics) to the figures that matter.

- **Round time vs the bandwidth floor.** In a butterfly all-reduce among N peers each peer
  sends (N-1)/N of its compressed gradients to the others and the averaged 1/N back to each of
  them: 2(N-1)/N copies of the compressed model up, as many down. The floor is that volume over
  the slowest link in the group. A round's measured time runs from the moment its last member
  began exchanging tensors (nobody can finish before that peer's data is in) to the moment its
  last member finished (readings a starved thread took after a groupmate had already finished
  are left out). The peers' clocks are one clock: they share the machine.
- **Compute utilization.** Seconds spent computing gradients (padded to the step budget) per
  second of wall time, per peer, between its first and last epoch boundary (the first epoch,
  with start-up and the first state download, is left out).
- **Throughput.** Samples per second of the swarm over the same span, from the peers' own
  counts.
"""

from __future__ import annotations

import statistics
from functools import lru_cache

from crowdtrain.testbed.counters import bytes_between

PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame on the wire: the best a link delivers


@lru_cache(maxsize=8)
def gradient_wire_bytes(model_json: str, preset: str, threshold: int) -> tuple[int, int]:
    """(parameters, bytes of one compressed copy of all gradients) of the run's model."""
    import json

    from crowdtrain.model.config import get_preset
    from crowdtrain.model.info import build_meta_model
    from crowdtrain.swarm.compression import wire_bytes

    model = build_meta_model(get_preset(preset, **json.loads(model_json)))
    numels = [p.numel() for p in model.parameters()]
    return sum(numels), wire_bytes(numels, threshold)


def model_size(plan: dict) -> tuple[int, int]:
    import json

    return gradient_wire_bytes(json.dumps(plan["model"], sort_keys=True), plan["preset"],
                               int(plan["swarm"].get("compression_threshold", 2**16)))


def butterfly_floor_s(n: int, wire_bytes: int, rate_bps: float) -> float:
    return 2 * (n - 1) / n * wire_bytes * 8 / rate_bps


def cluster_rounds(summaries: dict[str, dict], gap_s: float = 10.0) -> list[list[dict]]:
    """Group every peer's round records into rounds: members of one round end within seconds of
    each other, rounds are an epoch (30 s or more) apart."""
    records = [{**r, "peer": name} for name, s in summaries.items() if s for r in s.get("rounds", [])
               if r.get("done_unix")]
    records.sort(key=lambda r: r["done_unix"])
    rounds: list[list[dict]] = []
    for r in records:
        if rounds and r["done_unix"] - rounds[-1][-1]["done_unix"] <= gap_s:
            rounds[-1].append(r)
        else:
            rounds.append([r])
    return rounds


def round_stats(result: dict) -> dict:
    plan, summaries, counters = result["plan"], result["peers"], result["counters"]
    params, wire = model_size(plan)
    links = {p["name"]: p for p in plan["peers"]}
    rows = []
    for members in cluster_rounds(summaries):
        n = len(members)
        started = [m["allreduce_unix"] for m in members if m.get("allreduce_unix")]
        # Every member averaged with the whole group (a peer that left without its summary, e.g.
        # killed, is missing from the records but counted in the others' group size).
        size = members[0]["group_size"]
        full = n >= 2 and len(started) == n and all(m["group_size"] == size for m in members) and size >= n
        row = {"peers": sorted(m["peer"] for m in members), "group_size": max(m["group_size"] for m in members),
               "full": full, "done_unix": max(m["done_unix"] for m in members)}
        if full:
            # In delayed-update mode the timing is read by a background thread; on a starved CPU it
            # can observe a round only after the others finished it: such late readings are left out.
            first_done = min(m["done_unix"] for m in members)
            timely = [m for m in members if m["allreduce_unix"] < first_done] or members
            start, end = max(m["allreduce_unix"] for m in timely), max(m["done_unix"] for m in timely)
            row["late_readings"] = n - len(timely)
            slowest = min(min(links[m["peer"]]["up_bps"], links[m["peer"]]["down_bps"]) for m in members)
            floor = butterfly_floor_s(size, wire, slowest)
            uploaded = [bytes_between(counters, m["peer"], min(started) - 0.5, end + 0.5)[0] for m in members]
            row.update(start_unix=start, round_s=end - start, floor_s=floor, ratio=(end - start) / floor,
                       waited_for_last_s=start - min(started),
                       matchmaking_s=statistics.median(m["allreduce_unix"] - m["triggered_unix"] for m in members),
                       uploaded_bytes=statistics.median(uploaded), expected_upload_bytes=2 * (size - 1) / size * wire,
                       members_reporting=n)
        rows.append(row)
    full = [r for r in rows if r["full"]]
    summary = {"params": params, "gradient_wire_bytes": wire, "rounds": rows, "full_rounds": len(full),
               "all_rounds": len(rows)}
    if full:
        summary.update(round_s_median=statistics.median(r["round_s"] for r in full),
                       floor_s=statistics.median(r["floor_s"] for r in full),
                       ratio_median=statistics.median(r["ratio"] for r in full),
                       ratio_best=min(r["ratio"] for r in full),
                       upload_volume_ratio=statistics.median(r["uploaded_bytes"] / r["expected_upload_bytes"]
                                                             for r in full))
    return summary


def peer_spans(result: dict) -> dict[str, dict]:
    """Per peer: utilization, waiting share and throughput between its first and last epoch boundary."""
    out = {}
    for name, s in result["peers"].items():
        if not s or "seconds" not in s:
            continue
        out[name] = peer = {"whole_run_utilization": s["compute_s"] / s["seconds"],
                            "whole_run_samples_per_s": s["samples"] / s["seconds"],
                            "over_budget_steps": s.get("over_budget_steps", 0), "steps": s["steps"]}
        if len(s.get("epochs", [])) >= 3:
            first, last = s["epochs"][0], s["epochs"][-1]
            span = last["unix"] - first["unix"]
            peer.update(span_s=span, epochs=last["epoch"] - first["epoch"],
                        utilization=(last["compute_s"] - first["compute_s"]) / span,
                        wait_share=(last["wait_s"] - first["wait_s"]) / span,
                        samples_per_s=(last["samples"] - first["samples"]) / span,
                        span_unix=[first["unix"], last["unix"]])
    return out


def throughput_between(result: dict, t0: float, t1: float, names: list[str] | None = None) -> dict[str, float]:
    """Samples/s of each peer between t0 and t1, from its metrics records (one every few seconds)."""
    by_peer: dict[str, list[tuple[float, int]]] = {}
    for r in result["metrics"]:
        by_peer.setdefault(r["user"], []).append((r["time"], r["samples"]))
    out = {}
    for name, pts in by_peer.items():
        if names is not None and name not in names:
            continue
        pts = sorted(set(pts))
        inside = [p for p in pts if t0 <= p[0] <= t1]
        if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
            out[name] = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    return out


def summarize(result: dict) -> dict:
    spans = peer_spans(result)
    rounds = round_stats(result)
    utilization = [v["utilization"] for v in spans.values() if "utilization" in v]
    steady = [v["samples_per_s"] for v in spans.values() if "samples_per_s" in v]
    return {
        "name": result["plan"]["name"],
        "peers": len(result["plan"]["peers"]),
        "links": sorted({p["link"] for p in result["plan"]["peers"]}),
        "target_batch_size": result["plan"]["swarm"].get("target_batch_size"),
        "delayed_updates": result["plan"]["swarm"].get("delay_optimizer_step", True),
        "rounds": rounds,
        "per_peer": spans,
        "utilization_mean": statistics.mean(utilization) if utilization else None,
        "swarm_samples_per_s": sum(steady) if len(steady) == len(spans) and spans else None,
        "over_budget_steps": sum(v["over_budget_steps"] for v in spans.values()),
        "steps": sum(v["steps"] for v in spans.values()),
        **({"diloco": diloco_rounds(result)} if result["plan"]["swarm"].get("mode") == "diloco" else {}),
    }


def diloco_rounds(result: dict) -> dict:
    """DiLoCo mode: each peer's pseudo-gradient rounds (trigger to outer step), against the floor."""
    plan = result["plan"]
    _, wire = model_size(plan)
    slowest = min(min(p["up_bps"], p["down_bps"]) for p in plan["peers"])
    records = [r for s in result["peers"].values() if s for r in s.get("rounds", [])]
    full = [r for r in records if r["group_size"] == len(plan["peers"]) and not r.get("diverged")]
    out = {"records": len(records), "full_records": len(full), "overlap": bool(plan["swarm"].get("overlap_outer_round")),
           "floor_s": butterfly_floor_s(len(plan["peers"]), wire, slowest)}
    if full:
        out["round_s_median"] = statistics.median(r["seconds"] for r in full)
        out["ratio_median"] = out["round_s_median"] / out["floor_s"]
    return out


def churn_stats(result: dict) -> dict:
    """Samples the surviving peers lost around a kill and a join, against their rate before."""
    events = {e["event"] + ("-" + e["peer"] if "peer" in e else ""): e["unix"] for e in result["events"]}
    kill = next(e for e in result["events"] if e["event"] == "kill")
    joins = [e for e in result["events"] if e["event"] == "join" and e["unix"] > result["t0"]]
    stop = events["stop"]
    killed, newcomer = kill["peer"], joins[0]["peer"] if joins else None
    survivors = [p["name"] for p in result["plan"]["peers"] if p["name"] not in (killed, newcomer)]
    before = throughput_between(result, result["t0"], kill["unix"], survivors)
    windows = {"after_kill": (kill["unix"], joins[0]["unix"] if joins else stop)}
    if joins:
        windows["after_join"] = (joins[0]["unix"], stop)
    out = {"killed": killed, "newcomer": newcomer, "survivors": survivors,
           "rate_before": before, "windows": {}}
    for label, (a, b) in windows.items():
        rates = throughput_between(result, a, b, survivors)
        lost = {n: (before[n] - rates[n]) * (b - a) / before[n] for n in survivors if n in rates and before.get(n)}
        out["windows"][label] = {"seconds": b - a, "rates": rates, "lost_s_per_peer": lost,
                                 "lost_s_mean": statistics.mean(lost.values()) if lost else None}
    rounds = cluster_rounds(result["peers"])
    after = [r for r in rounds if r[0]["done_unix"] > kill["unix"]]
    out["first_full_round_after_kill_s"] = next(
        (max(m["done_unix"] for m in r) - kill["unix"] for r in after
         if len(r) >= 2 and all(m["group_size"] == len(r) for m in r)), None)
    if newcomer and result["peers"].get(newcomer):
        s = result["peers"][newcomer]
        out["newcomer_state_load_s"] = s.get("state_load_s")
        if s.get("first_epoch_unix"):
            out["newcomer_first_epoch_s"] = s["first_epoch_unix"] - joins[0]["unix"]
    return out
