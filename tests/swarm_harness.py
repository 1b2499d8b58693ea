"""What the swarm tests check on a finished run of real processes (started by
``crowdtrain.launch.LocalSwarm``): the ledger identity, a fresh run's first rounds, a newcomer
storm's figures, log noise."""

from __future__ import annotations

import time
from pathlib import Path

from crowdtrain.launch import LocalSwarm, get_json
from crowdtrain.swarm.hivemind_seam.state import DOWNLOADED_FROM


def check_ledger(swarm: LocalSwarm, summaries: dict[str, dict], timeout: float = 40.0) -> dict:
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


def fresh_start_failures(summaries: dict[str, dict], *, rounds: int) -> list:
    """What went wrong in the first ``rounds`` rounds of peers that joined a new run together;
    empty for a clean start. The stall this guards against: every peer's first round failed with
    "could not find a group", then each waited 30 s for a state nobody had, so an epoch took a
    minute instead of seconds. Peers up from the start (joined at epoch 0: on a busy machine a
    process can take longer to start than the first epoch lasts, and join at the second) built
    the run's initial model, with no download, and all met in the first round; no peer was alone
    in its first ``rounds`` rounds (a peer starved of CPU may miss part of a round and catch up by
    downloading the state)."""
    starters = [name for name, s in summaries.items() if s["joined_epoch"] == 0]
    failures = []
    if not starters:
        failures.append(("no peer joined at epoch 0", {n: s["joined_epoch"] for n, s in summaries.items()}))
    for name, s in summaries.items():
        groups = [r["group_size"] for r in s["rounds"]][:rounds]
        first_in_full = s["joined_epoch"] > 0 or (groups and groups[0] == len(starters))
        if not groups or min(groups) < 2 or not first_in_full:
            failures.append((name, groups, f"{len(starters)} started together"))
        if s["joined_epoch"] == 0 and not s.get("state_download_skipped"):
            failures.append((name, "downloaded a state instead of building the initial model"))
    return failures


def newcomer_storm(tmp: Path, *, newcomers: int = 4, base_peers: int = 3, mode: str = "sync",
                   target_batch_size: int = 1536, max_state_uploads: int = 1, upload_delay_s: float = 0.0,
                   storm_at_epoch: int = 2, epochs_after: int = 4, step_s: float = 0.0, batch_size: int = 16,
                   matchmaking_time_s: float = 6.0, timeout_s: float = 600.0) -> dict:
    """``base_peers`` train; at ``storm_at_epoch`` ``newcomers`` join at the same moment. Per
    newcomer: the donor it downloaded the state from, how long that took, the epoch it joined at
    and the epoch of its first step that credited its samples (the ledger's first credited round).
    ``step_s``: pad every peer's step to this (``--simulated-step-s``), so that seven peers on two
    cores leave CPU to matchmaking, as peers on their own machines do. ``batch_size``: every
    peer's; with padded steps, a smaller batch and target keep the epochs' length and halve the
    compute. ``matchmaking_time_s``: the tuning guide's (``crowdtrain.runspec.swarm``) for many
    peers sharing a machine's cores, where a would-be leader's averager answers late; at 3 s (a 1 s
    request timeout) the round after a storm fell apart into peers alone while the suite's other
    worker ran beside it."""
    swarm = LocalSwarm(tmp, swarm={"target_batch_size": target_batch_size, "mode": mode, "lr": 0.01,
                              "max_state_uploads": max_state_uploads, "checkpoint_every_epochs": 1000,
                              "matchmaking_time_s": matchmaking_time_s, "averaging_timeout_s": 60.0})
    slow = ["--inject-fault", f"slow-upload={upload_delay_s}"] if upload_delay_s > 0 else []
    if step_s > 0:
        slow += ["--simulated-step-s", str(step_s)]
    try:
        info = swarm.start_coordinator()
        base = [f"p{i + 1}" for i in range(base_peers)]
        new = [f"new{i + 1}" for i in range(newcomers)]
        end = storm_at_epoch + epochs_after + 2  # newcomers start in about 2 epochs on a busy machine
        for name in base:
            swarm.join(name, batch_size=batch_size, max_epochs=end, extra=slow)
        storm_epoch = swarm.wait_epoch(storm_at_epoch, timeout_s)["epoch"]
        t_storm = time.time()
        for name in new:
            swarm.join(name, batch_size=batch_size, max_epochs=end, extra=slow)
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


def process_group(pgid: int) -> dict[int, str]:
    """The live processes of a process group (a run's launcher starts each in its own): pid -> command."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except (OSError, ValueError):
            continue
    return members


def wait_for_groups_to_end(pgids: dict[str, int], timeout: float) -> None:
    """Until no process is left in the named process groups (each a signalled top process's)."""
    deadline = time.monotonic() + timeout
    left = {name: process_group(pgid) for name, pgid in pgids.items()}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(1)
        left = {name: process_group(pgid) for name, pgid in pgids.items()}
    assert not any(left.values()), f"processes left after their top process was signalled: {left}"
