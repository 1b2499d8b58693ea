"""What sync and DiLoCo mode share about averaging rounds: the typed record of a round, the
peer's log of them, who offers its state to downloaders at what priority, how a peer finds out
that the swarm finished a round without it (:class:`LeftOutWatch`), how a peer that leaves a
scheduled round (to download the state, or to go) lets its group finish without it, and what
the swarm's progress records say (its epoch now, who is behind, whether it is at its start).

A round record is what a peer's summary (``join --summary-file``), its metrics and the tests
read. Fields that only one mode measures are None (left out of :meth:`RoundSummary.to_dict`) or
False in the other.

State offers: hivemind's downloaders (newcomers, peers catching up, the coordinator's
checkpointer) take the state of the peer offering the highest priority, and peers read each
other's offers to learn how far the swarm got (``crowdtrain.swarm.hivemind_seam.state``). The
integer part of a priority is the epoch of the state on offer. :class:`StateOffer` is the one
place a trainer offers, demotes or withdraws its state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from hivemind.averaging.control import AveragingStage

from crowdtrain.swarm.hivemind_seam.records import progress_records, read_latest, state_offers_key

logger = logging.getLogger(__name__)


@dataclass
class RoundSummary:
    epoch: int  # the epoch whose round this was (the step from epoch to epoch + 1)
    group_size: int  # peers in this peer's group (1: it used its own tensors)
    swarm_peers: int  # peers the swarm reported when the round started
    weight: float = 0.0  # samples this peer put into the round
    credited: bool = False  # its samples went into the swarm's step (crowdtrain.swarm.metrics.Ledger)
    round_weight: float = 0.0  # what this peer's reducers averaged, summed over the round's senders
    # sync mode: wall-clock times (comparable across peers on one machine) when the round was
    # triggered (this peer reached the target batch), its all-reduce began, and it ended
    triggered_unix: float | None = None
    allreduce_unix: float | None = None
    done_unix: float | None = None
    left_out: bool = False  # the swarm finished the round without this peer
    partial: bool = False  # a groupmate failed mid-round: part of the average is this peer's own
    # DiLoCo mode
    seconds: float | None = None  # from the sync point to the outer step
    overlapped: bool = False  # inner steps went on during the round
    inner_steps_during: int = 0
    bytes_sent: int | None = None
    aggregate_s: float | None = None
    parts_dropped: int | None = None
    params_sha: str | None = None  # digest of the global parameters after the outer step
    diverged: bool = False  # this peer's group ended apart from the swarm's canonical state
    healed: bool = False  # ... and this peer then downloaded the canonical state
    overtaken: bool = False  # the swarm stepped on before this peer could compare states

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class RoundLog:
    """A peer's rounds, appended by its averaging thread and read by its training loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[RoundSummary] = []

    def append(self, record: RoundSummary) -> None:
        with self._lock:
            self._records.append(record)

    def last(self) -> RoundSummary | None:
        with self._lock:
            return self._records[-1] if self._records else None

    def mark(self, epoch: int, **flags) -> bool:
        """Set ``flags`` on the record of ``epoch`` if it is the latest (False if it is not)."""
        with self._lock:
            if not self._records or self._records[-1].epoch != epoch:
                return False
            for name, value in flags.items():
                setattr(self._records[-1], name, value)
            return True

    def __getitem__(self, index: int) -> RoundSummary:
        with self._lock:
            return self._records[index]

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def to_dicts(self) -> list[dict]:
        with self._lock:
            return [r.to_dict() for r in self._records]


class StateOffer:
    """Whether, and at what priority, a trainer offers its state (client-mode peers never do)."""

    def __init__(self, averager, *, client_mode: bool):
        self.averager, self.client_mode = averager, client_mode

    def offer(self, priority: float) -> None:
        """Offer the state at ``priority`` (its integer part: the state's epoch)."""
        if not self.client_mode:
            self.averager.allow_state_sharing = True
            self.averager.state_sharing_priority = priority

    def demote(self, epoch: int) -> None:
        """Our parameters took (or take) a step the swarm did not: until we download the group's
        state, rank ours below every peer of ``epoch`` that averaged in full and above any older
        state. Offered at our epoch they would tie with the group's, and the coordinator's
        checkpointer, a newcomer or another left-out peer could take them; not offered at all,
        such peers would take the coordinator's copy, epochs old when nobody else serves."""
        if not self.client_mode:
            self.averager.state_sharing_priority = epoch - 0.5

    def withdraw(self) -> None:
        """Offer nothing (while we download: another peer left out of the same round would take ours)."""
        if not self.client_mode:
            self.averager.allow_state_sharing = False


