"""Start a coordinator and volunteers as processes, and stop them: the one launcher behind
``crowdtrain demo``, the testbed, the tests and the benchmarks.

Each process runs ``python -m crowdtrain.cli ...`` in its own session (a Ctrl-C in the terminal
reaches the launcher alone, which stops each cleanly) and dies with the launcher however that
ends. Stopping signals the whole process group (a peer's DHT and averager children too), then
SIGKILLs it if it has not exited in time.

    swarm = LocalSwarm(Path("runs/x"), swarm={"target_batch_size": 384})
    swarm.start_coordinator()
    swarm.join("peer1", batch_size=16, max_epochs=5)
    swarm.wait_exit("peer1", timeout=600)
    swarm.close()

A headless browser on a dashboard (the web tests, ``benchmarks/screenshot_dashboard.py``) is
Debian's chromium through Playwright, with :data:`CHROMIUM_ARGS`.

The testbed starts the same commands (:func:`coordinator_args`, :func:`join_args`) inside
network namespaces (``crowdtrain.testbed.netns.Testbed.spawn``).
"""

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
from typing import Callable

from crowdtrain.lifecycle import own_session_child

CHROMIUM = os.environ.get("CROWDTRAIN_CHROMIUM", "/usr/bin/chromium")
# Headless without a sandbox (containers run as root) and without chromium's own traffic to Google:
# machines without outside network would see the background services flood refused connections.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def child_env() -> dict:
    """The environment of a launched process: unbuffered logs, one OpenMP thread (peers that
    share a machine would each take every core otherwise)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "crowdtrain.cli", *args]


def settings_args(flag: str, values: dict | None) -> list[str]:
    """``--swarm k=v`` (or ``--model``) pairs, values as JSON."""
    return [a for k, v in (values or {}).items() for a in (flag, f"{k}={json.dumps(v)}")]


def coordinator_args(*, run_id: str, preset: str, data: str, host: str, port: int, dht_port: int, run_dir: Path,
                     swarm_preset: str = "demo", swarm: dict | None = None, model: dict | None = None,
                     dht_host: str | None = None, public_host: str | None = None, extra=()) -> list[str]:
    args = ["coordinator", "--run-id", run_id, "--preset", preset, "--data", data, "--host", host,
            "--port", str(port), *(["--public-host", public_host] if public_host else []),
            "--dht-host", dht_host or host, "--dht-port", str(dht_port), "--run-dir", str(run_dir),
            "--swarm-preset", swarm_preset]
    return [*args, *settings_args("--swarm", swarm), *settings_args("--model", model), *extra]


def join_args(url: str, *, user: str, batch_size: int, host: str, threads: int = 1, max_epochs: int | None = None,
              simulated_step_s: float | None = None, summary_file: Path | None = None,
              save_final: Path | None = None, device: str = "cpu", extra=()) -> list[str]:
    # The CPU unless asked (`join`'s own default is the GPU where torch sees one): the tests',
    # benchmarks' and testbed's figures are CPU figures, on any machine.
    args = ["join", url, "--batch-size", str(batch_size), "--host", host, "--threads", str(threads), "--user", user,
            "--device", device]
    if max_epochs:
        args += ["--max-epochs", str(max_epochs)]
    if simulated_step_s is not None:
        args += ["--simulated-step-s", str(simulated_step_s)]
    if summary_file is not None:
        args += ["--summary-file", str(summary_file)]
    if save_final is not None:
        args += ["--save-final", str(save_final)]
    return [*args, *extra]


def spawn(argv: list[str], log_path: Path, *, env: dict | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own session, output appended to ``log_path``."""
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(),
                                start_new_session=True, preexec_fn=own_session_child)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
    """Signal a process group, then SIGKILL it if it has not exited within ``timeout``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    return proc.returncode


def stop_all(procs, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
    """:func:`stop` for several process groups at once: every group is signalled, then all share
    one ``timeout`` before the ones left are SIGKILLed (stopped one by one, n peers that each take
    their whole clean leave would cost n timeouts)."""
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in live:
        stop(proc, signal.SIGKILL, 10)


def wait_until(condition: Callable[[], bool], timeout_s: float, failed: Callable[[], bool], message: str) -> None:
    """Poll ``condition`` until true; raise RuntimeError(message) on timeout or once ``failed()``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if failed() or time.monotonic() > deadline:
            raise RuntimeError(message)
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for_coordinator(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> dict:
    """The coordinator's join information once its ``/api/join`` answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"the coordinator exited with code {proc.returncode}; see {log_path}:\n{tail}")
        try:
            return get_json(f"{url}/api/join")
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the coordinator did not come up in {timeout_s:.0f}s; see {log_path}")


class LocalSwarm:
    """A coordinator plus volunteers on 127.0.0.1, each a process group; logs, summaries and saved
    weights in ``tmp``. The default swarm settings make ``tiny`` learn visibly in a few short epochs.

    ``samples_every``: the gallery's images from every N-th checkpoint (the coordinator's
    ``--samples-every``). 0 by default: drawing them at every checkpoint of a run with epochs
    of seconds takes a sixth of a core from the peers that share the machine; a run someone will
    look at, or a test of the gallery, asks for 1."""

    def __init__(self, tmp: Path, *, preset: str = "tiny", data: str = "pattern", swarm: dict | None = None,
                 samples_every: int = 0):
        self.tmp = tmp
        self.samples_every = samples_every
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
        self.env = child_env()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        self.procs[name] = spawn(cli(*args), self.tmp / f"{name}.log", env=self.env)
        return self.procs[name]

    def start_coordinator(self, timeout: float = 120.0, extra: list[str] = (), *, wait: bool = True) -> dict | None:
        """Its join information once it answers; with ``wait=False``, None at once (start several,
        then :meth:`coordinator_info` each: their start-ups overlap). Call from the thread that
        outlives the coordinator: it ends with the thread that started it (``die_with_parent``)."""
        self._spawn("coordinator", coordinator_args(
            run_id="test", preset=self.preset, data=self.data, host="127.0.0.1", port=self.port,
            dht_port=self.dht_port, run_dir=self.run_dir, swarm=self.swarm,
            extra=["--samples-every", str(self.samples_every), *extra]))
        return self.coordinator_info(timeout) if wait else None

    def coordinator_info(self, timeout: float = 120.0) -> dict:
        return wait_for_coordinator(self.url, self.procs["coordinator"], timeout, self.tmp / "coordinator.log")

    def join(self, name: str, *, batch_size: int, max_epochs: int, extra: list[str] = ()) -> subprocess.Popen:
        return self._spawn(name, join_args(self.url, user=name, batch_size=batch_size, host="127.0.0.1",
                                           max_epochs=max_epochs, summary_file=self.tmp / f"{name}.json",
                                           save_final=self.tmp / f"{name}.safetensors", extra=extra))

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

    def close(self, grace_s: float = 5.0) -> None:
        """End every process still running, each with its whole group (no daemon is left behind).
        The coordinator gets SIGTERM (it stops within a second, its auxiliary peer with it) and
        ``grace_s`` before SIGKILL. Volunteers still running get SIGKILL at once: one whose DHT and
        averagers took the group's SIGTERM with it cannot leave cleanly and would only wait out
        its own timeouts (a test that checks a clean leave asks for one, ``interrupt_all``)."""
        volunteers = [proc for name, proc in self.procs.items() if name != "coordinator"]
        for proc in volunteers:
            stop(proc, signal.SIGKILL, 10)
        stop_all([proc for name, proc in self.procs.items() if name == "coordinator"], signal.SIGTERM, grace_s)
