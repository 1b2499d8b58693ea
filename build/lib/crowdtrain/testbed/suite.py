"""The benchmark matrix: where a swarm on home links loses time.

Every run uses the 22M-parameter model of ``swarm.MODEL_22M``, peers of one thread whose steps
are padded to 3 s of computation (batch 1), and the paper's swarm mechanics (8-bit LAMB,
8-bit/fp16 wire compression, gradients and parameters averaged every epoch).

**The global batch, chosen as the paper would.** The paper fixed a global batch (4096) that made
an epoch of computation last many times the all-reduce of its gradients on its volunteers'
links. Here: an epoch of computation lasts 30 s at every N (``target_batch_size`` = 10 samples
per peer at 3 s per step), about 10x the bandwidth floor of a gradient round at 100 Mbit/s (1.8-3.1 s for
N = 2-8). The same batch is used at 10 Mbit/s, which is what shows what a slow link costs.
The heterogeneity run has a 10 Mbit/s uplink in it, so its batch is chosen for that link.

    python -m crowdtrain.cli testbed suite [--out runs/testbed-suite] [--only r100-n4,...]
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from crowdtrain.testbed import analysis
from crowdtrain.testbed.links import LinkSpec
from crowdtrain.testbed.swarm import MODEL_22M, PeerPlan, RunPlan, run_plan

logger = logging.getLogger(__name__)

STEP_S = 3.0  # real compute takes 0.3-1.5 s per step on two shared, busy cores: 3 s keeps it inside
EPOCH_COMPUTE_S = 30.0
STORM_EPOCH_S = 25.0


def paper_batch(peers: int, *, step_s: float = STEP_S, batch_size: int = 1) -> int:
    return int(round(peers * batch_size * EPOCH_COMPUTE_S / step_s))


def uniform(name: str, n: int, rate: str, *, minutes: float, delayed: bool = True, **kw) -> RunPlan:
    peers = [PeerPlan(f"p{i + 1}", LinkSpec.parse(rate), step_s=STEP_S) for i in range(n)]
    return RunPlan(name, peers, minutes=minutes,
                   swarm={"target_batch_size": paper_batch(n), "delay_optimizer_step": delayed}, **kw)


def heterogeneous(minutes: float) -> tuple[RunPlan, list[RunPlan]]:
    """Two ordinary peers, one on an ADSL-like line (10 up / 50 down), one device 3x slower."""
    kinds = {"p1": ("100mbit", STEP_S), "p2": ("100mbit", STEP_S), "p3": ("10mbit/50mbit", STEP_S),
             "p4": ("100mbit", 3 * STEP_S)}
    rate = sum(1 / step for _, step in kinds.values())  # samples/s of the swarm at full utilization
    # A gradient round and a parameter round both wait for the 10 Mbit/s uplink: ~27 s each at
    # N = 4, so an epoch must hold more than that of computation (as the paper would size it).
    target = int(round(rate * 72))
    swarm = {"target_batch_size": target}
    plan = RunPlan("hetero", [PeerPlan(n, LinkSpec.parse(link), step_s=step) for n, (link, step) in kinds.items()],
                   minutes=minutes, swarm=swarm)
    solos = [RunPlan(f"solo-{n}", [PeerPlan("p1", LinkSpec.parse(link), step_s=step)], minutes=minutes / 3,
                     swarm={"target_batch_size": max(1, int(round(72 / step)))})
             for n, (link, step) in kinds.items() if n != "p2"]  # p2 is p1's twin
    return plan, solos


def churn(minutes: float, rate: str = "10mbit/50mbit") -> RunPlan:
    """Four peers on ADSL-like links (10 up / 50 down); one is killed after 90 s, a newcomer joins
    60 s later and downloads the state through a peer's 10 Mbit/s uplink."""
    peers = [PeerPlan(f"p{i + 1}", LinkSpec.parse(rate), step_s=STEP_S) for i in range(4)]
    peers[1].kill_s = 90.0
    peers.append(PeerPlan("p5", LinkSpec.parse(rate), step_s=STEP_S, join_s=150.0))
    return RunPlan("churn", peers, minutes=minutes, swarm={"target_batch_size": paper_batch(4)})


def storm(minutes: float, *, max_state_uploads: int, rate: str = "10mbit/50mbit", newcomers: int = 4,
          name: str = "storm") -> RunPlan:
    """Three peers on ADSL-like links (10 up / 50 down); ``newcomers`` more join at the same moment,
    after the first step, and each downloads the state through some peer's 10 Mbit/s uplink.
    hivemind's behaviour is ``max_state_uploads`` unbounded: a donor picked by several newcomers
    splits its uplink between them.

    A 5.6M-parameter model (the testbed's, at half the width), whose state downloads in about 20 s
    over 10 Mbit/s, and epochs of the grown swarm of about 25 s, longer than a download, as a run
    should be sized: hivemind lets a peer one epoch behind catch up, not more, so a download
    longer than an epoch leaves a newcomer downloading again and again."""
    peers = [PeerPlan(f"p{i + 1}", LinkSpec.parse(rate), step_s=STEP_S) for i in range(3)]
    target = int(round((3 + newcomers) * STORM_EPOCH_S / STEP_S))
    first_step_s = target / 3 * STEP_S  # the three peers' first epoch
    peers += [PeerPlan(f"p{i + 4}", LinkSpec.parse(rate), step_s=STEP_S, join_s=first_step_s + 15.0)
              for i in range(newcomers)]
    return RunPlan(name, peers, minutes=minutes, model={**MODEL_22M, "width": 288, "head_dim": 32},
                   swarm={"target_batch_size": target, "max_state_uploads": max_state_uploads})