@runtime_checkable
class Trainer(Protocol):
    """What ``crowdtrain.swarm.peer``'s training loop uses of a mode's optimizer
    (``crowdtrain.swarm.optimizer.SwarmOptimizer``, ``crowdtrain.swarm.diloco.DiLoCoOptimizer``)."""

    rounds: RoundLog
    ledger: Any  # crowdtrain.swarm.metrics.Ledger: the samples its rounds credited
    tracker: Any  # hivemind's ProgressTracker: the swarm's progress
    state_averager: Any  # the averager that serves this peer's state to downloaders

    @property
    def local_epoch(self) -> int: ...

    def book_first_round(self, batch_size: int) -> None:
        """Before this peer's first step: book the epoch's round now if the epoch ends within a
        guess of that step plus the matchmaking time (:func:`refresh_for_first_round`)."""

    def step(self) -> None:
        """After ``backward()``: this batch counts toward the swarm's; at the target, a round."""

    def zero_grad(self) -> None: ...

    def load_state_from_peers(self) -> None:
        """Download the swarm's newest state (at join, and when the parameters went bad)."""

    def last_round(self) -> RoundSummary | None: ...

    def averaging_stats(self) -> dict: ...

    def finish_pending_updates(self) -> None:
        """Before leaving: apply what is in flight and end on the swarm's state."""

    def shutdown(self) -> None: ...


class LeftOutWatch:
    """Whether the swarm finished a round without this peer, for both modes. A peer still looking
    for a group a matchmaking time after its round started, while ``went_on()`` says that round
    is over, was left out: waiting out the averaging timeout would only let the others leave
    before it downloads their state. ``went_on`` is the mode's evidence, a DHT read: sync mode
    reads the signed records of peers that finished the round in a group, DiLoCo the state offers
    of a later epoch (its progress records move on when a round starts, so they cannot tell)."""

    def __init__(self, control, *, matchmaking_time: float, went_on: Callable[[], bool],
                 started: float | None = None):
        self.control, self.went_on = control, went_on
        self.started = time.monotonic() if started is None else started
        self._next_read = self.started + matchmaking_time

    def left_out(self, *, every: float = 1.0) -> bool:
        """Check now. Reads the DHT at most once per ``every`` seconds: with a short ``every`` a
        left-out peer starts its download sooner; each read asks several DHT peers."""
        now = time.monotonic()
        if now < self._next_read:
            return False
        self._next_read = now + every
        return self.control.stage == AveragingStage.LOOKING_FOR_GROUP and bool(self.went_on())


def release_scheduled(control, timeout: float) -> None:
    """Leave a round this peer scheduled ahead (before a state download, or when it goes). One no
    group waits on yet (not triggered, idle or still looking for a group) is cancelled: tagging
    along would block until that round ends, maybe an epoch away (seen: 25 s). Otherwise tag along
    (:func:`tag_along`), so the group does not stall waiting for us."""
    if control is None or control.done():
        return
    if not control.triggered and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
        control.cancel()
    else:
        tag_along(control, timeout)


def tag_along(control, timeout: float) -> None:
    """Let a round this peer scheduled (``control``: hivemind's StepControl) go on without its
    tensors counting: weight 0, so the group that may be waiting for us does not stall; wait up to
    ``timeout`` for it to end, and cancel it if it fails."""
    try:
        if not control.triggered:
            control.weight = 0
            control.allow_allreduce()
        control.result(timeout)
    except BaseException as e:
        logger.debug("a round this peer tagged along failed: %r", e)
        if not control.done():
            control.cancel()


