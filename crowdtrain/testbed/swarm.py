"""Run a coordinator and volunteers inside a testbed, each on its own shaped link.

The processes are the commands people run (``crowdtrain coordinator``, ``crowdtrain join``),
each started with ``ip netns exec`` in its node's namespace and told to listen and announce on
that namespace's address. Compute is throttled so that the network is what is measured: each
peer uses one thread and pads every step's computation to ``step_s`` seconds
(``--simulated-step-s``; the padding never covers time spent waiting for the swarm), on a model
small enough in FLOPs that its real computation fits well inside that budget even with all
peers sharing two cores (peers count the steps where it did not: ``over_budget_steps``).

A run lasts ``minutes`` (or until the swarm reaches ``epochs``) from the moment every initial
peer has reported progress; peers may be scheduled to be killed (SIGKILL, as a crash or a lost
connection) or to join later. At the end every peer leaves as with Ctrl-C and writes its
summary (steps, compute and wait seconds per epoch, each averaging round's timing); the hub
samples every link's byte counters throughout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from crowdtrain import launch
from crowdtrain.runspec import files
from crowdtrain.testbed.links import LinkSpec
from crowdtrain.testbed.netns import Testbed

logger = logging.getLogger(__name__)

# A model of 22.2M parameters (22.2 MB per gradient copy on the wire, 8-bit) whose step costs
# little compute: 4 unshared layers of width 576 over 8 text + 4x4 image tokens.
MODEL_22M = {"width": 576, "heads": 9, "head_dim": 64, "depth": 4,
             "patterns": ["axial_row", "axial_col", "axial_row", "conv_like"], "share_ids": [0, 1, 2, 3],
             "text_len": 8, "image_height": 4, "image_width": 4}

# Swarm settings for measuring: the paper's mechanics with epochs long enough for matchmaking,
# timeouts above the slowest round, and no periodic checkpoint downloads by the coordinator
# (they would take a peer's uplink in the middle of a measurement).
BENCH_SWARM = {"matchmaking_time_s": 5.0, "averaging_timeout_s": 150.0, "load_state_timeout_s": 300.0,
               "warmup_epochs": 10, "total_epochs": 100000, "checkpoint_every_epochs": 100000}

HTTP_PORT, DHT_PORT = 8000, 31337


@dataclass
class PeerPlan:
    name: str  # a node name: p1, p2, ...
    link: LinkSpec
    batch_size: int = 1
    step_s: float = 2.0  # seconds of (padded) computation per step
    join_s: float | None = None  # None: with the swarm; else seconds after the measurement starts
    kill_s: float | None = None  # SIGKILL this many seconds after the measurement starts

    def to_dict(self) -> dict:
        return {**asdict(self), "link": str(self.link), "up_bps": self.link.up_bps, "down_bps": self.link.down_bps}


@dataclass
class RunPlan:
    name: str
    peers: list[PeerPlan]
    minutes: float = 3.0
    epochs: int | None = None  # stop once the swarm reaches this epoch (or after `minutes`)
    coordinator_link: LinkSpec = field(default_factory=lambda: LinkSpec(1e9, 1e9))
    preset: str = "demo"
    model: dict = field(default_factory=lambda: dict(MODEL_22M))
    swarm: dict = field(default_factory=dict)
    queue_ms: float = 50.0
    # Four peers fetching the first state over 10 Mbit/s links take minutes on a busy machine.
    startup_timeout_s: float = 900.0

    def __post_init__(self):
        names = [p.name for p in self.peers]
        if not self.peers:
            raise ValueError("a run needs at least one peer")
        if len(set(names)) != len(names) or "coord" in names:
            raise ValueError(f"peer names must be unique and not 'coord', got {names}")
        if self.minutes <= 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")

    def swarm_settings(self) -> dict:
        return {**BENCH_SWARM, **self.swarm}

    def to_dict(self) -> dict:
        return {"name": self.name, "peers": [p.to_dict() for p in self.peers], "minutes": self.minutes,
                "epochs": self.epochs, "coordinator_link": str(self.coordinator_link), "preset": self.preset,
                "model": self.model, "swarm": self.swarm_settings(), "queue_ms": self.queue_ms}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_plan(plan: RunPlan, out_dir: Path) -> dict:
    """Run one swarm in a fresh testbed; return (and write to ``out_dir/run.json``) the raw results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    for stale in out_dir.glob("*.json"):
        stale.unlink()
    for stale in ("counters.jsonl",):
        (out_dir / stale).unlink(missing_ok=True)
    links = {"coord": plan.coordinator_link, **{p.name: p.link for p in plan.peers}}
    env = launch.child_env()
    events: list[dict] = []
    with Testbed(links, queue_ms=plan.queue_ms) as tb:
        coord = tb.nodes["coord"]
        url = f"http://{coord.address}:{HTTP_PORT}"
        run_dir = out_dir / "run"
        tb.spawn("hub", [sys.executable, "-m", "crowdtrain.testbed.counters", str(out_dir / "counters.jsonl"), "0.2"],
                 env=env, log=out_dir / "logs" / "counters.log")
        args = launch.coordinator_args(run_id="testbed", preset=plan.preset, data="synthetic", host=coord.address,
                                       port=HTTP_PORT, public_host=coord.address, dht_port=DHT_PORT,
                                       run_dir=run_dir, swarm=plan.swarm_settings(), model=plan.model)
        # A stale run folder would resume an old checkpoint and old metrics.
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        coordinator = tb.spawn("coord", launch.cli(*args), env=env, log=out_dir / "logs" / "coordinator.log")
        launch.wait_until(lambda: (run_dir / files.RUN_INFO).is_file(), plan.startup_timeout_s,
                  lambda: coordinator.poll() is not None, f"the coordinator did not start; see {out_dir}/logs")
        procs = {}
        # The address is not loopback: without a pin, a volunteer would remember this run's key for
        # it, and the next testbed run (a new key at the same address) would be refused.
        from crowdtrain.runspec.tokens import CoordinatorKey
        from crowdtrain.runspec.trust import fingerprint

        pin = fingerprint(CoordinatorKey.load_or_create(run_dir / "coordinator_key.pem").public_key)

        def join(peer: PeerPlan):
            node = tb.nodes[peer.name]
            procs[peer.name] = tb.spawn(peer.name, launch.cli(*launch.join_args(
                url, user=peer.name, batch_size=peer.batch_size, host=node.address, simulated_step_s=peer.step_s,
                summary_file=out_dir / f"{peer.name}.json", extra=["--pin", pin])), env=env,
                log=out_dir / "logs" / f"{peer.name}.log")
            events.append({"event": "join", "peer": peer.name, "unix": time.time()})
            logger.info("%s joined (%s, batch %d, %.1f s/step)", peer.name, peer.link, peer.batch_size, peer.step_s)

        initial = [p for p in plan.peers if p.join_s is None]
        for peer in initial:
            join(peer)

        def all_reporting() -> bool:
            status, _ = files.read_status(run_dir)
            return {p.name for p in initial} <= {r.get("user") for r in status.peers}

        launch.wait_until(all_reporting, plan.startup_timeout_s,
                  lambda: any(procs[p.name].poll() is not None for p in initial) or coordinator.poll() is not None,
                  f"the peers did not all start training; see {out_dir}/logs")
        t0 = time.time()
        events.append({"event": "start", "unix": t0, "loadavg": os.getloadavg()})  # other work on the machine
        logger.info("all %d peers are training: measuring for %.1f minutes", len(initial), plan.minutes)
        pending = sorted([(p.join_s, "join", p) for p in plan.peers if p.join_s is not None]
                         + [(p.kill_s, "kill", p) for p in plan.peers if p.kill_s is not None], key=lambda e: e[0])
        last_print = 0.0
        while time.time() < t0 + 60 * plan.minutes:
            now = time.time() - t0
            while pending and pending[0][0] <= now:
                _, what, peer = pending.pop(0)
                if what == "join":
                    join(peer)
                else:
                    launch.stop(procs[peer.name], signal.SIGKILL, 10)
                    events.append({"event": "kill", "peer": peer.name, "unix": time.time()})
                    logger.info("killed %s (SIGKILL)", peer.name)
            status, _ = files.read_status(run_dir)
            if plan.epochs is not None and status.epoch >= plan.epochs:
                break
            if now - last_print >= 30:
                last_print = now
                logger.info("t=%4.0fs epoch %d, %d peers reporting, %.2f samples/s", now, status.epoch,
                            len(status.peers), status.samples_per_second)
            if coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited; see {out_dir}/logs/coordinator.log")
            time.sleep(1.0)
        events.append({"event": "stop", "unix": time.time(), "loadavg": os.getloadavg()})
        logger.info("stopping the peers (they leave as with Ctrl-C and write their summaries)")
        running = [p for p in procs.values() if p.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 150  # a clean leave is bounded by about 105 s (crowdtrain.swarm.peer)
        for proc in running:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a second SIGINT would make it quit without its summary
                launch.stop(proc, signal.SIGKILL, 10)
        launch.stop(coordinator, signal.SIGTERM, 60)

    from crowdtrain.testbed.counters import load

    result = {"plan": plan.to_dict(), "events": events, "t0": t0,
              "peers": {p.name: _read_json(out_dir / f"{p.name}.json") for p in plan.peers},
              "metrics": files.read_metrics(run_dir / files.METRICS)[0],
              "counters": load(out_dir / "counters.jsonl")}
    missing = [name for name, s in result["peers"].items() if s is None
               and not any(e["event"] == "kill" and e.get("peer") == name for e in events)]
    if missing:
        logger.warning("no summary from %s; see their logs in %s", ", ".join(missing), out_dir / "logs")
    (out_dir / "run.json").write_text(json.dumps(result))
    return result