def plans(scale: float = 1.0) -> list[RunPlan]:
    """The matrix, most important first (a run cut short still leaves the earlier ones)."""
    m100, m10 = 3.0 * scale, 4.0 * scale
    hetero, solos = heterogeneous(5.0 * scale)
    return [uniform("r100-n4", 4, "100mbit", minutes=m100), uniform("r100-n2", 2, "100mbit", minutes=m100),
            uniform("r100-n8", 8, "100mbit", minutes=m100), uniform("r10-n4", 4, "10mbit", minutes=m10),
            uniform("r100-n4-nodelay", 4, "100mbit", minutes=m100, delayed=False), hetero, churn(5.0 * scale),
            uniform("r10-n4-nodelay", 4, "10mbit", minutes=m10, delayed=False),
            uniform("r10-n2", 2, "10mbit", minutes=m10), uniform("r10-n8", 8, "10mbit", minutes=m10), *solos,
            # Control: the same swarm on 1 Gbit/s links, where the link floor is 0.27 s: what the
            # round costs this machine's CPU (compression, serialization, reduction) on its own.
            uniform("r1000-n4", 4, "1gbit", minutes=m100)]


def run_suite(out_dir: Path, *, only: list[str] | None = None, scale: float = 1.0) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "suite.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    selected = [p for p in plans(scale) if not only or p.name in only]
    for plan in selected:
        t = time.time()
        logger.info("=== %s: %d peers, %s, %.1f min", plan.name, len(plan.peers),
                    ", ".join(sorted({str(p.link) for p in plan.peers})), plan.minutes)
        try:
            raw = run_plan(plan, out_dir / plan.name)
        except Exception as e:  # one failed run must not lose the others
            logger.exception("run %s failed", plan.name)
            results[plan.name] = {"name": plan.name, "error": repr(e)}
        else:
            summary = analysis.summarize(raw)
            if plan.name == "churn":
                summary["churn"] = analysis.churn_stats(raw)
            results[plan.name] = summary
        results[plan.name]["wall_s"] = time.time() - t
        results_path.write_text(json.dumps(results, indent=2))
    derive(results)
    results_path.write_text(json.dumps(results, indent=2))
    return results


def reanalyze(out_dir: Path) -> dict:
    """Summaries recomputed from every run's raw ``run.json`` (after a change to the analysis)."""
    results_path = out_dir / "suite.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for raw_path in sorted(out_dir.glob("*/run.json")):
        raw = json.loads(raw_path.read_text())
        name = raw["plan"]["name"]
        summary = analysis.summarize(raw)
        if name == "churn":
            summary["churn"] = analysis.churn_stats(raw)
        summary["wall_s"] = results.get(name, {}).get("wall_s")
        summary["loadavg"] = [e.get("loadavg") for e in raw["events"] if e["event"] in ("start", "stop")]
        results[name] = summary
    derive(results)
    results_path.write_text(json.dumps(results, indent=2))
    return results


def derive(results: dict) -> None:
    """Heterogeneity: swarm throughput against the sum of its members' solo throughputs."""
    hetero = results.get("hetero")
    solo = {name[5:]: r for name, r in results.items() if name.startswith("solo-") and "per_peer" in r}
    if not hetero or "per_peer" not in hetero:
        return
    if not hetero.get("swarm_samples_per_s"):
        return
    step_s = {p.name: p.step_s for p in heterogeneous(1.0)[0].peers}
    # A peer alone computes at most batch/step_s (its step budget); it also pays its own optimizer
    # steps. Where a solo run was not measured, that upper bound stands in: the ratio is then a
    # lower bound of swarm / sum of solos.
    solo_rate, measured = {}, {}
    for name in hetero["per_peer"]:
        twin = "p1" if name == "p2" else name
        peer = solo.get(twin, {}).get("per_peer", {}).get("p1")
        measured[name] = peer is not None
        solo_rate[name] = peer["whole_run_samples_per_s"] if peer else 1.0 / step_s[name]
    hetero["solo_samples_per_s"] = solo_rate
    hetero["solo_measured"] = measured
    hetero["ratio_to_solo_sum"] = hetero["swarm_samples_per_s"] / sum(solo_rate.values())