def swarm_epoch_now(tracker) -> int:
    """The newest epoch any peer reports, read from the DHT now: a paused ProgressTracker's view is
    frozen (during a round or a state download). Falls back to the tracker's view."""
    records = progress_records(tracker) or []
    return max([tracker.global_epoch, *(r["epoch"] for r in records)])


def peers_behind(tracker, epoch: int, *, exclude: bytes = b"") -> list[bytes]:
    """Peers whose progress record reports an epoch below ``epoch`` (empty if the DHT does not answer)."""
    return [r.get("peer_id", b"") for r in progress_records(tracker) or []
            if r["epoch"] < epoch and r.get("peer_id", b"") != exclude]


def nobody_else(tracker, *, me: bytes) -> bool:
    """True only if the DHT answers that no peer but ``me`` reports progress: the others left (a
    clean leave erases a peer's record) or their records expired. False when in doubt."""
    records = progress_records(tracker)
    return records is not None and all(r.get("peer_id", b"") == me for r in records)


def swarm_at_start(tracker, state_averager) -> bool:
    """True only if the DHT answers that no peer reports an epoch past 0 and no state of a later
    epoch is on offer (the coordinator's auxiliary peer offers the last checkpoint's); False when
    in doubt (the DHT does not answer)."""
    try:
        progress = read_latest(tracker.dht, tracker.training_progress_key)
        offers = read_latest(state_averager.dht, state_offers_key(state_averager.prefix))
    except Exception as e:
        logger.debug("could not read the swarm's progress: %r", e)
        return False
    epochs = [tracker.global_epoch]
    for found, read in ((progress, lambda v: v["epoch"]), (offers, lambda v: int(float(v)))):
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for entry in entries.values():
            try:
                epochs.append(int(read(entry.value)))
            except (KeyError, TypeError, ValueError):
                continue
    return max(epochs) == 0


class StepClock:
    """How long this peer's steps take: the median of the last ``window`` intervals between calls
    of :meth:`tick` (one per optimizer step). A median, not a mean, so the step that carries a
    round or a state download does not stretch the estimate."""

    def __init__(self, window: int = 8, clock: Callable[[], float] = time.monotonic):
        self.intervals: collections.deque[float] = collections.deque(maxlen=window)
        self.clock, self.last = clock, None

    def tick(self) -> None:
        now = self.clock()
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now

    @property
    def step_s(self) -> float:
        return statistics.median(self.intervals) if self.intervals else 0.0


def gradient_round_lookahead_s(*, matchmaking_time: float, step_s: float, averaging_timeout: float) -> float:
    """How long before the epoch's estimated end (sync mode) or sync point (DiLoCo mode) a peer
    books its place in the round.

    A peer looks at the clock only between its steps, so it must book at the last step that starts
    before the epoch ends: up to one step time plus the matchmaking time ahead. hivemind looks
    ``matchmaking_time`` ahead only, so a peer whose steps are longer than that usually finds the
    epoch already over, starts matchmaking when its step ends (anywhere in a window one step long)
    and the swarm splits into several groups (16 peers with 15 s steps and 5 s of matchmaking: 2-3
    groups every round). Capped at a third of the averaging timeout: the booked round must
    start within it, and DiLoCo mode starts a fresh search where less than half of it is left at
    the sync point."""
    return min(matchmaking_time + step_s, averaging_timeout / 3)


def first_step_guess_s(records: list[dict] | None, *, me: bytes, batch_size: int) -> float:
    """How long a newcomer's first step may take, before it has timed one: its batch at the median
    speed the other peers report (0.0 when none reports a speed). Volunteers of one run are alike
    more often than not; one slower than the guess joins the booked round late, and its groupmates
    wait for its part up to the next-chunk timeout (``crowdtrain.runspec.swarm``)."""
    rates = [r.get("samples_per_second") for r in records or [] if r.get("peer_id", b"") != me]
    rates = [float(x) for x in rates if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0]
    return batch_size / statistics.median(rates) if rates else 0.0


