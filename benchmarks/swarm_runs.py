"""Run one swarm on 127.0.0.1 to completion and summarise it (shared by bench_diloco and bench_robust)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crowdtrain.launch import LocalSwarm  # noqa: E402
from crowdtrain.train.validate import pattern_loss  # noqa: E402


def run(tmp: Path, *, swarm: dict, peers: list[tuple[str, int, list[str]]], epochs: int,
        timeout_s: float = 1800) -> dict:
    """Start a coordinator and ``peers`` (name, batch size, extra join flags), wait until each
    reaches ``epochs``, and return per-peer summaries plus the held-out loss of saved weights."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    s = LocalSwarm(tmp, swarm=swarm)
    t0 = time.perf_counter()
    try:
        s.start_coordinator()
        for name, batch, extra in peers:
            s.join(name, batch_size=batch, max_epochs=epochs, extra=list(extra))
        codes = {name: s.wait_exit(name, timeout_s) for name, *_ in peers}
        wall = time.perf_counter() - t0
        summaries = {name: s.summary(name) for name, *_ in peers}
        losses = {name: pattern_loss(tmp / f"{name}.safetensors") for name, *_ in peers}
    finally:
        s.close()
    return {"codes": codes, "wall_s": wall, "summaries": summaries, "eval_loss": losses}


def initial_loss() -> float:
    """The held-out loss of the run's initial model (``tiny``, seed 0)."""
    return pattern_loss()
