"""A volunteer's view of the run's schedule while it trains: extensions arrive, the end is kept.

The organizer extends a live run by restarting the coordinator with a larger total (or a time
budget the coordinator sizes into one, ``crowdtrain.runspec.schedule``); the coordinator's
``GET /api/join`` then hands out the new ``schedule``. :class:`ScheduleWatch` re-reads it every
``poll_s`` seconds (15; while a time budget's total is still unknown, every 5 and at each new
epoch, so that a total sized an epoch ahead is heard before the peer steps past it) in a thread of its own,
one request with a short timeout each time (a coordinator that is down or slow costs nothing but
a debug line: the peer keeps the schedule it has), and moves the :class:`crowdtrain.optim.Schedule`
the optimizer reads at every step. Tuning: a shorter ``poll_s`` brings peers closer to each other
after an extension, at one small HTTP request per peer per period on the coordinator.

Why the coordinator's HTTP and not a signed DHT record: volunteers already trust that endpoint for
the whole run's settings and talk to it to renew their access tokens; the schedule only changes
when the coordinator restarts, and while it is down nobody can change it. A DHT record would
need a new record type that every peer's validators accept, and old peers refuse unknown ones.

Only the schedule may change mid-run. Anything else the coordinator now says differently (the
model, the swarm's other settings, the data) is logged as an error once and not applied: the
peer goes on as it joined and must be restarted to take it (a restarted coordinator refuses
such changes anyway, ``crowdtrain.coordinator.restart``).

Peers learn a new total up to ``poll_s`` (plus jitter) apart. Until the last of them has it, the
swarm's peers take a few steps (sync mode: an epoch or two; DiLoCo: some inner steps) at
slightly different rates from the same epoch. That is harmless: the difference is that between
two neighbouring points of two linear decays, and the next averaging round (gradients, state or
pseudo-gradients) mixes whatever it made differ. What must agree is the end: a peer reaching
the total it knows asks the coordinator once more before it leaves (:meth:`ScheduleWatch.at_end`),
so an extension made seconds before the end is not missed.

At the end (the swarm reaches ``total_epochs``) each volunteer finishes its last step, waits a
little for the coordinator to save the final model from the peers still there
(:meth:`ScheduleWatch.wait_for_final_checkpoint`), says so and leaves with exit code 0.
A volunteer joining a finished run stops at once with that message (:func:`check_not_finished`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import time
import urllib.request

from crowdtrain.optim import Schedule
from crowdtrain.runspec.schedule import RunSchedule, finished_message
from crowdtrain.runspec.swarm import PEER_LOCAL_SETTINGS, SCHEDULE_SETTINGS
from crowdtrain.runspec.typed import typed_config

logger = logging.getLogger(__name__)

SIZING_POLL_S = 5.0  # how often to ask while the total is still being sized to a time budget


class RunFinished(ValueError):
    """The run has reached its last epoch: there is nothing to train (``crowdtrain join`` exits 2)."""


def run_schedule(info: dict, swarm=None) -> RunSchedule:
    """The schedule in a coordinator's join information, checked (a ValueError names the field);
    a coordinator from before schedules gives only its swarm settings' fixed total."""
    schedule = info.get("schedule") if isinstance(info, dict) else None
    if schedule is None:
        source = swarm.to_dict() if swarm is not None else (info.get("swarm") or {})
        return RunSchedule(total_epochs=source.get("total_epochs"), warmup_epochs=source.get("warmup_epochs", 0))
    if isinstance(schedule, dict):  # fields a newer coordinator adds are not this peer's business
        known = {f.name for f in dataclasses.fields(RunSchedule)}
        schedule = {k: v for k, v in schedule.items() if k in known}
    return typed_config(RunSchedule, schedule, "schedule").check()


def check_not_finished(info: dict, url: str) -> None:
    """Refuse to join a run that has finished: it would train at a learning rate of zero."""
    try:
        schedule = run_schedule(info)
    except (ValueError, TypeError, AttributeError):
        return  # join_info's full check names what is wrong
    if schedule.finished:
        raise RunFinished(f"{finished_message(schedule, url)}. This run has finished, so there is nothing to train; "
                          "join again if the organizer extends it")


