"""The run at a glance, as the JSON API (``/api/status``) and every page show it.

Read from the files the auxiliary peer writes in the run folder (``run.json``, ``status.json``) and
the run's database; the problems it lists (rounds failing, volunteers turned away, a model that
memorises) are what an organizer should act on, each saying what to change. Both the service and
the pages import it, and it imports neither; no torch here, as in the rest of ``coordinator/``.
"""

from __future__ import annotations

import time
from pathlib import Path

from crowdtrain import release
from crowdtrain.coordinator.db import Store
from crowdtrain.runspec.files import read_run_info, read_status
from crowdtrain.runspec.validation import memorising_problem

# What a checkpoint folder holds: the service serves exactly these, the checkpoints page links them.
CHECKPOINT_FILES = {"config.json", "model.safetensors", "optimizer.safetensors", "text_tokenizer.json",
                    "image_tokenizer.safetensors"}


def time_to_the_end(*, epoch: int, total: int, epochs_per_second: float | None, samples_per_second: float,
                    target_batch_size: int | None) -> float | None:
    """Seconds until the swarm reaches ``total`` at its recent pace: the auxiliary peer's measure of
    global epochs per second over the last few minutes (``crowdtrain.runspec.schedule.EpochRate``);
    before two epochs have passed, the swarm's samples/s against the target batch. Not the pace
    over a fixed long window: early in a run that window held the minutes before the first volunteer
    arrived and the slow first epochs, and the estimate was 5x too long."""
    if not total:
        return None
    pace = epochs_per_second
    if not pace and target_batch_size:
        pace = samples_per_second / target_batch_size
    return max(total - epoch, 0) / pace if pace and pace > 0 else None


def run_status(run_dir: Path, store: Store) -> dict:
    """The run at a glance, for the API and the pages."""
    info, info_problem = read_run_info(run_dir)
    status, status_problem = read_status(run_dir)
    swarm = info.swarm if info is not None else {}
    schedule = info.schedule if info is not None and isinstance(info.schedule, dict) else None
    live = [p for p in status.peers if isinstance(p, dict)]  # the auxiliary peer lists the live ones only
    epoch = status.epoch
    if schedule is not None:  # total_epochs is None while a time budget is being sized
        total = int(schedule.get("total_epochs") or 0)
        finished_at = schedule.get("finished_at")
    else:  # an auxiliary peer from before schedules
        total, finished_at = int(status.total_epochs or swarm.get("total_epochs") or 0), status.finished_at
    eta_s = None  # unknown while nobody trains: the run is paused, not ending at the old pace
    if live and finished_at is None:
        samples_per_second = sum(float(p.get("samples_per_second") or 0.0) for p in live)
        eta_s = time_to_the_end(epoch=epoch, total=total, epochs_per_second=status.epochs_per_second,
                                samples_per_second=samples_per_second,
                                target_batch_size=swarm.get("target_batch_size") or status.target_batch_size)
        if not total and schedule is not None and schedule.get("time_budget_s") and schedule.get("started"):
            eta_s = max(0.0, schedule["started"] + schedule["time_budget_s"] - time.time())  # the budget's end
    live = _public_peers(status)
    losses = [p["loss"] for p in live]
    task = info.task if info is not None else {}
    problems = [p for p in (info_problem, status_problem, _memorising(store), turned_away(store.counters())) if p]
    for problem in (rounds_failing(status.rounds, status.peers), rounds_short(status.rounds)) if live else ():
        if problem:
            problems.append(problem)
    return {"run_id": info.run_id if info is not None else None, "started": info is not None, "epoch": epoch,
            "total_epochs": total, "target_batch_size": swarm.get("target_batch_size"),
            "active_peers": len(live), "samples_per_second": float(status.samples_per_second),
            "loss": sum(losses) / len(losses) if losses else None, "eta_s": eta_s,
            "epochs_per_second": status.epochs_per_second,
            "finished": finished_at is not None, "finished_at": finished_at, "schedule": schedule or {},
            "last_checkpoint_epoch": status.last_checkpoint_epoch, "updated": status.updated,
            "peers": live, "model": task.get("model", {}), "data": task.get("data"),
            "rounds": status.rounds if isinstance(status.rounds, dict) else {}, "problems": problems}



