"""DiLoCo mode: local inner steps, rare outer steps on the averaged pseudo-gradient.

Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of Language Models"),
adapted to uneven volunteers. Each peer trains its own copy with an inner optimizer (AdamW or
the paper's 8-bit LAMB) on every local batch. One global epoch is one *outer* step, taken when
the swarm together has processed ``target_batch_size`` samples, however they are spread: a
slow peer is not waited for, it just contributes fewer inner steps. At that sync point every
peer computes its pseudo-gradient ``global params - local params``, the swarm averages them
(weighted by samples, compressed like gradients in sync mode, with the run's robust
``aggregation``), and every peer applies the same outer Nesterov SGD step (DiLoCo's defaults:
lr 0.7, momentum 0.9) to the global parameters and restarts its inner steps from them.

Bytes: one pseudo-gradient round per outer step, instead of a gradient round and a parameter
round per global batch in sync mode. Compute keeps going between rounds.

Every peer ends a round with bit-identical global parameters: reducers send their result itself,
compressed once, and use those bits themselves (``results_as_values`` in ``robust.py``);
newcomers download the global parameters, the outer momentum and the epoch losslessly.
Peers check they started from the same global parameters (a hash in the round's gathered
data); a peer in the minority, or whose round failed while others trained, downloads the state.

Overlapped rounds (``overlap_outer_round``): the trainer starts the round and goes on with inner
steps while it runs (its tensors sit in the averager's own buffers), from its own estimate of
the outer step (``outer_step_estimate``). When the round ends, the outer step lands on the global
parameters and the local ones move by the estimate's error, so the inner steps taken meanwhile
are kept: ``local += new global - estimate`` (one CPU copy of the parameters, held while the
round runs). The price is staleness: on ``tiny`` at H = 40, with about a quarter of the inner
steps taken during rounds, the final loss was about 20% higher than with blocking rounds for
the same samples (bench_diloco). Progress records move to the next epoch when a
round starts, so a peer one epoch behind the records is the swarm mid-round, not out of sync; a
peer left out of a round learns it from the states on offer (the next epoch's, from peers that
finished it). At most one round is in flight: a trainer reaching the next sync point first
waits for it.

Tuning by symptom:
- Trainers wait on every round (``blocked_s`` in the summary grows by the round time each epoch):
  the link is slow for the model; set ``overlap_outer_round`` or raise ``target_batch_size``.
- Loss jumps up right after each sync: the outer step overshoots; lower ``outer_lr`` or
  ``outer_momentum``, or sync more often (lower ``target_batch_size``).
- Loss plateaus between syncs and falls only at syncs: local copies drift apart; sync more often
  or lower the inner ``lr``.
- ``outer_lr=1, outer_momentum=0`` is plain parameter averaging (FedAvg), a useful baseline.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
from dataclasses import dataclass

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import NoCompression
from hivemind.utils import get_dht_time

from crowdtrain.optim import Schedule, param_groups
from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.swarm.compression import PaperCompression
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm.hivemind_seam.averaging import RobustAveragerMixin
from crowdtrain.swarm.hivemind_seam.optimizer import SuspectAwareProgressTracker
from crowdtrain.swarm.hivemind_seam.records import read_latest, state_offers_key
from crowdtrain.swarm.hivemind_seam.state import StateUploadLimit
from crowdtrain.swarm.lamb import make_lamb
from crowdtrain.swarm.robust import SuspectPeers, make_aggregator
from crowdtrain.swarm.rounds import (LeftOutWatch, LonelyRoundCheck, RoundLog, RoundSummary, StateOffer, StepClock,
                                     gradient_round_lookahead_s, refresh_for_first_round, release_scheduled,
                                     swarm_epoch_now, tag_along)

logger = logging.getLogger(__name__)


def make_outer_optimizer(params: list[torch.Tensor], config: SwarmConfig) -> torch.optim.SGD:
    """Nesterov SGD on the global parameters, with momentum buffers created up front (zeros,
    which gives the same first step as torch's lazy buffers) so the state has a fixed layout."""
    params = [p if isinstance(p, torch.nn.Parameter) else torch.nn.Parameter(p, requires_grad=False) for p in params]
    outer = torch.optim.SGD(params, lr=config.outer_lr, momentum=config.outer_momentum,
                            nesterov=config.outer_momentum > 0)
    if config.outer_momentum > 0:
        for p in params:
            outer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return outer


def make_inner_optimizer(groups: list[dict], config: SwarmConfig) -> torch.optim.Optimizer:
    if config.inner_optimizer == "lamb8bit":
        return make_lamb(groups, config)  # clips the gradient norm itself
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def outer_step_estimate(outer: torch.optim.SGD, pseudo_gradients: list[torch.Tensor]) -> list[torch.Tensor]:
    """The global parameters after ``outer``'s step on these pseudo-gradients, computed on copies
    (``outer`` is unchanged). An overlapped round's inner steps start from this estimate made with
    our own pseudo-gradient ("eager" updates, Kale et al. 2025), and are moved onto the real step
    when the round's average arrives, so the local model follows the outer momentum during the
    round. (Continuing from the local parameters instead ended alike on ``tiny`` at H = 40 in
    bench_diloco: both about 20% above blocking rounds, two paired runs each.)"""
    group = outer.param_groups[0]
    lr, mu = group["lr"], group["momentum"]
    out = []
    for g, d in zip(group["params"], pseudo_gradients):
        m = outer.state[g].get("momentum_buffer") if mu > 0 else None
        step = d if m is None else d + mu * (mu * m + d)  # Nesterov: d + mu * (the new momentum)
        out.append(g.detach().sub(step, alpha=lr))
    return out


def global_param_order(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The order of the global parameters in the state peers exchange (that of ``param_groups``),
    the same for trainers and the auxiliary peer."""
    return [p for group in param_groups(model, 0.0) for p in group["params"]]


def state_priority(epoch: int, group_size: int, digest: str) -> float:
    """Newcomers (and peers healing a split) download the highest priority: the newest epoch, then
    the largest group, then the larger digest, so that every peer ranks two states alike."""
    return epoch + min(group_size, 999) / 1000 + int(digest[:4], 16) / 65536 / 10_000


def params_digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class DiLoCoAverager(StateUploadLimit, RobustAveragerMixin, DecentralizedAverager):
    """Averages pseudo-gradients with the swarm and serves the outer state to newcomers.

    The averaged tensors are pseudo-gradient buffers. The state (``load_state_from_peers``) is
    the global parameters, the outer momentum and the epoch, sent uncompressed: a newcomer must
    hold exactly the bits everyone else does. The coordinator's auxiliary peer runs one too
    (without ever averaging) to keep and checkpoint the state; it reads ``optimizer``,
    ``local_epoch`` and ``state_sharing_priority`` as it does from hivemind's TrainingStateAverager.
    """

    wait_for_unstarted_groups = False  # see RobustAveragerMixin: DiLoCo keeps hivemind's behaviour

    def __init__(self, outer_optimizer: torch.optim.SGD, *, dht, prefix: str, **kwargs):
        self.optimizer = outer_optimizer
        self.global_params = [p for group in outer_optimizer.param_groups for p in group["params"]]
        self.local_epoch = 0
        self.base_group = 0  # size of the group whose sync made the global parameters (0: unknown)
        self.state_lock = threading.Lock()  # the outer step vs a newcomer reading the state
        buffers = [torch.zeros_like(p.data) for p in self.global_params]
        super().__init__(averaged_tensors=buffers, dht=dht, prefix=prefix, state_compression=NoCompression(),
                         results_as_values=True, **kwargs)

    def momentum_buffers(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        return [state[p]["momentum_buffer"] for p in self.global_params if "momentum_buffer" in state[p]]

    def get_current_state(self):
        """Runs in this (host) process when a peer downloads the state."""
        with self.state_lock:
            tensors = [p.detach().clone() for p in self.global_params] + [m.clone() for m in self.momentum_buffers()]
            metadata = {"kind": "diloco", "epoch": int(self.local_epoch), "params": len(self.global_params),
                        "group": int(self.base_group)}
        return metadata, tensors, None

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None,
                              min_epoch: int = 0) -> int | None:
        """Download the newest state into the global parameters and momentum; the epoch, or None
        (nobody to download from, or the best state is older than ``min_epoch``: keep ours)."""
        loaded = self.download_state(timeout=timeout, min_epoch=min_epoch)
        if loaded is None:
            return None
        metadata, tensors = loaded
        n = len(self.global_params)
        momentum = self.momentum_buffers()
        if not isinstance(metadata, dict) or metadata.get("kind") != "diloco":
            logger.warning("a peer sent a state that is not a DiLoCo state (%r); ignoring it", metadata)
            return None
        if len(tensors) != n + len(momentum) or any(t.shape != p.shape for t, p in
                                                    zip(tensors, self.global_params + momentum)):
            logger.warning("a peer sent a DiLoCo state of another shape (%d tensors, %d expected); ignoring it",
                           len(tensors), n + len(momentum))
            return None
        if int(metadata["epoch"]) < min_epoch:
            logger.info("the newest state on offer is from epoch %d, older than ours (%d); keeping ours",
                        metadata["epoch"], min_epoch)
            return None
        with self.state_lock, torch.no_grad():
            for target, source in zip(self.global_params + momentum, tensors):
                target.copy_(source)
            self.local_epoch = int(metadata["epoch"])
            group = metadata.get("group", 0)
            self.base_group = group if isinstance(group, int) and 0 <= group < 1000 else 0
        return self.local_epoch

    @classmethod
    def for_model(cls, dht, model: torch.nn.Module, config: SwarmConfig, **kwargs) -> "DiLoCoAverager":
        """A state keeper whose global parameters are ``model``'s own (the auxiliary peer's)."""
        outer = make_outer_optimizer(global_param_order(model), config)
        return cls(outer, dht=dht, prefix=f"{config.run_id}_diloco", min_matchmaking_time=config.matchmaking_time_s,
                   compression=PaperCompression(config.compression_threshold), allow_state_sharing=True,
                   max_state_uploads=config.max_state_uploads, start=True, **kwargs)


@dataclass(frozen=True)
class LostRound:
    """What a failed or partial round tells about who may hold its whole average (the state of
    ``epoch`` that this peer's lost-branch wait looks for)."""

    epoch: int  # the epoch the round made (this peer's own outer step already took it there)
    grouped: bool  # this peer was in a group: it sent parts or got the group's gathered data
    groupmates: frozenset | None = None  # their peer IDs (bytes) when the gathered data named them


def lost_branch_verdict(offers: dict | None, *, me: bytes, wanted_epoch: int, lost: LostRound | None,
                        waited_s: float, bound_s: float) -> str:
    """What a peer waiting for the swarm's state of ``wanted_epoch`` does next: ``"download"`` (a
    state that new is on offer, or the DHT did not answer: try, the download refuses older ones),
    ``"wait"`` (a groupmate may still publish the whole average) or ``"give_up"`` (nobody can:
    go on with ours). ``offers``: peer ID -> offered state priority, None for a withdrawn offer
    (the integer part of a priority is its epoch; see ``state_priority``).

    Never a download of a state older than ours (the auxiliary peer's last checkpoint, say): that
    would be fetched only to be thrown away, once a second. Without ``lost`` (a plain catch-up)
    there is nothing to wait for. A peer that was in no group has no groupmate to wait for; peers
    that formed a group without it published their state during its round (its LeftOutWatch
    looked). Where the gathered data names the groupmates, the wait ends as soon as each of them
    withdrew its offer (it did not get the whole average either) instead of at the bound."""
    if offers is None:
        return "download"
    others = {peer: p for peer, p in offers.items() if peer != me}
    if max((p for p in others.values() if p is not None), default=-1.0) >= wanted_epoch:
        return "download"
    if lost is None or not lost.grouped or waited_s >= bound_s:
        return "give_up"
    if lost.groupmates is not None:
        # A groupmate still offering its state from before the round has not finished it yet.
        undecided = [peer for peer in lost.groupmates - {me} if others.get(peer) is not None]
        return "wait" if undecided else "give_up"
    return "wait"


@dataclass
class OpenRound:
    """A round from its sync point until its outer step (``DiLoCoOptimizer.pending`` while it
    overlaps inner steps)."""

    epoch: int
    swarm_peers: int  # as the tracker reported at the sync point
    t0: float  # perf_counter at the sync point
    before: dict  # the averager's wire stats at the sync point
    weight: int  # samples this peer put in
    # overlapped rounds only
    control: object = None  # hivemind's StepControl
    started: float = 0.0  # monotonic, when the inner steps went on
    deadline: float = 0.0  # monotonic, when to stop waiting for it
    continued_from: list | None = None  # our estimate of the outer step the inner steps went on from
    inner_steps: int = 0  # taken during the round
    watch: LeftOutWatch | None = None  # whether the swarm went on without us
    done_at: float | None = None  # perf_counter when it ended (the trainer notices at its next step)

    def ended(self) -> None:
        if self.done_at is None:
            self.done_at = time.perf_counter()


class DiLoCoOptimizer:
    """The trainer's side, with the interface ``crowdtrain.swarm.peer`` uses
    (:class:`crowdtrain.swarm.rounds.Trainer`, as SwarmOptimizer)."""

    def __init__(self, *, dht, model: torch.nn.Module, config: SwarmConfig, batch_size: int,
                 client_mode: bool = False, attack=None, verbose: bool = False, access_guard=None,
                 final_epoch: int | None = None, state_uploads: dict | None = None, schedule: Schedule | None = None):
        from crowdtrain.swarm.auth import guarded

        self.config, self.batch_size, self.client_mode = config, batch_size, client_mode
        # The inner learning rate's schedule, read at every step (moves when the run is extended).
        self.schedule = schedule or Schedule.from_config(config)
        self.final_epoch = final_epoch  # this peer leaves on reaching it (``join --max-epochs``)
        groups = param_groups(model, config.weight_decay)
        self.params = global_param_order(model)
        self.inner = make_inner_optimizer(groups, config)
        global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.status_loglevel = logging.INFO if verbose else logging.DEBUG
        suspects = SuspectPeers()  # judged by the averager's reducers, discounted by the tracker
        self.tracker = SuspectAwareProgressTracker(
            dht=dht, prefix=config.run_id, target_batch_size=config.target_batch_size, client_mode=client_mode,
            status_loglevel=self.status_loglevel, min_refresh_period=0.5,
            max_refresh_period=max(2.0, config.matchmaking_time_s), suspects=suspects, start=True)
        self.averager = guarded(DiLoCoAverager, access_guard)(
            make_outer_optimizer(global_params, config), dht=dht, prefix=f"{config.run_id}_diloco",
            aggregator=make_aggregator(config), attack=attack, suspects=suspects,
            compression=PaperCompression(config.compression_threshold),
            min_matchmaking_time=config.matchmaking_time_s, request_timeout=config.request_timeout_s,
            # Rounds are rare, so wait longer for a late groupmate than sync mode does (a peer sees
            # the sync point up to a tracker refresh after another, plus its current step).
            allreduce_timeout=config.averaging_timeout_s,
            next_chunk_timeout=config.next_chunk_timeout_s,
            min_group_size=config.min_group_size, **(state_uploads or {}),
            client_mode=client_mode, start=True)
        self.global_params = self.averager.global_params
        self.samples_in_round = 0
        self.scheduled = None
        self.step_clock = StepClock()  # this peer's inner step time: how far ahead it books a round
        self.step_clock.tick()  # the first interval, start-up included, times the first epoch's steps
        self.pending: OpenRound | None = None  # an overlapped round in flight (``overlap_outer_round``)
        self.rounds = RoundLog()
        self.offer = StateOffer(self.averager, client_mode=client_mode)
        self.lonely = LonelyRoundCheck(dht, self.tracker)  # why a round found no group
        self.ledger = swarm_metrics.Ledger()
        self.blocked_s = 0.0  # time the trainer spent in rounds and state downloads instead of computing
        self._last_round_end = -float("inf")
        self._consensus_check_at: float | None = None  # after a round smaller than the swarm (see _heal_split)
        self._minority_base = False  # the last round's group started mostly from other global parameters
        self._check_sync = True  # once per epoch, require exactly the swarm's epoch (as hivemind.Optimizer)
        self._lost_round: LostRound | None = None  # what the last failed or partial round told (_finish_round)

    # -- the interface the trainer loop uses

    @property
    def local_epoch(self) -> int:
        """The epoch of the global parameters this peer holds."""
        return self.averager.local_epoch

    @property
    def state_averager(self) -> DiLoCoAverager:
        """The averager that serves this peer's state (the global parameters) to downloaders."""
        return self.averager

    @property
    def lost_branch_wait_s(self) -> float:
        """The longest a peer waits for a groupmate's whole average after its own round failed or
        came back partial: groupmates end a round at most a chunk timeout apart, and publish their
        state a moment later. Shorter where the groupmates are known to have none
        (:func:`lost_branch_verdict`)."""
        return min(self.config.averaging_timeout_s, 2 * self.config.next_chunk_timeout_s
                   + self.config.matchmaking_time_s)

    @property
    def _progress_epoch(self) -> int:
        """The epoch our samples count toward: the next one while an overlapped round is in flight."""
        return self.local_epoch + (self.pending is not None)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        if self.pending is not None:
            t0 = time.perf_counter()
            in_step = self._poll_pending(block=False)  # the outer step, when the round has ended
            self.blocked_s += time.perf_counter() - t0
            if not in_step:
                return  # we downloaded the swarm's state: this gradient is from the old parameters
        # After a sync smaller than the swarm: compare states when the others have had time to
        # publish theirs, and at the latest before the next sync (never average from a lost branch).
        # Not while a round is in flight: the global parameters are not this epoch's yet.
        if self.pending is None and self._consensus_check_at is not None and (
                time.monotonic() >= self._consensus_check_at or self.tracker.ready_to_update_epoch):
            if self._heal_split():
                return  # this batch's gradient was computed from the losing branch's parameters
        if self.pending is None and self._should_catch_up():
            logger.log(self.status_loglevel, "peer is out of sync with the swarm; downloading the state")
            t0 = time.perf_counter()
            self.load_state_from_peers()
            self.blocked_s += time.perf_counter() - t0
            return  # this batch's gradient was computed from stale parameters
        self._set_inner_lr()
        if self.config.inner_optimizer == "adamw" and self.config.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.clip_grad_norm)
        self.inner.step()
        if self.pending is not None:
            self.pending.inner_steps += 1
        self.samples_in_round += self.batch_size
        self.tracker.report_local_progress(self._progress_epoch, self.samples_in_round)
        self.step_clock.tick()
        if self.pending is None:
            self._maybe_schedule_round()
        if self.tracker.ready_to_update_epoch:
            if self.pending is not None:
                # The next sync point came before the last round ended: wait for it (the outer
                # step is delayed by one round at most), then take this one.
                t0 = time.perf_counter()
                finished = self._poll_pending(block=True)
                self.blocked_s += time.perf_counter() - t0
                if not finished:
                    return  # the round failed or lost a split: we restarted from the swarm's state
            if self.final_epoch is not None and self.local_epoch >= self.final_epoch:
                # We leave now (an overlapped round just ended): a round started here would run
                # alone or leave a groupmate one short, and end us on another model than the swarm's.
                return
            self._outer_step()

    def load_state_from_peers(self, *, lost_branch: bool = False) -> None:
        """Download the swarm's newest state. ``lost_branch``: our global parameters are a losing
        result of this epoch's sync (a split, a failed round): stop offering them at once, since a
        peer healing the same split must not download them instead of the winners', and wait for
        the winners to publish this epoch's state (they may still be finishing their round), but
        only while one may (:func:`lost_branch_verdict`; at most ``lost_branch_wait_s``); never
        settle for an older epoch, which would undo outer steps. States on offer are read from the
        DHT first: nothing is downloaded that is older than what we hold."""
        if self.pending is not None:  # our part is already in that round: let the group finish it
            self._drop_pending()
        if self.scheduled is not None and not self.scheduled.done():
            tag_along(self.scheduled, self.config.averaging_timeout_s)
        self.scheduled = None
        lost, self._lost_round = (self._lost_round if lost_branch else None), None
        if lost_branch:
            self.offer.withdraw()
        me = self.averager.peer_id.to_bytes()
        started, attempt = time.monotonic(), 0
        while True:
            wanted = max(self.local_epoch, self.tracker.global_epoch if lost_branch else self.local_epoch)
            verdict = lost_branch_verdict(self._offers(), me=me, wanted_epoch=wanted,
                                          lost=lost if lost_branch else None, waited_s=time.monotonic() - started,
                                          bound_s=self.lost_branch_wait_s if lost_branch else 0.0)
            if verdict == "give_up" and not lost_branch:
                logger.log(self.status_loglevel, "no peer offers a state newer than ours (epoch %d); going on",
                           self.local_epoch)
                break
            if verdict == "give_up":
                logger.warning("no peer got the whole average of epoch %d's round; going on with ours (the next "
                               "round's check aligns the swarm on one state)", self.local_epoch)
                # Compare notes soon: a group we did not see may still publish a better state.
                self._consensus_check_at = time.monotonic() + 2 * self.config.matchmaking_time_s
                break
            if verdict == "download":
                attempt += 1
                try:
                    # Never go back in epochs (e.g. to the coordinator's last checkpoint when the
                    # trainers have left): an older state would undo outer steps.
                    epoch = self.averager.load_state_from_peers(timeout=self.config.load_state_timeout_s,
                                                                min_epoch=self.local_epoch)
                except Exception as e:  # a peer left mid-download: try the next best one
                    logger.warning("downloading the state failed (%r); retrying", e)
                    epoch = -1
                if epoch is not None and epoch >= self.tracker.global_epoch:
                    break
                if attempt >= 3 and (not lost_branch or time.monotonic() - started >= self.lost_branch_wait_s):
                    break
            time.sleep(1.0)  # the peers are between rounds: their new state is a moment away
        with self.tracker.pause_updates():
            self._restart_from_global()
            self.samples_in_round = 0
            self.tracker.report_local_progress(self.local_epoch, 0)
            self._check_sync = True
            self._share_state()

    def last_round(self) -> RoundSummary | None:
        return self.rounds.last()

    def averaging_stats(self) -> dict:
        stats = {"pseudo_gradients": self.averager.wire_stats.snapshot()}
        stats["bytes_sent"] = stats["pseudo_gradients"]["bytes_sent"]
        stats["blocked_s"] = self.blocked_s
        return stats

    def finish_pending_updates(self) -> None:
        """Before leaving: if the last round may have split the swarm, end on the canonical state,
        and stay a little longer to serve it (the other group's peers download it from us). The
        model left behind is the swarm's global parameters: inner steps since the last sync were
        never shared, and the swarm's model does not have them either."""
        if self.pending is not None:
            self._poll_pending(block=True)
        if self._consensus_check_at is not None:
            time.sleep(max(0.0, self._consensus_check_at - time.monotonic()))
            self._heal_split()
            time.sleep(2 * self.config.matchmaking_time_s)
        self._restart_from_global()

    def shutdown(self) -> None:
        # Groupmates may still be receiving our reducer's results of the last round (they finish
        # after we do): give them a few seconds before the averager goes, or they miss a slice.
        grace = min(5.0, self.config.matchmaking_time_s) - (time.monotonic() - self._last_round_end)
        if grace > 0:
            time.sleep(grace)
        if self.pending is not None:
            self._drop_pending()
        release_scheduled(self.scheduled, self.config.averaging_timeout_s)
        self.tracker.shutdown(5)
        self.averager.shutdown()

    # -- the round

    def _should_catch_up(self) -> bool:
        # An overlapped round moves progress records to the next epoch when it starts: records one
        # epoch ahead of our global parameters are the swarm mid-round (ours to join), not a lost
        # round (if the swarm did finish it without us, ``_went_on_without_us`` finds out).
        lag = 1 if self.config.overlap_outer_round else 0
        if self._check_sync and self.tracker.fetched_global_progress_this_epoch.is_set():
            self._check_sync = False
            return not 0 <= self.tracker.global_epoch - self.local_epoch <= lag
        return self.local_epoch < self.tracker.global_epoch - 1

    def _set_inner_lr(self) -> None:
        # Keyed on the fractional global epoch, so the schedule moves within long rounds too.
        progress = min(1.0, self.tracker.global_progress.samples_accumulated / self.config.target_batch_size)
        factor = self.schedule.factor_at(self._progress_epoch + progress)
        for group in self.inner.param_groups:
            group["lr"] = self.config.lr * factor

    def _search_runs_out(self, control) -> bool:
        """A round scheduled ahead whose search for a group has less than half an averaging
        timeout left at the sync point. Its deadline counts from when it was scheduled, on an
        estimate of the sync point: when the estimate was early (a groupmate's first batch came
        late, on a busy machine) the search ended moments after the sync point, the round failed
        for want of a group, and its groupmate, about to join, found nobody. A fresh search
        gets the whole timeout from now. (One that found its group already is kept.)"""
        return (not control.done() and not control.triggered and control.stage == AveragingStage.LOOKING_FOR_GROUP
                and control.deadline - get_dht_time() < self.config.averaging_timeout_s / 2)

    def book_first_round(self, batch_size: int) -> None:
        if self.pending is None:
            guess_s = refresh_for_first_round(self.tracker, me=self.tracker.dht.peer_id.to_bytes(),
                                              batch_size=batch_size)
            if guess_s > 0:
                self._maybe_schedule_round(step_s=max(guess_s, self.step_clock.step_s))

    def _maybe_schedule_round(self, step_s: float | None = None) -> None:
        """Start matchmaking before the swarm reaches the sync point, so it overlaps compute: at the
        last inner step that starts before it (``gradient_round_lookahead_s``), for a round at the
        sync point's estimate, so that peers whose steps end at different moments meet in one group.
        ``step_s``: how long this peer's steps take (default: as its step clock measured them)."""
        now = get_dht_time()
        eta_s = self.tracker.estimated_next_update_time - now
        if eta_s > gradient_round_lookahead_s(matchmaking_time=self.config.matchmaking_time_s,
                                              step_s=self.step_clock.step_s if step_s is None else step_s,
                                              averaging_timeout=self.config.averaging_timeout_s):
            return
        if self.scheduled is None or self.scheduled.triggered or self.scheduled.done():
            self.scheduled = self._begin_matchmaking(scheduled_time=now + max(eta_s, self.config.matchmaking_time_s))

    def _begin_matchmaking(self, scheduled_time: float | None = None):
        """A round looking for its group (hivemind's default ``scheduled_time``: a matchmaking time from now)."""
        gather = {"epoch": self.local_epoch, "group": self.averager.base_group,
                  "base": params_digest(self.global_params)}
        return self.averager.step(gather=gather, wait=False, require_trigger=True, scheduled_time=scheduled_time,
                                  timeout=self.config.averaging_timeout_s)

    def _outer_step(self) -> None:
        """The sync point: average the pseudo-gradients and step the global parameters. With
        ``overlap_outer_round`` the round goes on in the background while inner steps continue,
        and ``_poll_pending`` finishes it; otherwise the trainer waits for it here."""
        t0 = time.perf_counter()
        epoch = self.local_epoch
        with self.tracker.pause_updates():
            round_ = OpenRound(epoch=epoch, swarm_peers=self.tracker.global_progress.num_peers, t0=t0,
                               before=self.averager.wire_stats.snapshot(), weight=self.samples_in_round)
            with torch.no_grad(), self.averager.get_tensors() as buffers:
                for buffer, g, p in zip(buffers, self.global_params, self.params):
                    buffer.copy_(g).sub_(p.detach().to("cpu", torch.float32))  # pseudo-gradient
                estimate = (outer_step_estimate(self.averager.optimizer, buffers) if self.config.overlap_outer_round
                            else None)
            control = self._start_round(weight=self.samples_in_round)
            if estimate is not None and control is not None:
                # Inner steps go on from our own estimate of the outer step; when the round ends
                # they are moved onto the real one (``_finish_round``), so no step is lost.
                self._restart_from(estimate)
                round_.control, round_.started, round_.continued_from = control, time.monotonic(), estimate
                round_.deadline = time.monotonic() + self.config.averaging_timeout_s
                round_.watch = LeftOutWatch(control, matchmaking_time=self.config.matchmaking_time_s,
                                            went_on=lambda: self._went_on_without_us(epoch), started=round_.started)
                # When the round ended (the trainer only notices at its next step).
                control.add_done_callback(lambda _: round_.ended())
                self.pending = round_
                self.tracker.update_epoch(epoch + 1)
                self.samples_in_round = 0
                self.blocked_s += time.perf_counter() - t0
                return
            gathered = None
            if control is not None:
                watch = LeftOutWatch(control, matchmaking_time=self.config.matchmaking_time_s,
                                     went_on=lambda: swarm_epoch_now(self.tracker) > epoch)
                gathered = self._await(control, watch, deadline=watch.started + self.config.averaging_timeout_s)
            diverged = self._finish_round(round_, gathered)
        if diverged:
            self.load_state_from_peers(lost_branch=True)
        self.blocked_s += time.perf_counter() - t0

    def _poll_pending(self, *, block: bool) -> bool:
        """Finish the round in flight if it is over (with ``block``, wait until it is). False if
        this peer then had to download the state (the round failed, or its group lost a split)."""
        round_ = self.pending
        control, epoch = round_.control, round_.epoch
        if not block and not control.done() and time.monotonic() < round_.deadline:
            # Between inner steps: ask the DHT once per matchmaking time at most.
            if not round_.watch.left_out(every=self.config.matchmaking_time_s):
                return True
            control.cancel()
        self.pending = None
        gathered = self._await(control, LeftOutWatch(control, matchmaking_time=self.config.matchmaking_time_s,
                                                     went_on=lambda: self._went_on_without_us(epoch),
                                                     started=round_.started), deadline=round_.deadline)
        with self.tracker.pause_updates():
            diverged = self._finish_round(round_, gathered)
        if diverged:
            self.load_state_from_peers(lost_branch=True)
        return not diverged

    def _drop_pending(self) -> None:
        """Leave the round in flight to the group (our part is in it) and forget its result."""
        round_, self.pending = self.pending, None
        control = round_.control
        try:
            gathered = control.result(max(0.0, round_.deadline - time.monotonic()))
            # Our samples are in the group's step, though we leave before applying it.
            self.ledger.credit(epoch=round_.epoch, samples=round_.weight, group_size=len(gathered or ()),
                               swarm_peers=round_.swarm_peers)
        except BaseException as e:
            logger.debug("a round this peer left early failed: %r", e)
            if not control.done():
                control.cancel()

    def _finish_round(self, round_: OpenRound, gathered: dict | None) -> bool:
        """The outer step from the averaged pseudo-gradient (or, with no group, our own), then the
        checks that our global parameters are the swarm's; True if they may not be (the caller
        downloads the state). Runs with the tracker paused."""
        epoch, swarm_peers, before = round_.epoch, round_.swarm_peers, round_.before
        overlapped = round_.continued_from is not None
        group_size = len(gathered) if gathered else 1
        with self.averager.state_lock, torch.no_grad(), self.averager.get_tensors() as buffers:
            for g, buffer in zip(self.global_params, buffers):
                g.grad = buffer
            self.averager.optimizer.step()
            for g in self.global_params:
                g.grad = None
            # An overlapped round moved the tracker to the next epoch when it started.
            self.averager.local_epoch = new_epoch = epoch + 1 if overlapped else max(epoch + 1,
                                                                                     self.tracker.global_epoch)
            self.averager.base_group = group_size
        if overlapped:
            # Keep the inner steps taken during the round: params += new global - our estimate of it.
            with torch.no_grad():
                for p, g, start in zip(self.params, self.global_params, round_.continued_from):
                    p.add_(start.neg_().add_(g).to(p.device, p.dtype))
        else:
            self._restart_from_global()
            self.tracker.update_epoch(new_epoch)
            self.samples_in_round = 0
        self._check_sync = True
        self._lost_round = None
        after = self.averager.wire_stats.snapshot()
        missing = after["elements_missing"] - before["elements_missing"]
        diverged = self._diverged(gathered, swarm_peers, missing)
        if diverged:
            me = self.averager.peer_id
            self._lost_round = LostRound(
                epoch=new_epoch, grouped=bool(gathered) or after["bytes_sent"] > before["bytes_sent"],
                groupmates=frozenset(p.to_bytes() for p in gathered if p != me) if gathered else None)
        self.lonely.after(epoch, group_size=group_size, swarm_peers=swarm_peers)
        credited = self.ledger.credit(epoch=epoch, samples=round_.weight, group_size=group_size,
                                      swarm_peers=swarm_peers, discarded=diverged)
        if self._minority_base:
            # Our global parameters (the previous sync's result) were not the majority's:
            # that sync split the swarm and ours was not the canonical result.
            self.rounds.mark(epoch - 1, diverged=True, healed=True)
        if not diverged:
            self._share_state()
        # A group smaller than the swarm: another group may have stepped from other pseudo-
        # gradients at the same time. Compare notes once their rounds are over too.
        if not diverged and group_size < swarm_peers:
            self._consensus_check_at = time.monotonic() + 2 * self.config.matchmaking_time_s
        seconds = (round_.done_at if round_.done_at is not None else time.perf_counter()) - round_.t0
        self.rounds.append(RoundSummary(
            epoch=epoch, group_size=group_size, swarm_peers=swarm_peers, seconds=seconds, overlapped=overlapped,
            inner_steps_during=round_.inner_steps, bytes_sent=after["bytes_sent"] - before["bytes_sent"],
            aggregate_s=after["aggregate_s"] - before["aggregate_s"],
            parts_dropped=after["parts_dropped"] - before["parts_dropped"],
            params_sha=params_digest(self.global_params), diverged=diverged, weight=round_.weight,
            credited=credited, round_weight=after["weight_averaged"] - before["weight_averaged"]))
        self._last_round_end = time.monotonic()
        logger.log(self.status_loglevel, "outer step %d -> %d with %d/%d peers in %.2fs%s", epoch, new_epoch,
                   group_size, swarm_peers, seconds, " (overlapped with inner steps)" if overlapped else "")
        return diverged

    def _start_round(self, weight: int):
        """Start this epoch's round with our weight; its control, or None (alone, or too few
        peers for the aggregation rule: nobody to wait for)."""
        control = self.scheduled
        self.scheduled = None
        try:
            if control is not None and self._search_runs_out(control):
                control.cancel()
                control = None
            if control is None or control.triggered or control.done():
                if self.tracker.global_progress.num_peers < self.config.min_group_size and not self._peers_now():
                    return None
                control = self._begin_matchmaking()
            control.weight = weight
            control.allow_allreduce()
            return control
        except BaseException as e:
            logger.log(self.status_loglevel, "could not start averaging pseudo-gradients (%r); using this peer's own", e)
            if control is not None and not control.done():
                control.cancel()
            return None

    def _peers_now(self) -> bool:
        """Whether the swarm has enough peers for a round, read from the DHT now. The tracker's view
        is a refresh period old, and at a fresh run's first sync point it may predate the other
        peers' first reports (their first batches): alone by that view, a peer stepped by itself
        while the others looked for it until their round failed."""
        try:
            self.tracker.refresh(paused=True)  # rounds start with the tracker paused
        except Exception as e:  # the DHT is busy: go by the tracker's view
            logger.debug("could not read the swarm's progress: %r", e)
        return self.tracker.global_progress.num_peers >= self.config.min_group_size

    def _await(self, control, watch: LeftOutWatch, *, deadline: float) -> dict | None:
        """Wait for a started round; the group's gathered data, or None if it failed. Gives up
        early when ``watch`` finds the swarm finished the round without us: we download their
        state while they are still there to serve it (they may be about to leave)."""
        try:
            while True:
                try:
                    return control.result(min(1.0, max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    if control.done() or time.monotonic() >= deadline:
                        raise
                if watch.left_out():
                    raise TimeoutError("the swarm finished this round without this peer")
        except BaseException as e:
            logger.log(self.status_loglevel, "averaging pseudo-gradients failed (%r); using this peer's own", e)
            if not control.done():
                control.cancel()
            return None

    def _diverged(self, gathered: dict | None, swarm_peers: int, missing: int) -> bool:
        """True when this peer's global parameters may differ from the swarm's: its round failed
        while others train; a groupmate failed to return its slice (we kept our own there); or its
        group started from different global parameters and ours was not the canonical one: the
        newest epoch, then the one made by the largest group, then the larger digest, the order
        ``state_priority`` gives (a groupmate's malformed entry counts for nothing)."""
        self._minority_base = False
        if not gathered:
            return swarm_peers >= self.config.min_group_size
        if missing:
            logger.warning("%d averaged values never arrived (a groupmate failed); downloading the state", missing)
            return True
        bases = {}
        for peer, d in gathered.items():
            if (isinstance(d, dict) and type(d.get("epoch")) is int and type(d.get("group", 0)) is int
                    and isinstance(d.get("base"), str) and re.fullmatch(r"[0-9a-f]{16}", d["base"])):
                bases[peer] = (d["epoch"], min(max(d.get("group", 0), 0), 999), d["base"])
        if len(set(bases.values())) <= 1:
            return False
        # The rule _heal_split and newcomers use (state_priority), not a head count in this group:
        # after a split, a group mixing the branches would otherwise crown whichever branch has
        # more members *here*, while the rest of the swarm heals to the other one.
        canonical = max(set(bases.values()), key=lambda b: (state_priority(*b), b))
        mine = bases.get(self.averager.peer_id)
        logger.warning("the group started from %d different global states; %s", len(set(bases.values())),
                       "keeping ours" if mine == canonical else "downloading the canonical one")
        self._minority_base = mine != canonical
        return self._minority_base

    def _went_on_without_us(self, epoch: int) -> bool:
        """Whether some peer offers the state of a later epoch than ``epoch``, i.e. finished that
        epoch's round (progress records cannot tell: overlapped rounds move them on at the start)."""
        return max(self._offered_priorities(), default=-1.0) >= epoch + 1

    def _offered_priorities(self) -> list[float]:
        """The state priorities peers offer now (``state_priority``: the epoch is the integer part)."""
        return [p for p in (self._offers() or {}).values() if p is not None]

    def _offers(self) -> dict[bytes, float | None] | None:
        """Peer ID -> the state priority it offers now (None: it withdrew its offer); None if the
        DHT does not answer (a busy DHT: the round's own timeouts still apply)."""
        try:
            found = read_latest(self.averager.dht, state_offers_key(self.averager.prefix))
        except Exception as e:
            logger.debug("could not read the swarm's states: %r", e)
            return None
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        offers = {}
        for peer, entry in entries.items():
            value = getattr(entry, "value", None)
            if isinstance(peer, bytes) and value is None:
                offers[peer] = None
            elif isinstance(peer, bytes) and isinstance(value, (int, float)) and math.isfinite(value):
                offers[peer] = float(value)
        return offers

    def _restart_from(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, t in zip(self.params, tensors):
                p.copy_(t.to(p.device, p.dtype))

    def _restart_from_global(self) -> None:
        self._restart_from(self.global_params)

    def _state_priority(self) -> float:
        return state_priority(self.local_epoch, self.averager.base_group, params_digest(self.global_params))

    def _share_state(self) -> None:
        self.offer.offer(self._state_priority())

    def _heal_split(self) -> bool:
        """Where the swarm split into several groups at the last sync, every group stepped to the
        same epoch with different global parameters. All peers rank those states the same way
        (``state_priority``: the largest group, then the digest), so peers outside the winning group
        download its state and the swarm is one model again. True if this peer downloaded it."""
        self._consensus_check_at = None
        epoch = self.local_epoch
        # Computed, not read from the averager: a client-mode peer shares no state but ranks alike.
        mine = self._state_priority()
        # (If the DHT is busy, no offers: the next round's checks catch a split too.)
        offers = self._offered_priorities()
        better = [p for p in offers if int(p) == epoch and p > mine + 1e-12]
        if not better:
            if any(int(p) > epoch for p in offers):
                # The swarm stepped past this epoch before we compared notes: whether our group's
                # result was the canonical one is unknown now (the next check downloads theirs).
                self.rounds.mark(epoch - 1, overtaken=True)
            return False
        logger.warning("the swarm split into groups at epoch %d; taking the largest group's state", epoch)
        self.rounds.mark(epoch - 1, diverged=True, healed=True)
        self.load_state_from_peers(lost_branch=True)
        return True
