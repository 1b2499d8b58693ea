"""The run's schedule over its life: how many global epochs it trains, and when it has finished.

The learning rate warms up over ``warmup_epochs`` and decays linearly to zero at ``total_epochs``
(``crowdtrain.optim.Schedule``). Three things move the total while a run lives, and all three
go through ``schedule.json`` in the run folder (:class:`RunSchedule`), which the coordinator
writes at each start and its auxiliary peer updates; the auxiliary peer copies it into
``run.json``, so ``GET /api/join`` hands it to newcomers and to the volunteers already training,
who re-read it every few seconds (``crowdtrain.swarm.schedule_watch``).

- **A time budget** (``crowdtrain coordinator --time-budget 2h``): the total is not guessed but
  sized from the swarm's measured pace, once. The clock starts when the auxiliary peer first
  hears from a training volunteer. While the total is unknown the rate warms up as usual and
  then holds at its peak. Once the swarm has trained for ``min(2 min, a tenth of the budget)``
  and completed at least two global epochs, the auxiliary peer fixes
  ``total_epochs = epoch_now + seconds_left * epochs_per_second``, the pace measured from the
  moments the global epoch changed over the last 3 minutes (:class:`EpochRate`). The warm-up's
  rate does not depend on the total, and the decay starts from the peak wherever the total
  lands, so fixing it then changes nothing already trained.

  Why once, and from epochs: the epoch pace includes everything that makes a run slow (rounds,
  waiting, stalls), where samples/s would miss them; a total fixed once means every peer agrees
  on it after one propagation delay, where re-sizing again and again would move the end (and
  the rate) under the swarm's feet. The limit: the total follows the swarm as it was when
  measured. A swarm that grows later reaches it early, one that shrinks late; the run ends at
  its total, not at the clock. Extend it (below) when it grows; the dashboard's time to the
  end says when it will finish at the current pace.
- **An extension**: the coordinator restarted with a larger ``--swarm total_epochs=N`` (or a new
  ``--time-budget``, counted from when training started) continues the schedule from the
  current epoch: the rate from then on is the one a run planned with the new total from the
  start uses, so it rises a little (from 0 at the old end) and decays to zero at the new total.
- **The end**: when the swarm reaches ``total_epochs`` the run has finished (``finished_at``).
  Volunteers leave after their last step, newcomers are told so instead of training at a zero
  rate, and a restart with a larger total reopens it.

A restart that gives neither ``--swarm total_epochs`` nor ``--time-budget`` keeps the stored
schedule (sized total, budget, finished or not): restarting with the same command changes nothing.

No torch here: the coordinator's web process reads this module.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import typing
from dataclasses import dataclass
from pathlib import Path

from crowdtrain.runspec.files import _read_typed, _Schema, write_json_atomic

logger = logging.getLogger(__name__)

SCHEDULE = "schedule.json"
MAX_BUDGET_S = 366 * 86400
# Sizing a time budget: the pace over this window of recent epochs (at least MIN_TRANSITIONS
# epoch changes, however long they take), measured once the swarm has trained for
# min(SIZING_AFTER_S, SIZING_SHARE x budget). Longer waits average more epochs but leave the
# rate at its peak longer; a fresh run's first epochs are its slowest (start-up, first rounds).
RATE_WINDOW_S = 180.0
MIN_TRANSITIONS = 3
SIZING_AFTER_S = 120.0
SIZING_SHARE = 0.1

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(days?|d|hours?|hrs?|h|minutes?|mins?|m|seconds?|secs?|s)")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str, *, flag: str = "--time-budget") -> float:
    """Seconds in a duration such as ``2h``, ``90m``, ``45min``, ``1h30m`` or ``1.5h``."""
    cleaned = str(text).strip().lower()
    parts, pos = [], 0
    for match in _DURATION_PART.finditer(cleaned):
        if cleaned[pos:match.start()].strip():
            break
        parts.append(match)
        pos = match.end()
    if not parts or cleaned[pos:].strip():
        raise ValueError(f"{flag} {text!r} is not a duration: write it with a unit, e.g. 2h, 90m, 45min or 1h30m")
    seconds = sum(float(m.group(1)) * _UNIT_S[m.group(2)[0]] for m in parts)
    if not 0 < seconds <= MAX_BUDGET_S:
        raise ValueError(f"{flag} {text!r} must be longer than 0 and at most a year")
    return seconds


def format_duration(seconds: float) -> str:
    """``2h``, ``1h30m``, ``45m``, ``30s``: the form :func:`parse_duration` reads."""
    s = int(round(seconds))
    hours, rest = divmod(s, 3600)
    minutes, secs = divmod(rest, 60)
    out = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return out or "0s"


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


@dataclass
class RunSchedule(_Schema):
    """``schedule.json``: the run's schedule now (written by the coordinator at start, then by the
    auxiliary peer), copied into ``run.json`` for volunteers. Times are Unix seconds."""

    total_epochs: typing.Optional[int] = None  # None: being sized to the time budget
    warmup_epochs: int = 0
    time_budget_s: typing.Optional[float] = None
    started: typing.Optional[float] = None  # when training started: the budget counts from here
    sized_at: typing.Optional[float] = None  # when the total was fixed from the measured pace
    sized_epoch: typing.Optional[int] = None  # the global epoch then
    sized_rate: typing.Optional[float] = None  # the pace then, global epochs per second
    finished_at: typing.Optional[float] = None  # when the swarm reached total_epochs
    finished_epoch: typing.Optional[int] = None

    @property
    def sizing(self) -> bool:
        """A time budget whose total is still to be fixed from the measured pace."""
        return self.time_budget_s is not None and self.sized_at is None

    @property
    def ends_at(self) -> float | None:
        """When the time budget runs out (None: no budget, or training has not started)."""
        return None if self.time_budget_s is None or self.started is None else self.started + self.time_budget_s

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    def check(self) -> "RunSchedule":
        if self.warmup_epochs < 0 or (self.total_epochs is not None and self.total_epochs <= self.warmup_epochs):
            raise ValueError(f"the schedule needs 0 <= warmup_epochs < total_epochs, got {self.warmup_epochs} and "
                             f"{self.total_epochs}: lower --swarm warmup_epochs or raise --swarm total_epochs")
        if self.time_budget_s is not None and not 0 < self.time_budget_s <= MAX_BUDGET_S:
            raise ValueError(f"time_budget_s must be in (0, a year], got {self.time_budget_s}")
        return self


def read_schedule(run_dir) -> tuple[RunSchedule | None, str | None]:
    """``schedule.json`` (None while there is none), and a problem if it does not match its schema."""
    schedule, problem = _read_typed(Path(run_dir) / SCHEDULE, RunSchedule)
    if schedule is not None:
        try:
            schedule.check()
        except ValueError as e:
            return None, f"{SCHEDULE}: {e}"
    return schedule, problem


def write_schedule(run_dir, schedule: RunSchedule) -> None:
    write_json_atomic(Path(run_dir) / SCHEDULE, schedule.check().to_dict())


def finished_message(schedule: dict | RunSchedule, public_url: str) -> str:
    """What a volunteer is told when the run has finished (at its end, or trying to join after)."""
    if isinstance(schedule, RunSchedule):
        schedule = schedule.to_dict()
    total = schedule.get("total_epochs")
    epoch = schedule.get("finished_epoch") if schedule.get("finished_epoch") is not None else total
    return (f"the run reached its last epoch ({epoch} of {total}): thank you; the final model is at "
            f"{public_url.rstrip('/')}/checkpoints")


def size_total_epochs(*, epoch: int, remaining_s: float, epochs_per_s: float, warmup_epochs: int) -> int:
    """``total_epochs`` for a swarm at global epoch ``epoch`` with ``remaining_s`` of its budget left
    at ``epochs_per_s``: at least one epoch more than now and than the warm-up."""
    more = max(0.0, remaining_s) * max(0.0, epochs_per_s)
    return max(epoch + 1, warmup_epochs + 1, int(round(epoch + more)))


class EpochRate:
    """The swarm's pace in global epochs per second, from the moments the global epoch was first
    seen to change (the auxiliary peer looks every 2 s, so each is known to a few seconds).

    The pace is ``(epochs between the first and the last change) / (seconds between them)`` over
    the changes of the last ``window_s`` (at least the last ``min_transitions`` changes, however
    old, so a slow swarm still gets one). Between changes it does not creep, as a count of epochs
    over a fixed window would. If the swarm has not moved for more than twice its typical epoch,
    the open interval counts as one more epoch in progress: the pace falls as the stall lasts.
    The first epoch seen is not a change: when it began is unknown.
    """

    def __init__(self, *, window_s: float = RATE_WINDOW_S, min_transitions: int = 2):
        self.window_s, self.min_transitions = window_s, min_transitions
        self._changes: list[tuple[float, int]] = []  # (time first seen, epoch), at each increase
        self._last: int | None = None

    def observe(self, now: float, epoch: int) -> None:
        if self._last is not None and epoch > self._last:
            self._changes.append((now, epoch))
            keep = max(self.min_transitions, MIN_TRANSITIONS)
            while len(self._changes) > keep and self._changes[0][0] < now - 2 * self.window_s:
                self._changes.pop(0)
        elif self._last is not None and epoch < self._last:
            self._changes = []  # the swarm went back (restarted from an older state): start again
        self._last = epoch

    @property
    def changes(self) -> int:
        return len(self._changes)

    def rate(self, now: float, *, min_transitions: int | None = None) -> float | None:
        """Epochs per second, or None before ``min_transitions`` changes have been seen."""
        need = max(2, min_transitions or self.min_transitions)
        recent = [c for c in self._changes if c[0] >= now - self.window_s]
        if len(recent) < need:
            recent = self._changes[-need:]
        if len(recent) < need:
            return None
        (t0, e0), (t1, e1) = recent[0], recent[-1]
        if t1 <= t0 or e1 <= e0:
            return None
        period = (t1 - t0) / (e1 - e0)
        if now - t1 > 2 * period:  # stalled: the next epoch has taken far longer than usual so far
            return (e1 - e0 + 1) / (now - t0)
        return (e1 - e0) / (t1 - t0)


class ScheduleKeeper:
    """The auxiliary peer's side: starts a time budget's clock, sizes its total once, and marks the
    run finished when the swarm reaches the total. ``observe`` after each look at the swarm;
    what it changed is in its return value (log lines) and in ``state`` (write it out)."""

    def __init__(self, state: RunSchedule, *, rate: EpochRate | None = None):
        self.state = state
        self.rate = rate or EpochRate()

    def observe(self, now: float, *, epoch: int, training: bool) -> list[str]:
        """``epoch``: the newest global epoch any peer reported lately (peers that are leaving
        included); ``training``: whether a volunteer is training now."""
        s, changes = self.state, []
        if training:
            self.rate.observe(now, epoch)
        if s.time_budget_s is not None and s.started is None and training:
            s.started = now
            changes.append(f"training started: the time budget of {format_duration(s.time_budget_s)} runs until "
                           f"{_utc(s.ends_at)}")
        if s.sizing and s.started is not None and s.finished_at is None:
            remaining = s.ends_at - now
            after = min(SIZING_AFTER_S, SIZING_SHARE * s.time_budget_s)
            rate = self.rate.rate(now, min_transitions=MIN_TRANSITIONS)
            if (training and rate is not None and now - s.started >= after) or remaining <= 0:
                total = size_total_epochs(epoch=epoch, remaining_s=remaining, epochs_per_s=rate or 0.0,
                                          warmup_epochs=s.warmup_epochs)
                s.total_epochs, s.sized_at, s.sized_epoch, s.sized_rate = total, now, epoch, rate
                pace = (f"the swarm does {rate * 3600:.1f} global epochs an hour ({1 / rate:.1f} s each, measured "
                        f"over its last {self.rate.changes} epoch changes)" if rate else "no pace measured")
                changes.append(f"time budget sized: {pace}, {format_duration(max(remaining, 0))} of "
                               f"{format_duration(s.time_budget_s)} left at epoch {epoch}: total_epochs = {total}")
        if s.total_epochs is not None and s.finished_at is None and epoch >= s.total_epochs:
            s.finished_at, s.finished_epoch = now, epoch
            changes.append(f"the run has finished: the swarm reached epoch {epoch} of {s.total_epochs}")
        return changes

    def epochs_per_second(self, now: float) -> float | None:
        return self.rate.rate(now)


def schedule_at_start(stored: RunSchedule | None, *, total_epochs: int, warmup_epochs: int, explicit_total: bool,
                      explicit_warmup: bool, time_budget_s: float | None, now: float | None = None,
                      reached_epoch: int | None = None) -> tuple[RunSchedule, list[str]]:
    """The schedule a coordinator starts with, and what changed from ``stored`` (log lines).

    ``total_epochs``/``warmup_epochs``: the swarm settings of this start; ``explicit_*``: whether
    the organizer gave them (``--swarm``); a restart keeps the stored values of the ones not
    given. ``reached_epoch``: the newest epoch the run is known to have reached (for the messages).
    """
    now = time.time() if now is None else now
    if explicit_total and time_budget_s is not None:
        raise ValueError("--time-budget and --swarm total_epochs both set the schedule's length: give one of them")
    if stored is None:
        fresh = RunSchedule(total_epochs=None if time_budget_s is not None else total_epochs,
                            warmup_epochs=warmup_epochs, time_budget_s=time_budget_s)
        return fresh.check(), []
    new = dataclasses.replace(stored)
    notes = []
    if explicit_warmup and warmup_epochs != stored.warmup_epochs:
        new.warmup_epochs = warmup_epochs
        notes.append(f"warmup_epochs: {stored.warmup_epochs} -> {warmup_epochs}")
    if explicit_total and (total_epochs != stored.total_epochs or stored.time_budget_s is not None):
        new = dataclasses.replace(new, total_epochs=total_epochs, time_budget_s=None, started=None, sized_at=None,
                                  sized_epoch=None, sized_rate=None)
        old = "being sized" if stored.total_epochs is None else stored.total_epochs
        budget = (f" (was sized to the time budget {format_duration(stored.time_budget_s)})"
                  if stored.time_budget_s is not None else "")
        how = ("extending the run" if stored.total_epochs is None or total_epochs > stored.total_epochs
               else "shortening the run")
        notes.append(f"total_epochs: {old} -> {total_epochs}{budget}: {how}")
    elif time_budget_s is not None and time_budget_s != stored.time_budget_s:
        if stored.started is not None and stored.started + time_budget_s <= now:
            raise ValueError(f"--time-budget {format_duration(time_budget_s)}: the budget counts from when training "
                             f"started ({_utc(stored.started)}), so it ended at "
                             f"{_utc(stored.started + time_budget_s)}; give a longer one, or --swarm total_epochs=N")
        # Re-sized from the swarm's pace after this start; meanwhile a live run keeps its total.
        new = dataclasses.replace(new, time_budget_s=time_budget_s, sized_at=None, sized_epoch=None, sized_rate=None,
                                  total_epochs=None if stored.finished else stored.total_epochs)
        old = "none" if stored.time_budget_s is None else format_duration(stored.time_budget_s)
        since = (f"counted from {_utc(stored.started)}, when training started" if stored.started is not None
                 else "counted from when training starts")
        notes.append(f"time budget: {old} -> {format_duration(time_budget_s)} ({since}): the total is sized again "
                     "from the swarm's pace in the next minutes")
    if stored.finished and (new.total_epochs is None or new.total_epochs > (stored.finished_epoch or 0)):
        new.finished_at = new.finished_epoch = None
        target = "its new time budget" if new.total_epochs is None else f"epoch {new.total_epochs}"
        notes.append(f"the run had finished at epoch {stored.finished_epoch}: it reopens and goes on to {target}")
    if (not new.finished and new.total_epochs is not None and reached_epoch is not None
            and reached_epoch >= new.total_epochs):
        notes.append(f"the run has reached epoch {reached_epoch} already, at or past total_epochs "
                     f"{new.total_epochs}: it finishes at once")
    return new.check(), notes
