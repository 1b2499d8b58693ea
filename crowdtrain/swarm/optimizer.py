"""The swarm optimizer: hivemind.Optimizer around an 8-bit LAMB (``crowdtrain.swarm.lamb``), with
the paper's schedule; ``build_optimizer`` picks this (sync mode) or ``crowdtrain.swarm.diloco``.

Each peer accumulates gradients at its own pace; when the swarm together reaches
``target_batch_size`` samples, peers average gradients (weighted by samples), every peer applies
the same LAMB step (one global epoch), and parameters and optimizer statistics are averaged in
the background so peers stay identical. The learning rate is keyed on the global epoch, so a late
joiner uses exactly the rate everyone else does.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Callable

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.dht.crypto import RSASignatureValidator

from crowdtrain.optim import Schedule, param_groups
from crowdtrain.swarm.auth import AccessGuard
from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.swarm.compression import PaperCompression
from crowdtrain.swarm.diloco import DiLoCoOptimizer
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm.hivemind_seam import check_hivemind_version
from crowdtrain.swarm.hivemind_seam.optimizer import OptimizerSeam, RoundHooks
from crowdtrain.swarm.lamb import make_lamb
from crowdtrain.swarm.robust import make_aggregator
from crowdtrain.swarm.rounds import (LeftOutWatch, LonelyRoundCheck, RoundLog, RoundSummary, StateOffer,
                                     nobody_else, peers_behind, refresh_for_first_round, release_scheduled,
                                     swarm_epoch_now)

logger = logging.getLogger(__name__)


def make_scheduler(optimizer, config: SwarmConfig, schedule: Schedule | None = None):
    """hivemind steps this scheduler (in the trainer's process, from its state averager: once per
    global epoch, and after a state download) to the peer's epoch; each step reads ``schedule``
    (default: the config's, fixed), so a total moved while the peer trains takes effect at its next
    epoch. A plain function, not a callable object: LambdaLR would store an object's attributes
    (the schedule's lock) in its state dict."""
    schedule = schedule or Schedule.from_config(config)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: schedule.step_factor(epoch))


_NEVER = 2**62  # an ``average_state_every`` that no epoch reaches


class StateUnavailable(RuntimeError):
    """No peer could serve the swarm's current state for a long time: the run is over or unreachable."""


class CatchUp:
    """Whether a sync-mode peer's parameters are the swarm's after its last rounds, and what it
    does about it. One of:

    - in step: nothing to do;
    - lost (``lost_epoch``): the swarm finished that epoch's round without this peer (or with the
      whole average while ours was partial); its step used its own gradients, so it downloads
      the swarm's state at its next step, or before it leaves;
    - partial (``partial_epoch`` until ``partial_deadline``): the round returned part of the
      average (a groupmate failed, we kept our own gradients there). If a groupmate reports that
      round done in full by the deadline, this peer is lost; if none does, every member's result
      was partial, nobody holds a better state, and this peer is in step again.

    While lost or partial the peer offers its state below its groupmates' (``off_step``). Also
    how long the newest state any peer served has stayed behind the swarm (``behind_since``):
    past ``give_up_s`` the peer stops (:class:`StateUnavailable`)."""

    def __init__(self):
        self.lost_epoch: int | None = None
        self.partial_epoch: int | None = None
        self.partial_deadline = 0.0  # monotonic
        self._partial_read = 0.0  # monotonic, when we last asked the DHT about the partial round
        self.behind_since: float | None = None  # monotonic

    @property
    def off_step(self) -> bool:
        return self.lost_epoch is not None or self.partial_epoch is not None

    def lose(self, epoch: int) -> None:
        self.lost_epoch = epoch

    def partial(self, epoch: int, deadline: float) -> None:
        self.partial_epoch, self.partial_deadline = epoch, deadline

    def resolve_partial(self, finished_in_full: Callable[[int], bool], *, wait: bool) -> bool:
        """Settle a partial round: ``finished_in_full(epoch)`` asks whether a groupmate reports it
        done with the whole average. ``wait``: poll until settled (before leaving), else ask at
        most once a second. True if the peer is in step again (offer its state again)."""
        while self.partial_epoch is not None:
            epoch, now = self.partial_epoch, time.monotonic()
            if wait or now - self._partial_read >= 1.0:
                self._partial_read = now
                if finished_in_full(epoch):
                    logger.warning("epoch %d's round returned part of the average to this peer only; "
                                   "downloading the state of peers that averaged in full", epoch)
                    self.partial_epoch, self.lost_epoch = None, epoch
                    return False
            if now >= self.partial_deadline:
                self.partial_epoch = None
                return self.lost_epoch is None
            if not wait:
                return False
            time.sleep(0.5)
        return False

    def start_download(self) -> int | None:
        """The lost epoch the download below is for (None: a plain catch-up); no longer lost."""
        lost, self.lost_epoch = self.lost_epoch, None
        return lost

    def download_failed(self, lost: int | None) -> None:
        """Nobody served a state: still holding the step the swarm did not take."""
        if lost is not None:
            self.lost_epoch = lost

    def still_behind(self, *, started: float, give_up_s: float) -> float | None:
        """The newest state served is still behind the swarm: seconds it has been so, if past
        ``give_up_s`` (the caller stops), else None."""
        if self.behind_since is None:
            self.behind_since = started
        behind = time.monotonic() - self.behind_since
        return behind if behind > give_up_s else None

    def caught_up(self) -> None:
        self.behind_since = None


def _from_hivemind(name: str, *, writable: bool = False) -> property:
    """An attribute of the hivemind.Optimizer that SwarmOptimizer holds (public ones only)."""

    def get(self):
        return getattr(self.hivemind, name)

    def set_(self, value):
        setattr(self.hivemind, name, value)

    return property(get, set_ if writable else None, doc=f"hivemind.Optimizer's ``{name}``")


class SwarmOptimizer(RoundHooks):
    """Sync mode: hivemind.Optimizer's gradient accumulation, delayed updates and state averaging
    (``self.hivemind``, a :class:`crowdtrain.swarm.hivemind_seam.optimizer.OptimizerSeam`, whose
    averagers aggregate with the run's rule and refuse peers without a valid access token), with
    this object as its hooks: what happens at each step into a new epoch, each gradient round and
    each catch-up is decided here. It has the trainer's interface, as DiLoCoOptimizer
    (:class:`crowdtrain.swarm.rounds.Trainer`), logs each round
    (:class:`crowdtrain.swarm.rounds.RoundSummary`), credits its ledger, and offers its state
    through :class:`crowdtrain.swarm.rounds.StateOffer`.

    A peer left out of a round (the others formed a group without it) would, in hivemind, step
    with its own gradients and train on a diverged model until the next state averaging. Here
    peers that finish a round in a group say so in a signed DHT record
    (``crowdtrain.swarm.metrics.publish_round``); a peer still looking for that round's group stops
    waiting, and downloads the group's state at its next step (or before it leaves)."""

    def __init__(self, *, access_guard: AccessGuard | None = None, give_up_s: float = 600.0,
                 signer: RSASignatureValidator | None = None, final_epoch: int | None = None,
                 leaving: threading.Event | None = None, state_uploads: dict | None = None, **hivemind_kwargs):
        self.give_up_s = give_up_s
        self.rounds = RoundLog()
        self.catch_up = CatchUp()
        self.signer = signer
        self.final_epoch = final_epoch  # this peer leaves on reaching it (``join --max-epochs``)
        self.leaving = leaving  # set when this peer leaves after the step under way (Ctrl-C, SIGTERM)
        self._published = None  # the store of our latest round record
        self.ledger = swarm_metrics.Ledger()
        # hivemind.Optimizer's arguments (hivemind_kwargs) and the seam's: the averagers' access guard
        # and state upload limit, the aggregation rule, the attack (tests only).
        self.hivemind = OptimizerSeam(hooks=self, access_guard=access_guard, state_uploads=state_uploads,
                                      **hivemind_kwargs)
        self.offer = StateOffer(self.state_averager, client_mode=self.client_mode)
        self.lonely = LonelyRoundCheck(self.dht, self.tracker)  # why a round found no group

    # What sync mode reads of the hivemind.Optimizer it holds (and sets: the round it scheduled
    # ahead, and the state-averaging period for the step into its last epoch).
    local_epoch = _from_hivemind("local_epoch")
    tracker = _from_hivemind("tracker")
    grad_averager = _from_hivemind("grad_averager")
    state_averager = _from_hivemind("state_averager")
    dht = _from_hivemind("dht")
    run_id = _from_hivemind("run_id")
    client_mode = _from_hivemind("client_mode")
    matchmaking_time = _from_hivemind("matchmaking_time")
    averaging_timeout = _from_hivemind("averaging_timeout")
    next_chunk_timeout = _from_hivemind("next_chunk_timeout")
    load_state_timeout = _from_hivemind("load_state_timeout")
    delay_grad_averaging = _from_hivemind("delay_grad_averaging")
    use_gradient_averaging = _from_hivemind("use_gradient_averaging")
    scheduled_grads = _from_hivemind("scheduled_grads", writable=True)
    average_state_every = _from_hivemind("average_state_every", writable=True)

    def step(self, *args, **kwargs):
        """hivemind.Optimizer.step: accumulate this batch's gradients; at the swarm's target batch,
        the round and the optimizer step (through the hooks below)."""
        return self.hivemind.step(*args, **kwargs)

    def zero_grad(self, **kwargs) -> None:
        self.hivemind.zero_grad(**kwargs)

    def book_first_round(self, batch_size: int) -> None:
        if not self.use_gradient_averaging:
            return
        guess_s = refresh_for_first_round(self.tracker, me=self.dht.peer_id.to_bytes(), batch_size=batch_size)
        if guess_s > 0:
            self.hivemind.book_gradient_round(max(guess_s, self.hivemind.step_clock.step_s))

    def averaging_stats(self) -> dict:
        return self.hivemind.averaging_stats()

    def shutdown(self) -> None:
        self.hivemind.shutdown()

    def _last_step_ahead(self) -> bool:
        if self.leaving is not None and self.leaving.is_set():
            return True  # the step under way is our last: as at --max-epochs, with no epoch to wait for
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        return self.final_epoch is not None and next_epoch >= self.final_epoch

    def _lone_step_confirmed(self) -> bool:
        """Before a step that would use our gradients alone (the tracker sees no other peer), read
        the swarm's progress afresh: the tracker's view can be a refresh period old, and peers that
        started together would each take their first step alone, their optimizer statistics then
        apart for the rest of the run (two peers ended 10-30% of their training apart). False if
        other peers now show up and the epoch is not due yet: keep accumulating."""
        tracker = self.tracker
        if tracker.global_progress.num_peers > 1:
            return True
        try:
            tracker.refresh()
        except Exception as e:  # the DHT is busy or shutting down: go on as hivemind would
            logger.debug("could not re-read the swarm's progress: %r", e)
            return True
        return tracker.global_progress.num_peers <= 1 or tracker.ready_to_update_epoch

    def around_global_epoch_update(self, upstream) -> None:
        if not self._lone_step_confirmed():
            return
        # The step into our last epoch does not average state: we leave right after it and could
        # not stay for the round, and a groupmate that leaves mid-round leaves the others with a
        # partial average of parameters (seen: a peer ending 0.03 away from the rest). The last
        # gradient round already gave every peer in it the same update.
        if not self._last_step_ahead():
            upstream()
        else:
            every, self.average_state_every = self.average_state_every, _NEVER
            try:
                upstream()
            finally:
                self.average_state_every = every
        if self.catch_up.off_step:
            self._demote_state()  # hivemind just offered our state at the new epoch

    def around_gradient_round_start(self, upstream) -> bool:
        weight = self.grad_averager.local_samples_accumulated
        began = upstream()
        if not began and self.tracker.global_progress.num_peers <= 1:
            # Alone in the swarm: hivemind steps on our gradients, and that step is the swarm's.
            self.ledger.credit(epoch=self.local_epoch, samples=weight, group_size=1,
                               swarm_peers=self.tracker.global_progress.num_peers)
        return began

    def around_state_round_scheduling(self, upstream) -> None:
        if not self._last_step_ahead():
            upstream()

    def around_gradient_round(self, maybe_step_control, upstream) -> None:
        # With the delayed update this runs in the background, after the epoch was incremented.
        epoch = self.local_epoch - 1 if self.delay_grad_averaging else self.local_epoch
        swarm_peers = self.tracker.global_progress.num_peers
        triggered_unix = time.time()
        # Read before the wait below: the round may end during it.
        averaged_before, missing_before = self._weight_averaged(), self._elements_missing()
        slices_missing_before = self._wire_stat("rounds_missing_a_slice")
        allreduce_unix, left_out, deserted = self._wait_for_allreduce_start(maybe_step_control, epoch)
        if deserted:
            # Every other peer left while we looked for a group (seen: the others Ctrl-C'd a step
            # before their trigger, and the last one waited out the averaging timeout alone): our
            # step is the swarm's, as a lone peer's is.
            logger.info("nobody else is left in the swarm for epoch %d's round: stepping on this peer's "
                        "gradients alone", epoch)
            maybe_step_control.cancel()
            swarm_peers = 1
        if left_out:
            logger.warning("the swarm finished epoch %d's round without this peer; it will download their state",
                           epoch)
            self._demote_state()
            maybe_step_control.cancel()
        upstream()
        # A groupmate that failed mid-round never sent us its part of the average: we kept our own
        # gradients there, so our step differs from the group's (by up to one update in those
        # weights) until the next state round, or for good if we leave first.
        partial = self._elements_missing() > missing_before
        # A groupmate was absent from the whole all-reduce: its slice is missing for every member,
        # so nobody got the whole average and nobody will report one. Waiting for such a report
        # (below) would only keep this peer offering its state low, and a leaving peer here until
        # its one-minute bound (matchmaking can count a member that never learns of the group).
        nobody_whole = partial and self._wire_stat("rounds_missing_a_slice") > slices_missing_before
        group_size = 1
        if maybe_step_control is not None and maybe_step_control.done() and not maybe_step_control.cancelled():
            try:
                group_size = len(maybe_step_control.result(0))
            except BaseException:  # the round failed: this peer used its local gradients
                group_size = 1
        if group_size >= 2 and (not partial or nobody_whole):
            if nobody_whole:
                logger.info("epoch %d's round missed a groupmate's slice for every member; "
                            "no member holds a better state", epoch)
            if self.signer is not None:
                # With nobody_whole too: the record misleads no groupmate (none holds, or waits
                # for, a whole average), and it tells the absent one, still looking for this
                # round's group, that the round is over, so it downloads the state now rather
                # than after the averaging timeout.
                self._published = swarm_metrics.publish_round(self.dht, self.run_id, self.signer, epoch=epoch,
                                                              group_size=group_size)
        elif swarm_peers >= 2 and (left_out or self._others_finished(epoch)):
            # Others averaged without us: our step used our gradients alone, and state averaging
            # would not bring us back for several epochs. Download their state at the next step.
            logger.warning("epoch %d's round went on without this peer; it will download their state", epoch)
            self._demote_state()
            self.catch_up.lose(epoch)
        elif partial and swarm_peers >= 2:
            # Groupmates that got the whole average finish later (their reducers wait out the
            # failed peer) and then publish their round record: look for one at the next steps
            # (``CatchUp.resolve_partial``), and offer our state below theirs meanwhile.
            self._demote_state()
            self.catch_up.partial(epoch, time.monotonic() + 2 * self.next_chunk_timeout + self.matchmaking_time)
        self.lonely.after(epoch, group_size=group_size, swarm_peers=swarm_peers)
        lost = self.catch_up.lost_epoch == epoch
        weight = maybe_step_control.weight if maybe_step_control is not None else 0.0
        credited = self.ledger.credit(epoch=epoch, samples=weight, group_size=group_size, swarm_peers=swarm_peers,
                                      discarded=lost)
        self.rounds.append(RoundSummary(
            epoch=epoch, group_size=group_size, swarm_peers=swarm_peers, triggered_unix=triggered_unix,
            allreduce_unix=allreduce_unix, done_unix=time.time(), left_out=lost, partial=partial,
            weight=weight, credited=credited, round_weight=self._weight_averaged() - averaged_before))

    def _demote_state(self) -> None:
        """Until we download the group's state: our parameters take (or took) a step the swarm did
        not (see :meth:`crowdtrain.swarm.rounds.StateOffer.demote`)."""
        self.offer.demote(self.local_epoch)

    def _wire_stat(self, name: str) -> float:
        stats = getattr(self.grad_averager, "wire_stats", None)
        return stats.snapshot()[name] if stats is not None else 0

    def _weight_averaged(self) -> float:
        return float(self._wire_stat("weight_averaged"))

    def _elements_missing(self) -> int:
        return self._wire_stat("elements_missing")

    def _others_finished(self, epoch: int) -> bool:
        """Whether a peer reports having finished epoch ``epoch``'s round (or a later one: its record
        holds its latest) in a group, with the whole average."""
        return (self.signer is not None
                and swarm_metrics.largest_finished_group(self.dht, self.run_id, epoch, or_later=True) >= 2)

    def _nobody_else(self) -> bool:
        return nobody_else(self.tracker, me=self.dht.peer_id.to_bytes())

    def _wait_for_allreduce_start(self, control, epoch: int) -> tuple[float | None, bool, bool]:
        """When the averager (a child process) began exchanging tensors: its stage lives in shared
        memory, so poll it until the all-reduce starts or the step ends (None if it never started).
        Also whether this peer was left out: still looking for a group a matchmaking time after
        the trigger, while another peer reports having finished this round in a group. Waiting
        out the averaging timeout then only lets the others leave before we download their state.
        And whether it was deserted: still looking while no other peer reports progress at all,
        so no group can form; waiting would hold the step (or a leave) for the averaging timeout."""
        if control is None:
            return None, False, False
        watch = LeftOutWatch(control, matchmaking_time=self.matchmaking_time,
                             went_on=lambda: self._others_finished(epoch))
        alone = LeftOutWatch(control, matchmaking_time=self.matchmaking_time, started=watch.started,
                             went_on=self._nobody_else)
        deadline = watch.started + self.averaging_timeout
        while not control.done() and time.monotonic() < deadline:
            if control.stage == AveragingStage.RUNNING_ALLREDUCE:
                return time.time(), False, False
            if watch.left_out():
                return None, not control.done(), False
            if alone.left_out():
                return None, False, not control.done()
            if _leaving_without_a_group(getattr(self, "leaving", None), control, watch.started,
                                        self.matchmaking_time):
                # Waiting for the averaging timeout would hold the leave (Ctrl-C, SIGTERM) that long:
                # seen, a minute. The step goes on with this peer's gradients; they are not credited.
                logger.info("leaving: epoch %d's round found no group in %.0f s; not waiting for one", epoch,
                            time.monotonic() - watch.started)
                control.cancel()
                return None, False, False
            time.sleep(0.005)
        return None, False, False

    def _resolve_partial_round(self, *, wait: bool) -> None:
        if self.catch_up.resolve_partial(self._others_finished, wait=wait):
            self.offer.offer(self.local_epoch)

    def around_catch_up(self, upstream) -> None:
        self.load_state_from_peers()  # in place of hivemind's (below)

    def should_catch_up(self, upstream) -> bool:
        self._resolve_partial_round(wait=False)
        return self.catch_up.lost_epoch is not None or upstream()

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's catch-up, bounded and without its second download (see below). hivemind
        retries a failed download forever, and a peer that is behind downloads again at every
        step; a peer left behind when everyone else has gone (they reached ``--max-epochs``, or
        the run is over) did that for good. Here a download that keeps failing, or a peer that
        stays behind after downloading, gives up after ``give_up_s`` with
        :class:`StateUnavailable`, which ``crowdtrain join`` reports."""
        # hivemind tags along a round scheduled ahead even when no group waits on it yet.
        release_scheduled(self.scheduled_grads, self.averaging_timeout)
        self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        lost = self.catch_up.start_download()
        if lost is not None:
            self.offer.withdraw()
        started = time.monotonic()
        with self.tracker.pause_updates():
            while True:
                try:
                    # The state only: hivemind also downloads the gradient averager's "state", its
                    # fp32 gradient accumulators, then discards them (and zeroes its own below):
                    # a second, larger download (model x 4 bytes, uncompressed) for nothing, which
                    # more than doubled a newcomer's wait on a 10 Mbit/s link.
                    loaded_before = self.state_averager.states_loaded.value
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    got_state = self.state_averager.states_loaded.value > loaded_before
                    break
                except KeyboardInterrupt:
                    raise
                except Exception as e:
                    waited = time.monotonic() - started
                    if waited > self.give_up_s:
                        raise StateUnavailable(f"no peer served the swarm's state in {waited:.0f}s ({e!r})") from e
                    logger.warning("could not load the state from peers (%r); retrying", e)
            # Read afresh: the paused tracker's view is as old as the download, which on a slow
            # link spans epochs; hivemind's stale check sent such a peer to download again.
            global_epoch = swarm_epoch_now(self.tracker)
            # A state one epoch behind the swarm's progress (states are labelled with the epoch of
            # their parameters, ConsistentStateAverager): the round into the swarm's epoch is still
            # running (its donors' update is in flight), or it ended during our download. Running:
            # keep the label; the peer steps at once and joins that round. Taking the swarm's epoch
            # there (as hivemind does), its next matchmaking would join that round as its own next
            # one (group keys carry no epoch): its rounds one epoch off for the rest of the run.
            # Ended (a peer reports it done): take the swarm's epoch, one update apart from the
            # others until the next state round, rather than download again as slowly.
            if got_state and self.local_epoch == global_epoch - 1 and self._others_finished(self.local_epoch):
                logger.info("catching up with the swarm's epoch %d", global_epoch)
                self.state_averager.local_epoch = global_epoch
            if not got_state:
                self.catch_up.download_failed(lost)  # still holding the step the swarm did not take
            if self.local_epoch < global_epoch - 1 or (not got_state and self.local_epoch < global_epoch):
                # The newest state served is still behind, or nobody served one (its donors were
                # busy, crowdtrain.swarm.hivemind_seam.state.StateUploadLimit): ask again at the next step, a
                # moment from now.
                time.sleep(1.0)
                behind = self.catch_up.still_behind(started=started, give_up_s=self.give_up_s)
                if behind is not None:
                    raise StateUnavailable(
                        f"the swarm reports epoch {global_epoch} but the newest state any peer served is epoch "
                        f"{self.local_epoch}, for {behind:.0f}s")
            else:
                self.catch_up.caught_up()
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            self.offer.offer(self.local_epoch)
            if self.catch_up.off_step:
                self._demote_state()
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def last_round(self) -> RoundSummary | None:
        return self.rounds.last()

    def finish_pending_updates(self) -> None:
        """Before leaving: apply the delayed optimizer step, if one is running in the background.
        If the last round missed a peer, stay a little longer to serve our state: the peer left
        out downloads it (see ``_wait_for_allreduce_start``), and once the last members of the
        round are gone it could only keep its own diverged parameters."""
        self.state_averager.step(wait_for_delayed_updates=True)
        if self._published is not None:  # groupmates given part of our last round look for it
            try:
                self._published.result(timeout=5.0)
            except Exception as e:
                logger.debug("could not publish the last round record: %r", e)
        self._resolve_partial_round(wait=True)
        if self.catch_up.lost_epoch is not None:  # our last step went without the swarm: end on theirs
            self.load_state_from_peers()
        last = self.last_round()
        if last is not None and 2 <= last.group_size < last.swarm_peers:
            self._serve_laggards(missed=last.swarm_peers - last.group_size)

    def _serve_laggards(self, *, missed: int) -> None:
        """Stay at least two matchmaking windows, and until no other peer reports an epoch behind
        ours (at most ``min(averaging_timeout, 20 s)`` more): a peer left out of our last round
        downloads our state now, and the coordinator's copy may be epochs old. A killed peer's
        stale record is what the bound is for."""
        started = time.monotonic()
        at_least = 2 * self.matchmaking_time
        at_most = max(at_least, min(self.averaging_timeout, 20.0))
        logger.info("the last round missed %d peer(s); serving the state for %.0f-%.0fs before leaving",
                    missed, at_least, at_most)
        behind = []
        while True:
            waited = time.monotonic() - started
            if waited >= at_least:
                behind = peers_behind(self.tracker, self.local_epoch, exclude=self.dht.peer_id.to_bytes())
                if not behind or waited >= at_most:
                    break
            time.sleep(0.5)
        if behind:
            logger.info("leaving with %d peer(s) still behind epoch %d", len(behind), self.local_epoch)


def _leaving_without_a_group(leaving: threading.Event | None, control, started: float,
                             matchmaking_time: float) -> bool:
    """The peer leaves after the step under way and its round is still looking for a group two
    matchmaking times after the trigger (a booked round forms at the epoch's end, about when the
    trigger comes; one matchmaking time is the search's own length)."""
    return (leaving is not None and leaving.is_set() and control.stage == AveragingStage.LOOKING_FOR_GROUP
            and time.monotonic() - started > 2 * matchmaking_time)


def build_optimizer(dht: hivemind.DHT, model: torch.nn.Module, config: SwarmConfig, *, batch_size: int | None,
                    client_mode: bool = False, auxiliary: bool = False, verbose: bool = False, attack=None,
                    access_guard: AccessGuard | None = None, signer: RSASignatureValidator | None = None,
                    final_epoch: int | None = None, leaving: threading.Event | None = None,
                    upload_delay_s: float = 0.0, schedule: Schedule | None = None):
    """The run's optimizer for its ``mode``: SwarmOptimizer (sync) or DiLoCoOptimizer (diloco).

    ``attack`` (``crowdtrain.swarm.attacks``, tests only) crafts what this peer sends. ``signer``
    (this peer's, from ``crowdtrain.swarm.metrics.make_validators``) signs its round records.
    ``final_epoch``: the epoch at which this peer will leave (sync mode skips the state round there;
    DiLoCo mode starts no round past it). ``leaving``: set when the peer leaves after its current
    step (sync mode skips that step's state round: the leaving peer would wait for it up to an
    averaging timeout, in vain when its groupmates leave too). ``upload_delay_s`` (tests only):
    hold each state this peer sends (``crowdtrain.swarm.hivemind_seam.state.StateUploadLimit``).
    ``schedule``: the learning-rate schedule the optimizer reads at each step
    (``crowdtrain.optim.Schedule``; default: the config's, fixed), which a volunteer moves when the
    organizer extends the run.
    """
    check_hivemind_version()
    uploads = {"max_state_uploads": config.max_state_uploads, "upload_delay_s": upload_delay_s}
    if config.mode == "diloco":
        return DiLoCoOptimizer(dht=dht, model=model, config=config, batch_size=batch_size, client_mode=client_mode,
                               attack=attack, verbose=verbose, access_guard=access_guard, final_epoch=final_epoch,
                               state_uploads=uploads, schedule=schedule)
    compression = PaperCompression(config.compression_threshold)
    return SwarmOptimizer(
        access_guard=access_guard, give_up_s=config.load_state_give_up_s, signer=signer, final_epoch=final_epoch,
        leaving=leaving, state_uploads=uploads,
        dht=dht, run_id=config.run_id, target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size,
        optimizer=partial(make_lamb, config=config), params=param_groups(model, config.weight_decay),
        scheduler=partial(make_scheduler, config=config, schedule=schedule),
        matchmaking_time=config.matchmaking_time_s, averaging_timeout=config.averaging_timeout_s,
        load_state_timeout=config.load_state_timeout_s, average_state_every=config.average_state_every,
        offload_optimizer=config.offload_optimizer, delay_optimizer_step=config.delay_optimizer_step,
        delay_grad_averaging=config.delay_optimizer_step,
        grad_compression=compression, state_averaging_compression=compression, load_state_compression=compression,
        client_mode=client_mode, auxiliary=auxiliary, verbose=verbose,
        aggregator=make_aggregator(config), attack=attack,
        # request_timeout below min_matchmaking_time avoids rare matchmaking deadlocks.
        averager_opts=dict(request_timeout=config.request_timeout_s,
                           min_group_size=config.min_group_size),
        next_chunk_timeout=config.next_chunk_timeout_s,
        # A peer that sees nobody looks again every 0.5 s (hivemind: every 3 s): peers that start
        # together must see each other before the first step, or each takes it alone and their
        # optimizer statistics stay apart for good (two peers ended 10-30% of their training
        # apart). Once peers are found, the refresh follows the time to the next epoch.
        tracker_opts=dict(min_refresh_period=0.5, max_refresh_period=max(2.0, config.matchmaking_time_s),
                          default_refresh_period=0.5),
    )


def all_finite(tensors) -> bool:
    """True if no tensor holds NaN or inf. Runs every step on the gradients and the parameters, so
    it is one fused norm per device and dtype (22M parameters on one CPU thread: 3 ms instead of 45
    for an elementwise check; on a GPU one sync instead of one per tensor). A norm that overflows
    float32 (values of 1e19 and up) counts as non-finite: such values are broken anyway. fp16
    tensors are checked elementwise, as their norm overflows at 65504."""
    tensors = [t for t in tensors if t is not None]
    half = [t for t in tensors if t.dtype == torch.float16]
    rest = [t for t in tensors if t.dtype != torch.float16]
    if rest and not torch.isfinite(torch.nn.utils.get_total_norm(rest, foreach=True)):
        return False
    return all(torch.isfinite(t).all() for t in half)