def rounds_short(rounds: dict) -> str | None:
    """A problem line when most of the swarm's recent rounds formed groups of fewer peers than
    were training (``short`` of ``grouped``, crowdtrain.swarm.metrics.RoundHealth.add_groups):
    rounds splitting into groups, each stepping on its own average (sync mode) so the peers end as
    different models; None while rounds hold the swarm. A newcomer storm shorts a round or two,
    so it takes half the rounds of the window, and at least eight."""
    try:
        grouped, short = int(rounds.get("grouped", 0)), int(rounds.get("short", 0))
        share, swarm = rounds.get("short_median"), int(rounds.get("short_largest_swarm", 0))
        minutes = float(rounds.get("window_s", 300)) / 60
        share = float(share) if share is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
    if grouped < 8 or short < grouped / 2 or share is None:
        return None
    return (f"averaging rounds are missing peers: in the last {minutes:.0f} minutes, {short} of the {grouped} "
            f"rounds peers took in a group held fewer peers than were training (a median of {100 * share:.0f}% "
            f"of up to {swarm} peers). In sync mode each group steps on its own average and the volunteers drift "
            "apart into several models. Usually the volunteers' steps are long against the matchmaking time, or "
            "the estimate of the epoch's end moves: raise --swarm matchmaking_time_s, and averaging_timeout_s to "
            "at least four times the slowest volunteer's step, when starting the coordinator; see docs/scale.md.")

# A volunteer's address (IP and port) is theirs to give: the public status says who trains, not where.
# Identity keys and their proofs (700 of a record's 1,100 bytes) are for the DHT's checks: no
# reader of the status needs them, and 200 dashboards download the list every 5 s.
_PRIVATE_FIELDS = frozenset({"maddrs", "identity", "identity_proof"})
_last_public: list = [None, []]  # [the RunStatus it was made from, the list]; read_status reuses objects


def _public_peers(status) -> list[dict]:
    if _last_public[0] is not status:
        _last_public[:] = [status, [{k: v for k, v in p.items() if k not in _PRIVATE_FIELDS}
                                    for p in status.peers if isinstance(p, dict)]]
    return _last_public[1]


def rounds_failing(rounds: dict, peers: list | None = None) -> str | None:
    """A problem line when many of the swarm's recent rounds averaged with nobody although other
    peers were training (hivemind's "Averaging step failed: could not find a group"); None while
    rounds form. ``rounds``: ``status.json``'s ``rounds`` (crowdtrain.swarm.metrics.RoundHealth);
    ``peers``: its live peers' records.

    It names a cause only where one is checked: every live peer in client mode (their records
    announce no address) is one the coordinator sees; whether peers reach each other, each
    volunteer checks itself after such a round and names the peers it cannot reach, and the
    error, in its own log (``crowdtrain.swarm.rounds.LonelyRoundCheck``)."""
    try:
        total, apart = int(rounds.get("rounds", 0)), int(rounds.get("apart", 0))
        minutes = float(rounds.get("window_s", 300)) / 60
        users = [str(u)[:64] for u in rounds.get("users", [])][:10]
    except (AttributeError, TypeError, ValueError):
        return None
    if total < 4 or apart < max(2, total / 4):
        return None
    line = (f"averaging rounds are failing: in the last {minutes:.0f} minutes, {apart} of the {total} rounds peers "
            f"took averaged with nobody although other peers were training (peers of "
            f"{', '.join(users) or 'unknown users'}). Each such round costs its peers an averaging timeout and "
            "leaves them on different models. ")
    live = [p for p in peers or [] if isinstance(p, dict)]
    if len(live) >= 2 and not any(p.get("maddrs") for p in live):
        return line + (f"All {len(live)} training peers joined with --client-mode, and a client-mode peer can only "
                       "join a group another peer leads: at least one volunteer must join without --client-mode "
                       "from a machine that accepts connections.")
    return line + ("After such a round each of their volunteers checks whether it can reach the other peers and "
                   "says in its log which it cannot, and why ('this peer cannot reach ...'), or that every peer "
                   "answered.")


def turned_away(counters: dict) -> str | None:
    """A problem line when volunteers were turned away for running another crowdtrain."""
    joins, tokens = counters.get("joins_refused_protocol", 0), counters.get("tokens_refused_protocol", 0)
    if not joins and not tokens:
        return None
    return (f"{joins} join attempt(s) and {tokens} token request(s) came from a crowdtrain of another protocol than "
            f"this coordinator's (protocol {release.PROTOCOL}) and were refused; each was told the install line "
            "on the join page. If volunteers keep arriving with an old version, post that line where they found "
            "the run.")


def _memorising(store: Store) -> str | None:
    """The memorising warning (``crowdtrain.runspec.validation``), from every checkpoint's losses."""
    return memorising_problem(store.checkpoints(include_pruned=True))
