"""Start real coordinators and volunteers as separate processes on 127.0.0.1, and clean them up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from crowdtrain.lifecycle import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Swarm:
    """A coordinator plus volunteers, each a process group killed at the end."""

    def __init__(self, tmp: Path, *, preset: str = "tiny", data: str = "pattern", swarm: dict | None = None):
        self.tmp = tmp
        self.port, self.dht_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = tmp / "run"
        self.preset, self.data = preset, data
        # LAMB at 0.1: each step moves every tensor by 10% of its norm, so `tiny` learns visibly in
        # the few epochs a test runs (0.01 is a real run's rate, for thousands of steps).
        self.swarm = {"target_batch_size": 384, "warmup_epochs": 1, "total_epochs": 60, "lr": 0.1,
                      "matchmaking_time_s": 3.0, "averaging_timeout_s": 30.0, "checkpoint_every_epochs": 3,
                      **(swarm or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True, preexec_fn=die_with_parent)
        self.procs[name] = proc
        return proc

    def start_coordinator(self, timeout: float = 120.0, extra: list[str] = ()) -> dict:
        args = ["coordinator", "--run-id", "test", "--preset", self.preset, "--data", self.data,
                "--host", "127.0.0.1", "--port", str(self.port), "--dht-host", "127.0.0.1",
                "--dht-port", str(self.dht_port), "--run-dir", str(self.run_dir), "--swarm-preset", "demo"]
        for k, v in self.swarm.items():
            args += ["--swarm", f"{k}={json.dumps(v)}"]
        self._spawn("coordinator", [*args, *extra])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs["coordinator"].poll() is not None:
                raise RuntimeError("coordinator exited:\n" + self.log("coordinator")[-3000:])
            try:
                return get_json(f"{self.url}/api/join")
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("coordinator did not come up:\n" + self.log("coordinator")[-3000:])

    def join(self, name: str, *, batch_size: int, max_epochs: int, extra: list[str] = ()) -> subprocess.Popen:
        return self._spawn(name, ["join", self.url, "--batch-size", str(batch_size), "--max-epochs", str(max_epochs),
                                  "--host", "127.0.0.1", "--threads", "1", "--user", name,
                                  "--summary-file", str(self.tmp / f"{name}.json"),
                                  "--save-final", str(self.tmp / f"{name}.safetensors"), *extra])

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def summary(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def status(self) -> dict:
        return get_json(f"{self.url}/api/status")

    def wait_epoch(self, epoch: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        status = {}
        while time.monotonic() < deadline:
            try:
                status = self.status()
                if status.get("epoch", 0) >= epoch:
                    return status
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"swarm did not reach epoch {epoch} in {timeout}s (status {status})\n"
                           + "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs))

    def wait_in_step(self, users, timeout: float) -> dict[str, int]:
        """Until every named peer's published epoch is within one of the others' (a peer that
        missed a round catches up by downloading the state); their epochs."""
        deadline = time.monotonic() + timeout
        epochs: dict[str, int] = {}
        while time.monotonic() < deadline:
            try:
                epochs = {p["user"]: int(p["epoch"]) for p in self.status().get("peers", []) if p.get("user") in users}
            except OSError:
                epochs = {}
            if set(epochs) == set(users) and max(epochs.values()) - min(epochs.values()) <= 1:
                return epochs
            time.sleep(1)
        raise TimeoutError(f"peers {sorted(users)} did not get within one epoch of each other in {timeout}s: {epochs}\n"
                           + "\n".join(f"--- {n}\n{self.log(n)[-1500:]}" for n in users))

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"{name} did not finish in {timeout}s:\n{self.log(name)[-3000:]}") from e

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (as Ctrl-C does) and wait for it to end."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=150)  # a clean leave is bounded by about 105 s (crowdtrain.swarm.peer)

    def interrupt_all(self, names, timeout: float = 150.0) -> dict[str, int]:
        """Ctrl-C to several peers at once (each to its whole process group); their exit codes."""
        for name in names:
            if self.procs[name].poll() is None:
                os.killpg(self.procs[name].pid, signal.SIGINT)
        return {name: self.wait_exit(name, timeout) for name in names}

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=20)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


# Lines no run should print: third-party noise a user cannot act on (crowdtrain/noise.py) and
# warnings about crowdtrain's own settings.
NOISE_LINES = ("Failed to load CPU gemm_4bit_forward", "Another look_for_group is already in progress",
               "request_timeout smaller than min_matchmaking_time", "Detected call of `lr_scheduler.step()`",
               "Task was destroyed but it is pending", "[hivemind.dht.dht._run")


def noise_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE_LINES)]
