"""hivemind.Optimizer's internal steps, each handed to a hook that crowdtrain's sync mode defines.

:class:`OptimizerSeam` overrides hivemind.Optimizer's private methods and nothing else does: each
override passes the upstream method, bound and ready to call, to a hook of a :class:`RoundHooks`
object (``around_*``, ``should_catch_up``) whose defaults are hivemind's behaviour.
``crowdtrain.swarm.optimizer``'s SwarmOptimizer holds an OptimizerSeam (it does not extend it, as
DiLoCo mode holds its averager) and is its hooks, without touching a hivemind internal. Every
override is an entry of ``crowdtrain.swarm.hivemind_seam.SEAMS`` (upstream code, why, canary test).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import hivemind
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from crowdtrain.swarm.hivemind_seam.records import read_latest
from crowdtrain.swarm.robust import Aggregator, MeanAggregator, SuspectPeers
from crowdtrain.swarm.rounds import StepClock, gradient_round_lookahead_s

logger = logging.getLogger(__name__)


class SuspectAwareProgressTracker(ProgressTracker):
    """hivemind's progress tracker, not counting the samples (nor the speed) of peers in
    ``suspects`` (they still count as peers, and their epochs as epochs), and not extrapolating a
    peer's progress from a stale record for more than ``max_extrapolation_s``.

    hivemind estimates each peer's samples now as its last report plus its speed times the
    report's age, and a peer starts the round once that estimate reaches the target batch. A peer
    reports at every step, so an old report means the peer is not computing: it is in a round, a
    state download or a lost-branch wait. Its record, 20 s old at 40 samples/s, added 800 phantom
    samples: the others started the next round after one batch each, with almost nothing to
    average, while that peer was not looking for a group (the round failed). A report older than
    the tracker's longest refresh period is counted at face value plus that period's worth.
    """

    def __init__(self, *args, suspects: SuspectPeers, max_extrapolation_s: float | None = None, **kwargs):
        self.suspects = suspects  # before the tracker's thread starts
        self.max_extrapolation_s = max_extrapolation_s
        super().__init__(*args, **kwargs)

    def refresh(self, *, paused: bool = False) -> None:
        """Read the swarm's progress now instead of at the next scheduled fetch (which, while no
        other peer was seen, is a refresh period away). ``paused``: the caller holds the tracker
        paused (``pause_updates``), whose lock this would otherwise wait for. Raises what the DHT
        raises."""
        found = read_latest(self.dht, self.training_progress_key)
        progress = self._parse_swarm_progress_data(found.value if isinstance(found, ValueWithExpiration) else None)
        if paused:
            self.global_progress = progress
        else:
            with self.lock_global_progress:
                self.global_progress = progress

    def shutdown(self, timeout: float | None = None) -> None:
        """hivemind's, waiting (up to ``timeout``) for the store that erases this peer's progress
        record. hivemind sends that store and returns; a leaving peer stops its DHT a moment later,
        and when the store had not gone out yet the others counted the departed peer as one of the
        swarm until its record expired (25 s and more): their rounds looked short of a peer, and
        each of them, leaving, served its state that long to a laggard that was not there."""
        self.shutdown_triggered.set()
        self.should_report_progress.set()
        self.global_state_updated.set()
        self.shutdown_complete.wait(timeout)
        erased = self.dht.store(self.training_progress_key, subkey=self._local_public_key, value=None,
                                expiration_time=get_dht_time() + self.metadata_expiration, return_future=True)
        try:
            erased.result(timeout=timeout)
        except Exception as e:  # the DHT already stopping: the record expires on its own
            logger.debug("could not erase this peer's progress record: %r", e)

    def _parse_swarm_progress_data(self, metadata):
        if isinstance(metadata, dict):
            suspects = self.suspects.snapshot()
            oldest = get_dht_time() - (self.max_extrapolation_s if self.max_extrapolation_s is not None
                                       else self.max_refresh_period)
            metadata = {key: self._discount(entry, suspects, oldest) for key, entry in metadata.items()}
        return super()._parse_swarm_progress_data(metadata)

    @staticmethod
    def _discount(entry, suspects: frozenset[bytes], oldest: float):
        """The record as the estimate should see it (a copy; the DHT's record is left as it was)."""
        record = getattr(entry, "value", None)
        if not isinstance(record, dict):
            return entry
        if record.get("peer_id") in suspects:
            record = {**record, "samples_accumulated": 0, "samples_per_second": 0.0}
        reported = record.get("time")
        if isinstance(reported, (int, float)) and not isinstance(reported, bool) and reported < oldest:
            record = {**record, "time": oldest}  # extrapolated by (now - oldest) at most
        return entry if record is entry.value else ValueWithExpiration(record, entry.expiration_time)


class RoundHooks:
    """What sync mode decides at hivemind.Optimizer's internal steps. Each hook gets the upstream
    step (bound, ready to call); these defaults call it, as hivemind does."""

    def around_global_epoch_update(self, upstream: Callable[[], None]) -> None:
        """The step into the next global epoch (gradient round, optimizer step, state round)."""
        upstream()

    def around_gradient_round_start(self, upstream: Callable[[], bool]) -> bool:
        """Starting (triggering) this epoch's gradient round; True if a round began."""
        return upstream()

    def around_state_round_scheduling(self, upstream: Callable[[], None]) -> None:
        """Pre-scheduling the state-averaging round of an epoch that averages state."""
        upstream()

    def around_gradient_round(self, control, upstream: Callable[[], None]) -> None:
        """The gradient round (``control``: its StepControl, or None) and loading its result
        into the optimizer; runs in the background with delayed updates."""
        upstream()

    def should_catch_up(self, upstream: Callable[[], bool]) -> bool:
        """Whether to download the swarm's state before this step (upstream: behind the swarm)."""
        return upstream()

    def around_catch_up(self, upstream: Callable[[], None]) -> None:
        """Downloading the swarm's state, when ``should_catch_up`` said so."""
        upstream()


class OptimizerSeam(hivemind.Optimizer):
    """hivemind.Optimizer whose gradient and state averagers aggregate robustly, refuse peers
    without a token (``access_guard``), serve consistent states with an upload limit
    (``state_uploads``), and whose epoch, round and catch-up steps go through hooks.

    Gradients get the run's aggregation rule with results as values (every peer applies the same
    bits); parameter averaging gets the same rule on differences. ``attack`` applies to what this
    peer sends for gradients only.
    """

    def __init__(self, *args, hooks: RoundHooks | None = None, aggregator: Aggregator | None = None, attack=None,
                 access_guard=None, state_uploads: dict | None = None, **kwargs):
        from crowdtrain.swarm.auth import guarded

        self.hooks = hooks if hooks is not None else RoundHooks()
        # Read while hivemind.Optimizer.__init__ builds the averagers and the tracker.
        self._aggregator = aggregator or MeanAggregator()
        self._attack = attack
        self._averager_opts = dict(kwargs.get("averager_opts") or {})
        self.access_guard = access_guard
        self._state_uploads = state_uploads or {}
        # Judged in gradient rounds only (the state averager judges nobody: parameters of a peer
        # that missed a round differ honestly); its downloads ask suspects last.
        self.suspects = SuspectPeers()
        if access_guard is not None:
            kwargs["grad_averager_factory"] = guarded(kwargs.get("grad_averager_factory") or GradientAverager,
                                                      access_guard)
        self.step_clock = StepClock()
        # From now: the first step's interval (with the start-up's state download, so an
        # overestimate) lets the first epoch's round be booked ahead too.
        self.step_clock.tick()
        super().__init__(*args, **kwargs)

    # -- hivemind.Optimizer's internals, each through its hook

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Book this epoch's gradient round ahead (hivemind's pre-scheduling), looking ahead by
        :func:`gradient_round_lookahead_s` and scheduling the round at the epoch's estimated end
        (hivemind computes that time but schedules at ``min_matchmaking_time`` from now): every
        peer that booked then meets in one group at the same moment, whenever its own step ends."""
        self.step_clock.tick()
        self.book_gradient_round(self.step_clock.step_s)

    def book_gradient_round(self, step_s: float) -> None:
        """Book the round if this epoch ends within ``step_s`` plus the matchmaking time (the
        booking :meth:`_maybe_schedule_gradient_averaging` makes after each step; a newcomer
        calls it before its first, with a guess of its step, ``crowdtrain.swarm.rounds.refresh_for_first_round``)."""
        now = get_dht_time()
        eta_s = self.tracker.estimated_next_update_time - now
        lookahead_s = gradient_round_lookahead_s(matchmaking_time=self.matchmaking_time,
                                                 step_s=step_s, averaging_timeout=self.averaging_timeout)
        if eta_s > lookahead_s:
            return
        if self.scheduled_grads is None or self.scheduled_grads.triggered or self.scheduled_grads.done():
            eta_s = max(eta_s, self.grad_averager.matchmaking_kwargs["min_matchmaking_time"])
            self.scheduled_grads = self.grad_averager.schedule_step(scheduled_time=now + eta_s,
                                                                    timeout=self.averaging_timeout)

    def _update_global_epoch(self, grad_scaler) -> None:
        self.hooks.around_global_epoch_update(functools.partial(super()._update_global_epoch, grad_scaler))

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        return self.hooks.around_gradient_round_start(
            functools.partial(super()._begin_averaging_gradients, grad_scaler))

    def _maybe_schedule_state_averaging(self) -> None:
        self.hooks.around_state_round_scheduling(super()._maybe_schedule_state_averaging)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        self.hooks.around_gradient_round(maybe_step_control, functools.partial(
            super()._average_gradients_and_load_into_optimizer, maybe_step_control))

    def _should_load_state_from_peers(self) -> bool:
        return self.hooks.should_catch_up(super()._should_load_state_from_peers)

    def load_state_from_peers(self, **kwargs) -> None:
        self.hooks.around_catch_up(functools.partial(super().load_state_from_peers, **kwargs))

    # -- the averagers and the tracker hivemind.Optimizer builds

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return SuspectAwareProgressTracker(
            dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, suspects=self.suspects, start=True, **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        from crowdtrain.swarm.hivemind_seam.averaging import robust_averager_class

        # hivemind gives ``averager_opts`` to the state averager only: without them the gradient
        # averager kept hivemind's 3 s request_timeout, not below a 3 s matchmaking time (which
        # hivemind warns can deadlock matchmaking), and ignored ``min_group_size`` (centered_clip's
        # groups of three).
        for name in ("request_timeout", "min_group_size"):
            if name in self._averager_opts:
                kwargs.setdefault(name, self._averager_opts[name])
        factory = factory if factory is not None else GradientAverager
        if isinstance(factory, type):
            # Nobody downloads a gradient averager's state (SwarmOptimizer.load_state_from_peers),
            # so it does not declare itself a donor in the DHT (hivemind's default, every round).
            factory = functools.partial(robust_averager_class(factory), aggregator=self._aggregator,
                                        attack=self._attack, results_as_values=True, suspects=self.suspects,
                                        allow_state_sharing=False)
        return super()._make_gradient_averager(factory, **kwargs)

    def _make_state_averager(self, **kwargs):
        # hivemind.Optimizer._make_state_averager, with the robust class, serving consistent states.
        from crowdtrain.swarm.auth import guarded
        from crowdtrain.swarm.hivemind_seam.averaging import robust_averager_class
        from crowdtrain.swarm.hivemind_seam.state import ConsistentStateAverager

        return robust_averager_class(guarded(ConsistentStateAverager, self.access_guard))(
            aggregator=self._aggregator, state_wait_s=0.5,
            dht=self.dht, prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time, allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout, offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer, status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout, client_mode=self.client_mode, auxiliary=self.auxiliary,
            distrusted=self.suspects, start=True, **self._state_uploads, **kwargs)

    def averaging_stats(self) -> dict:
        """Bytes this peer sent in averaging rounds (compressed, as serialized) and reducer time."""
        parts = {"gradients": self.grad_averager, "state": self.state_averager}
        stats = {name: averager.wire_stats.snapshot() for name, averager in parts.items()
                 if averager is not None and hasattr(averager, "wire_stats")}
        stats["bytes_sent"] = sum(s["bytes_sent"] for s in stats.values())
        return stats
