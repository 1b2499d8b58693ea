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
from crowdtrain.swarm.state import DOWNLOADED_FROM


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


def check_ledger(swarm: Swarm, summaries: dict[str, dict], timeout: float = 40.0) -> dict:
    """The accounting identity on a finished run (each peer its own user): the leaderboard credits
    each user exactly the samples its peer's ledger credited; per epoch, the peers' credited
    weights add up to what the round averaged as its reducers saw it (``round_weight``, from the
    aggregation side); no user is credited more steps than its peer took part in. Waits for the
    auxiliary peer to read the peers' last records. Returns the leaderboard by user."""
    expected = {name: s["credited_samples"] for name, s in summaries.items()}
    deadline = time.monotonic() + timeout
    while True:
        board = {row["user"]: row for row in get_json(f"{swarm.url}/api/leaderboard")}
        got = {name: board.get(name, {}).get("samples", 0) for name in summaries}
        if got == expected or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert got == expected, f"leaderboard {got} != the peers' ledgers {expected}"
    for name, s in summaries.items():
        assert board[name]["epochs"] == s["credited_steps"], (name, board[name], s["credited_steps"])
        assert s["credited_steps"] <= s["final_epoch"] - s["joined_epoch"] + 1, (name, s["credited_steps"])
        assert sum(c["samples"] for c in s["credits"] if c["credited"]) == s["credited_samples"], name
    # Rounds that every member credited: the members' weights are what the reducers averaged.
    by_epoch: dict[int, list[dict]] = {}
    for s in summaries.values():
        for r in s["rounds"]:
            if "round_weight" in r:
                by_epoch.setdefault(r["epoch"], []).append(r)
    checked = 0
    for epoch, rounds in by_epoch.items():
        seen = max(r["round_weight"] for r in rounds)
        groups = {r["group_size"] for r in rounds}
        if (seen > 0 and len(groups) == 1 and len(rounds) == groups.pop() and all(r["credited"] for r in rounds)
                and not any(r.get("partial") for r in rounds)):
            assert sum(r["weight"] for r in rounds) == seen, (epoch, seen, rounds)
            checked += 1
    assert checked >= 1, f"no round to check the weights of: {by_epoch}"
    print(f"ledger: {expected} credited, as on the leaderboard; {checked} of {len(by_epoch)} rounds' weights "
          "checked against their reducers'")
    return board


def newcomer_storm(tmp: Path, *, newcomers: int = 4, base_peers: int = 3, mode: str = "sync",
                   target_batch_size: int = 1536, max_state_uploads: int = 1, upload_delay_s: float = 0.0,
                   storm_at_epoch: int = 2, epochs_after: int = 4, step_s: float = 0.0,
                   timeout_s: float = 600.0) -> dict:
    """``base_peers`` train; at ``storm_at_epoch`` ``newcomers`` join at the same moment. Per
    newcomer: the donor it downloaded the state from, how long that took, the epoch it joined at
    and the epoch of its first step that credited its samples (the ledger's first credited round).
    ``step_s``: pad every peer's step to this (``--simulated-step-s``), so that seven peers on two
    cores leave CPU to matchmaking, as peers on their own machines do."""
    swarm = Swarm(tmp, swarm={"target_batch_size": target_batch_size, "mode": mode, "lr": 0.01,
                              "max_state_uploads": max_state_uploads, "checkpoint_every_epochs": 1000,
                              "matchmaking_time_s": 3.0, "averaging_timeout_s": 60.0})
    slow = ["--inject-fault", f"slow-upload={upload_delay_s}"] if upload_delay_s > 0 else []
    if step_s > 0:
        slow += ["--simulated-step-s", str(step_s)]
    try:
        info = swarm.start_coordinator()
        base = [f"p{i + 1}" for i in range(base_peers)]
        new = [f"new{i + 1}" for i in range(newcomers)]
        end = storm_at_epoch + epochs_after + 2  # newcomers start in about 2 epochs on a busy machine
        for name in base:
            swarm.join(name, batch_size=16, max_epochs=end, extra=slow)
        storm_epoch = swarm.wait_epoch(storm_at_epoch, timeout_s)["epoch"]
        t_storm = time.time()
        for name in new:
            swarm.join(name, batch_size=16, max_epochs=end, extra=slow)
        codes = {name: swarm.wait_exit(name, timeout_s) for name in base + new}
        wall_s = time.time() - t_storm
        summaries = {name: swarm.summary(name) for name in base + new}
    finally:
        swarm.close()
    names = {s["peer_id"]: name for name, s in summaries.items()}
    names[info["coordinator_peer_id"]] = "coordinator"
    per_newcomer = {}
    for name in new:
        s = summaries[name]
        downloads = [(float(t), names.get(peer, peer)) for t, peer in DOWNLOADED_FROM.findall(swarm.log(name))]
        credited = [c["epoch"] for c in s.get("credits", []) if c["credited"]]
        per_newcomer[name] = {
            "exit_code": codes[name], "joined_epoch": s.get("joined_epoch"), "state_load_s": s.get("state_load_s"),
            "donor": downloads[0][1] if downloads else None, "download_s": downloads[0][0] if downloads else None,
            "downloads": len(downloads), "first_credited_epoch": credited[0] if credited else None,
            "epochs_to_contribute": credited[0] - s["joined_epoch"] if credited and "joined_epoch" in s else None,
            "first_epoch_s": s.get("first_epoch_s")}
    donors: dict[str, int] = {}
    for r in per_newcomer.values():
        if r["donor"]:
            donors[r["donor"]] = donors.get(r["donor"], 0) + 1
    return {"mode": mode, "base_peers": base_peers, "newcomers": newcomers, "storm_epoch": storm_epoch,
            "max_state_uploads": max_state_uploads, "upload_delay_s": upload_delay_s, "wall_s": wall_s,
            "exit_codes": codes, "per_newcomer": per_newcomer, "donors": donors,
            "uploads": {name: summaries[name].get("state_uploads") for name in base + new}}


# Lines no run should print: third-party noise a user cannot act on (crowdtrain/noise.py) and
# warnings about crowdtrain's own settings.
NOISE_LINES = ("Failed to load CPU gemm_4bit_forward", "Another look_for_group is already in progress",
               "request_timeout smaller than min_matchmaking_time", "Detected call of `lr_scheduler.step()`",
               "Task was destroyed but it is pending", "[hivemind.dht.dht._run")


def noise_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE_LINES)]
