"""`crowdtrain demo`: a whole collaborative run on this machine, on embedded defaults.

Makes the shapes shards if missing, starts a coordinator and N volunteers of different speeds
and batch sizes on 127.0.0.1 (real processes, the same commands people run), prints a live
summary, and at the end the epochs reached, the loss from start to end, samples contributed
per peer and the share of rounds in which all live peers averaged together; it writes a grid
of samples for fixed prompts (seen and held-out compositions) and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

# (batch size, simulated seconds per step): a fast peer, a medium one, a slow device.
PEER_KINDS = [(32, 0.0), (16, 0.0), (8, 1.5)]


def _open_in_browser(url: str) -> None:
    """Open the dashboard where there is a screen to show it on (not on a headless server)."""
    import webbrowser

    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or sys.platform == "darwin":
        try:
            webbrowser.open(url)
        except webbrowser.Error:
            pass


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", *args], stdout=open(log_path, "ab"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


def run_swarm_demo(*, peers: int = 3, minutes: float = 5.0, port: int = 8000, dht_port: int = 31337,
                   out_dir: str = "runs/demo", preset: str = "demo", data: str = "shapes") -> dict:
    if peers < 1:
        raise ValueError(f"--peers must be >= 1, got {peers}")
    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if data == "shapes":
        from crowdtrain.data import ensure_demo_shards

        logger.info("making the bundled shapes data set (once)...")
        data = str(ensure_demo_shards(out / "data" / "shapes"))
    url = f"http://127.0.0.1:{port}"
    coordinator = _spawn(["coordinator", "--run-id", "demo", "--preset", preset, "--data", data, "--host", "127.0.0.1",
                          "--port", str(port), "--dht-host", "127.0.0.1", "--dht-port", str(dht_port),
                          "--run-dir", str(out / "run"), "--swarm-preset", "demo"], out / "logs" / "coordinator.log")
    volunteers: dict[str, subprocess.Popen] = {}
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                _get(f"{url}/api/join")
                break
            except OSError:
                if coordinator.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the coordinator did not start; see {out / 'logs' / 'coordinator.log'}")
                time.sleep(0.5)
        print(f"\ncoordinator up at {url}\n\n    dashboard: {url}/dashboard   (leaderboard, peers, checkpoints, "
              f"samples; API docs at {url}/docs)\n")
        _open_in_browser(f"{url}/dashboard")
        for i in range(peers):
            batch, step_s = PEER_KINDS[i % len(PEER_KINDS)]
            name = f"peer{i + 1}"
            volunteers[name] = _spawn(["join", url, "--batch-size", str(batch), "--simulated-step-s", str(step_s),
                                       "--host", "127.0.0.1", "--threads", "1", "--user", name,
                                       "--summary-file", str(out / f"{name}.json")], out / "logs" / f"{name}.log")
            print(f"  {name}: batch {batch}" + (f", a slow device ({step_s:.1f} s/step)" if step_s else ""))
        print(f"training for {minutes:g} minutes; logs in {out / 'logs'}\n")
        end = time.monotonic() + 60 * minutes
        while time.monotonic() < end:
            time.sleep(min(15.0, max(0.0, end - time.monotonic())))
            if all(proc.poll() is not None for proc in volunteers.values()):
                raise RuntimeError(f"every volunteer exited early; see the logs in {out / 'logs'}")
            try:
                status = _get(f"{url}/api/status")
            except OSError:
                continue
            live = status.get("peers", [])
            loss = sum(p["loss"] for p in live) / len(live) if live else float("nan")
            print(f"[{time.strftime('%H:%M:%S')}] epoch {status['epoch']:4d} | {len(live)} peers | "
                  f"{status.get('samples_per_second', 0):6.1f} samples/s | mean loss {loss:.4f}", flush=True)
    finally:
        for proc in volunteers.values():  # leave cleanly, like Ctrl-C
            _stop(proc, signal.SIGINT, 90)
        _stop(coordinator, signal.SIGTERM, 60)

    summary = summarize(out, list(volunteers))
    summary["url"] = url
    summary["samples_grid"] = write_samples(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    return summary


def summarize(out: Path, names: list[str]) -> dict:
    peers = {}
    for name in names:
        path = out / f"{name}.json"
        if path.is_file():
            peers[name] = json.loads(path.read_text())
    rounds = [r for p in peers.values() for r in p.get("rounds", []) if r["swarm_peers"] >= 2]
    first = [p["epochs"][0]["loss"] for p in peers.values() if p.get("epochs")]
    last = [p["epochs"][-1]["loss"] for p in peers.values() if p.get("epochs")]
    from crowdtrain.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(out / "run" / "checkpoints")
    return {
        "epochs": max((p.get("final_epoch", 0) for p in peers.values()), default=0),
        "loss_start": sum(first) / len(first) if first else None,
        "loss_end": sum(last) / len(last) if last else None,
        "samples_per_peer": {n: p.get("samples", 0) for n, p in peers.items()},
        "full_rounds_share": (sum(r["group_size"] >= r["swarm_peers"] for r in rounds) / len(rounds)) if rounds else None,
        "rounds": len(rounds),
        "checkpoint": str(checkpoint) if checkpoint else None,
    }


def write_samples(out: Path, per_prompt: int = 4) -> str | None:
    """A grid of samples from the latest checkpoint: one row per fixed prompt (seen, then held out)."""
    from crowdtrain.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(out / "run" / "checkpoints")
    if checkpoint is None:
        logger.warning("no checkpoint was written (the run was too short): no samples")
        return None
    import torch
    from PIL import Image

    from crowdtrain.data import EVAL_PROMPTS
    from crowdtrain.data.generate import Generator, make_grid

    gen = Generator.from_checkpoint(checkpoint)
    prompts = list(EVAL_PROMPTS["seen"][:3]) + list(EVAL_PROMPTS["heldout"][:3])
    images = [gen.sample(p, per_prompt, top_k=256, top_p=0.75, temperature=1.0, seed=i)[1] for i, p in enumerate(prompts)]
    grid = make_grid(torch.cat(images), columns=per_prompt)
    grid = grid.resize((grid.width * 3, grid.height * 3), Image.NEAREST)
    path = out / "samples.png"
    grid.save(path)
    (out / "samples.txt").write_text("rows, top to bottom (seen, then held-out compositions):\n" + "\n".join(prompts) + "\n")
    return str(path)


def print_summary(s: dict) -> None:
    print("\n=== demo finished ===")
    print(f"epochs reached       {s['epochs']}")
    if s["loss_start"] is not None:
        print(f"loss                 {s['loss_start']:.4f} -> {s['loss_end']:.4f}")
    for name, n in s["samples_per_peer"].items():
        print(f"samples from {name:<8}{n}")
    if s["full_rounds_share"] is not None:
        print(f"rounds with all live peers  {100 * s['full_rounds_share']:.0f}% of {s['rounds']}")
    print(f"checkpoint           {s['checkpoint']}")
    print(f"samples              {s['samples_grid']}  (prompts in samples.txt)")


def run_local_demo(*, minutes: float, out_dir: str, device: str, batch_size: int) -> dict:
    """The single-process variant (`crowdtrain demo --local`)."""
    from crowdtrain.data import default_asset_paths, ensure_demo_shards
    from crowdtrain.model.config import get_preset
    from crowdtrain.train.local import LocalTrainConfig, train_local
    from crowdtrain.train.task import DalleTask

    shards = ensure_demo_shards(Path(out_dir) / "data" / "shapes")
    task = DalleTask(get_preset("demo"), data=str(shards))
    summary = train_local(task, LocalTrainConfig(batch_size=batch_size, max_minutes=minutes, max_steps=100_000,
                                                 device=device, out_dir=out_dir, lr=3e-3),
                          assets=default_asset_paths())
    print(f"\nloss {summary['loss_start']:.4f} -> {summary['loss_end']:.4f} in {summary['steps']} steps; "
          f"checkpoint {summary['checkpoint']}")
    return summary