def _fixed_part(info: dict) -> dict:
    """What must not change while a peer trains: everything handed out but the schedule, the
    addresses and the initial model (which stops being offered once the run moves on)."""
    swarm = {k: v for k, v in (info.get("swarm") or {}).items() if k not in SCHEDULE_SETTINGS}
    tokenizer = info.get("text_tokenizer") if isinstance(info.get("text_tokenizer"), dict) else {}
    return {"run_id": info.get("run_id"), "fingerprint": info.get("fingerprint"), "swarm": swarm,
            "task": info.get("task"), "text_tokenizer": tokenizer.get("sha256")}


# What a restarted coordinator may change without the swarm training apart (crowdtrain.coordinator.restart).
_MIXABLE = {f"swarm.{k}" for k in PEER_LOCAL_SETTINGS} | {"task.data"}


def _differences(old, new, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))
        return out
    return [] if old == new else [f"{path}: {json.dumps(old)[:80]} -> {json.dumps(new)[:80]}"]


class ScheduleWatch:
    """Keeps ``schedule`` (read by the optimizer) equal to the coordinator's, see the module docstring.

    ``fetch``: a function returning the join information (tests pass a fake); by default one GET
    of ``URL/api/join`` with ``timeout_s``.
    """

    def __init__(self, url: str, joined: dict, schedule: Schedule, *, api_key: str | None = None,
                 poll_s: float = 15.0, timeout_s: float = 5.0, confirm_s: float = 30.0, fetch=None, trust=None):
        self.url = url.rstrip("/")
        self.schedule = schedule
        self.poll_s, self.timeout_s, self.confirm_s = poll_s, timeout_s, confirm_s
        self.api_key = api_key
        self.trust = trust  # a crowdtrain.runspec.trust.CoordinatorTrust: answers must be signed by the run's key
        self._fetch = fetch or (lambda: self._get("/api/join"))
        self._joined = _fixed_part(joined)
        self._reported: set = set()  # differences already logged
        self.state = run_schedule(joined)
        self._stop = threading.Event()
        self._wake = threading.Event()  # ask now (a new epoch while the total is being sized)
        self._epoch_asked: int | None = None
        self._thread: threading.Thread | None = None
        self.polls = self.failures = 0

    # -- the coordinator

    def _get(self, path: str):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        nonce = None
        if self.trust is not None and path == "/api/join":
            fresh, nonce = self.trust.request_headers()
            headers.update(fresh)
        with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers),
                                    timeout=self.timeout_s) as response:
            body = response.read()
            # The join information is acted on (the schedule): signed. The status (has the final
            # model been saved?) only decides when to leave: the coordinator does not sign it.
            if self.trust is not None and path == "/api/join":
                self.trust.check(body, response.headers, f"the answer of {self.url}{path}", nonce)
            return json.loads(body)

    def poll_once(self) -> bool:
        """Read the coordinator's schedule once and take it; False if it could not be read."""
        self.polls += 1
        try:
            info = self._fetch()
        except Exception as e:  # down, restarting, slow: keep the schedule we have
            self.failures += 1
            logger.debug("could not re-read the run's schedule from %s: %r", self.url, e)
            return False
        self.apply(info)
        return True

    def apply(self, info) -> None:
        """Take the schedule of ``info`` (join information); log anything else that changed, once."""
        if not isinstance(info, dict):
            logger.warning("the coordinator answered %s/api/join with a JSON %s; keeping the schedule this peer "
                           "has", self.url, type(info).__name__)
            return
        fresh = [d for d in _differences(self._joined, _fixed_part(info)) if d not in self._reported]
        self._reported.update(fresh)
        mixable = [d for d in fresh if d.split(":")[0] in _MIXABLE]
        breaking = [d for d in fresh if d not in mixable]
        if mixable:
            logger.info("the coordinator now hands out %s to newcomers; this peer keeps the values it joined with "
                        "until it rejoins", "; ".join(mixable))
        if breaking:
            logger.error("the coordinator now hands out other settings than this peer joined with (%s); only the "
                         "schedule may change while a peer trains, so this peer goes on with the settings it "
                         "joined with: restart it to take the new ones", "; ".join(breaking))
        try:
            state = run_schedule(info)
        except (ValueError, TypeError) as e:
            logger.warning("the coordinator's schedule is not valid (%s); keeping the one this peer has", e)
            return
        old = (self.schedule.warmup_epochs, self.schedule.total_epochs)
        self.state = state
        if self.schedule.update(warmup_epochs=state.warmup_epochs, total_epochs=state.total_epochs):
            warmup = f", warmup_epochs {old[0]} -> {state.warmup_epochs}" if old[0] != state.warmup_epochs else ""
            logger.info("the run's schedule changed: total_epochs %s -> %s%s%s", _show(old[1]),
                        _show(state.total_epochs), warmup,
                        " (sized to the time budget)" if state.sized_at is not None and old[1] is None else "")

    # -- the thread

    def start(self) -> "ScheduleWatch":
        self._thread = threading.Thread(target=self._run, name="schedule-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # Jitter spreads the swarm's requests; it adds to how far apart peers learn a change. While
        # a time budget is being sized the total arrives soon and once: ask more often then.
        while True:
            every = self.poll_s if self.schedule.total_epochs is not None else min(self.poll_s, SIZING_POLL_S)
            self._wake.wait(every * random.uniform(0.8, 1.2))
            self._wake.clear()
            if self._stop.is_set():
                return
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)

    # -- the end

    def final_epoch(self, max_epochs: int | None) -> int | None:
        """The epoch this peer leaves at: ``--max-epochs`` or the run's total, whichever comes first."""
        ends = [e for e in (max_epochs, self.schedule.total_epochs) if e is not None]
        return min(ends) if ends else None

    def at_end(self, epoch: int) -> bool:
        """Whether a peer at global epoch ``epoch`` has reached the run's end. At the total it knows,
        it first asks the coordinator again (for up to ``confirm_s`` if it does not answer): the
        organizer may have extended the run a moment ago. While a time budget's total is being
        sized, a new epoch wakes the watch's thread to ask at once (the request is the thread's:
        a slow coordinator does not hold the step)."""
        if self.state.sizing and epoch != self._epoch_asked:
            self._epoch_asked = epoch
            self._wake.set()
        if not self.schedule.finished(epoch):
            return False
        deadline = time.monotonic() + self.confirm_s
        while not self.poll_once():
            if time.monotonic() >= deadline or self._stop.is_set():
                logger.warning("could not reach the coordinator to confirm the run's end; leaving at the total it "
                               "gave last (%s)", self.schedule.total_epochs)
                break
            time.sleep(min(2.0, self.timeout_s))
        return self.schedule.finished(epoch)

    def finished_message(self, epoch: int) -> str:
        return finished_message({"total_epochs": self.schedule.total_epochs, "finished_epoch": epoch}, self.url)

    def wait_for_final_checkpoint(self, epoch: int, *, timeout_s: float = 60.0, every_s: float = 2.0) -> bool:
        """After the last step: wait (at most ``timeout_s``) until the coordinator has saved a
        checkpoint of the run's last epoch, downloading it from the peers still here. True if it
        has. ``epoch``: this peer's; past the total when the total reached it late (while it is
        being sized to a time budget a peer asks at each new epoch, and a total sized just after
        it asked can be passed first). The coordinator saves the total's checkpoint, never a
        later one, so a peer waiting for its own epoch waited the whole minute for nothing."""
        total = self.schedule.total_epochs
        epoch = min(epoch, total) if total is not None else epoch
        deadline = time.monotonic() + timeout_s
        logger.info("the run has reached its last epoch; staying up to %.0f s while the coordinator saves the final "
                    "model", timeout_s)
        while time.monotonic() < deadline:
            try:
                status = self._get("/api/status")
                saved = status.get("last_checkpoint_epoch") if isinstance(status, dict) else None
                if isinstance(saved, int) and saved >= epoch:
                    return True
            except Exception as e:
                logger.debug("could not read the run's status: %r", e)
            time.sleep(every_s)
        logger.info("the coordinator has not saved the final model within %.0f s; leaving anyway", timeout_s)
        return False


def _show(total) -> str:
    return "being sized" if total is None else str(total)