def refresh_for_first_round(tracker, *, me: bytes, batch_size: int) -> float:
    """Before a newcomer's first step: read the swarm's progress now (the tracker's background
    fetch may not have run since the join) and return :func:`first_step_guess_s`. hivemind looks
    at the clock only after a step, so a peer that joined late in an epoch looked first when its
    first step ended, after the others' round had formed: it was left out of the round it had
    computed for (its samples thrown away, the state downloaded), and the round was one short.
    0.0 when no other peer reports a speed: nobody is training, there is no round to book (the
    tracker, having seen nobody, would put the epoch's end at once)."""
    records = progress_records(tracker)
    guess_s = first_step_guess_s(records, me=me, batch_size=batch_size)
    if guess_s > 0:
        try:
            tracker.refresh()
        except Exception as e:  # the DHT is busy: the tracker's own view stands
            logger.debug("could not refresh the swarm's progress: %r", e)
    return guess_s


async def _probe_peers(dht, node, peer_ids: list[bytes]) -> dict[bytes, str | None]:
    """In the DHT process: :func:`crowdtrain.swarm.hivemind_seam.p2p.probe` each peer."""
    import asyncio

    from hivemind.p2p import PeerID

    from crowdtrain.swarm.hivemind_seam.p2p import probe

    async def one(peer: bytes):
        try:
            return await asyncio.wait_for(probe(node.protocol.p2p, PeerID(peer)), timeout=10.0)
        except asyncio.TimeoutError:
            return "no answer within 10 s"

    return dict(zip(peer_ids, await asyncio.gather(*(one(p) for p in peer_ids))))


class LonelyRoundCheck:
    """After a round that found no group while other peers were training ("Averaging step failed:
    could not find a group"), find out why, once in a while, and say it: whether this peer can
    reach each other peer in the swarm's progress records the way matchmaking does (by peer ID).
    A peer it cannot reach is named with the p2p daemon's error ("routing: not found": libp2p
    knows no address for it; a dial error: its address does not accept connections). When every
    peer answered, the network is not the cause, and the line says so. Runs in the background,
    at most once per ``every_s``: a trainer must not wait on it."""

    def __init__(self, dht, tracker, *, every_s: float = 120.0):
        self.dht, self.tracker, self.every_s = dht, tracker, every_s
        self._last = -float("inf")
        self.verdicts: list[dict] = []  # per check: {peer (base58): error or None}

    def after(self, epoch: int, *, group_size: int, swarm_peers: int) -> threading.Thread | None:
        if group_size >= 2 or swarm_peers < 2 or time.monotonic() - self._last < self.every_s:
            return None
        self._last = time.monotonic()
        thread = threading.Thread(target=self._check, args=(epoch,), name="lonely-round-check", daemon=True)
        thread.start()
        return thread

    def _check(self, epoch: int) -> None:
        import functools

        from hivemind.p2p import PeerID

        me = self.dht.peer_id.to_bytes()
        others = sorted({r.get("peer_id") for r in progress_records(self.tracker) or []
                         if isinstance(r.get("peer_id"), bytes) and r.get("peer_id") != me})
        if not others:
            return
        try:
            found = self.dht.run_coroutine(functools.partial(_probe_peers, peer_ids=others[:16]))
        except Exception as e:  # the DHT is shutting down
            logger.debug("could not probe the swarm's peers: %r", e)
            return
        verdicts = {PeerID(p).to_base58(): error for p, error in found.items()}
        self.verdicts.append(verdicts)
        failed = {peer: error for peer, error in verdicts.items() if error}
        if failed:
            logger.warning("epoch %d's round found no group: this peer cannot reach %d of the %d other peers (%s). "
                           "A peer it cannot reach cannot be its groupmate: 'routing: not found' means libp2p "
                           "knows no address for it (check the coordinator's --dht-host/--public-host and this "
                           "peer's network); a dial error means its address does not accept connections (it "
                           "should join with --client-mode, or open its port)", epoch, len(failed), len(verdicts),
                           "; ".join(f"{peer[-8:]}: {error}" for peer, error in sorted(failed.items())))
        else:
            logger.warning("epoch %d's round found no group, though this peer reaches all %d other peers: the "
                           "network is not the cause (crowdtrain.runspec.swarm's tuning guide lists what else "
                           "makes peers miss each other's rounds)", epoch, len(verdicts))
