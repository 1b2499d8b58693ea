"""The run's collaboration settings, shared by every peer (the coordinator hands them out as JSON).

Tuning by symptom:
- "Averaging gradients failed ... could not find a group" or rounds with fewer peers than are
  alive: raise ``matchmaking_time_s`` (3-5 s on one machine or a LAN, 6 s or more where many
  peers share a machine's cores, 10-15 s over the Internet). A third of it, at most 3 s, is how
  long a peer waits on a would-be leader, whose averager answers late on a busy CPU.
- Rounds that split into several groups of a few peers each (peers in last round "4/12", "5/12";
  the dashboard says "averaging rounds are missing peers"): a peer looks at the clock only
  between its steps, so each books its place in the round one step plus ``matchmaking_time_s``
  before the epoch's estimated end (``crowdtrain.swarm.rounds.gradient_round_lookahead_s``) and
  all meet at that end. In the group, a peer still finishing its step keeps the others waiting,
  for at most ``next_chunk_timeout_s`` (a quarter of ``averaging_timeout_s``). What still splits
  a round: an estimate of the end that moves by more than the matchmaking time (peers joining
  or leaving in the last step), a newcomer slower than the others (before its first step it books
  on a guess: its batch at the other peers' median speed), or steps longer than a quarter of
  ``averaging_timeout_s``. Raise ``matchmaking_time_s``, and
  ``averaging_timeout_s`` to at least four times the slowest volunteer's step.
- Rounds that time out while data is still flowing: raise ``averaging_timeout_s`` to about twice
  the measured all-reduce time (slow uplinks need more).
- Peers logging "returned part of the average to this peer only" (then downloading the state)
  or "went on without this peer" every few epochs: groupmates reach the round seconds apart
  (a slow tracker refresh, a long state round still running): raise ``averaging_timeout_s`` (a
  groupmate may be silent for a quarter of it) and ``matchmaking_time_s``.
- Peers spending much of their time waiting on averaging: raise ``target_batch_size`` so each
  epoch holds more compute per round of communication, or use ``mode="diloco"``.
- A slow volunteer contributing one step per epoch (its "samples/s" far below what it computes
  alone) and, now and then, rounds where its groupmates wait for its part: epochs last about as
  long as a round (matchmaking plus the all-reduce), so it reaches each epoch's end while its
  last round still runs and waits for it (hivemind runs one update at a time). Raise
  ``target_batch_size`` to epochs of several rounds' time (a three-peer test swarm went from 3 s
  epochs, where its slow peer sent 4 samples a round, to 7 s, where it sent all it computed).

Modes (``mode``): ``sync`` is the paper's: one global epoch = one optimizer step on gradients
averaged over ``target_batch_size`` samples. ``diloco`` (``crowdtrain.swarm.diloco``): every
peer steps its ``inner_optimizer`` on each local batch; one global epoch = one outer Nesterov
step (``outer_lr``, ``outer_momentum``) on the averaged pseudo-gradient, taken when the swarm
together has processed ``target_batch_size`` samples. ``lr``, ``betas``, ``eps``,
``weight_decay``, ``clip_grad_norm`` and the schedule then apply to the inner optimizer;
``average_state_every``, ``delay_optimizer_step`` and ``offload_optimizer`` to sync mode only;
``overlap_outer_round`` to DiLoCo mode only (its counterpart of delayed updates).

Aggregation (``aggregation``, ``crowdtrain.swarm.robust``): how each peer combines the parts
it reduces in the butterfly all-reduce, in both modes: ``mean`` or ``centered_clip``
(``clip_radius`` in units of the parts' median spread, ``clip_iterations``, and
``max_weight_ratio``, the most a sender's weight counts in times the median). Parts with NaN or
inf are dropped whatever the rule. A sender whose parts were mostly dropped or (``centered_clip``,
``outlier_distance``) outliers in a round is suspect: its samples stop counting toward
``target_batch_size`` until its parts look normal again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# The settings a live run may change (crowdtrain.coordinator.restart): the schedule, which every
# volunteer picks up while it trains (crowdtrain.swarm.schedule_watch), and what each peer applies
# on its own, where peers with different values still train one model together (volunteers keep
# theirs until they rejoin). Every other setting is refused on a restart of a run that trained.
SCHEDULE_SETTINGS = ("total_epochs", "warmup_epochs")
PEER_LOCAL_SETTINGS = ("matchmaking_time_s", "averaging_timeout_s", "load_state_timeout_s", "average_state_every",
                       "compression_threshold", "delay_optimizer_step", "offload_optimizer", "checkpoint_every_epochs",
                       "max_state_uploads", "clip_radius", "clip_iterations", "outlier_distance", "max_weight_ratio")

MODES = ("sync", "diloco")
AGGREGATIONS = ("mean", "centered_clip")
INNER_OPTIMIZERS = ("adamw", "lamb8bit")


@dataclass(frozen=True)
class SwarmConfig:
    run_id: str = "crowdtrain"
    # One global epoch = one optimizer step, taken when the swarm together has accumulated
    # this many samples, however they are spread over peers.
    target_batch_size: int = 4096
    matchmaking_time_s: float = 5.0
    averaging_timeout_s: float = 60.0
    load_state_timeout_s: float = 120.0
    # Epochs between parameter/optimizer-state averaging rounds. Gradient averaging already keeps
    # peers in step; a state round re-aligns what drifts (a peer that missed a round, compression
    # noise) but is one more all-reduce per epoch that peers reach at different moments (it runs
    # in the background after the optimizer step). Every epoch (hivemind's default) stalled the
    # next gradient round (seen with py-spy). 3 unequal peers on one 2-core machine averaged all
    # together in 33-63% of rounds over 4 runs; every 5 epochs, in 33-100% over 6 runs (67-100%
    # in 4 of them). Better on average, not decisive: on a starved CPU rounds still split.
    average_state_every: int = 5
    # Wire compression: 8-bit quantization for tensors with at least this many elements,
    # fp16 for smaller float tensors, integer tensors (8-bit optimizer codes) as they are.
    compression_threshold: int = 2**16
    # Optimizer: LAMB with 8-bit states (bitsandbytes), the paper's hyper-parameters.
    lr: float = 2.5e-3
    betas: tuple[float, float] = (0.9, 0.96)
    eps: float = 1e-6
    weight_decay: float = 0.045
    clip_grad_norm: float = 4.0
    warmup_epochs: int = 100  # linear warm-up, then linear decay to zero at total_epochs
    total_epochs: int = 1000
    # The optimizer step (and gradient round) overlaps the next epoch's compute, whose gradients
    # are then one step stale for as long as the round lasts: free when a round is a few percent
    # of an epoch (the paper's regime); when rounds fill most of an epoch, set False (convergence
    # per step of a lone peer, at the cost of waiting for each round).
    delay_optimizer_step: bool = True
    offload_optimizer: bool = True  # optimizer state lives on the CPU on GPU peers
    checkpoint_every_epochs: int = 10  # the coordinator's auxiliary peer saves this often
    # States a peer sends at once to peers catching up (newcomers, peers back from a missed round).
    # Asked for one more, it answers with nothing and the asker tries the next peer, so a storm of
    # newcomers spreads over the swarm instead of sharing one donor's uplink (hivemind #169). On
    # home uplinks 1 gives each download the whole link; raise it where donors are few and
    # uplinks fast.
    max_state_uploads: int = 2
    mode: str = "sync"  # "sync" (average gradients every epoch) or "diloco" (see the module docstring)
    # DiLoCo mode: the local optimizer, and the outer Nesterov SGD on pseudo-gradients (DiLoCo's defaults).
    inner_optimizer: str = "adamw"  # "adamw" or "lamb8bit"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    # DiLoCo mode: run each pseudo-gradient round in the background while inner steps go on (from
    # this peer's estimate of the outer step), and apply the outer step when it ends, keeping the
    # inner steps taken meanwhile (they count toward the next round). The trainer then waits
    # only if a round outlasts a whole epoch. On a 10 Mbit/s uplink a 20M-parameter round takes
    # about 37 s. Costs some loss per sample (staleness): worth it when rounds would otherwise
    # take a large share of the wall time.
    overlap_outer_round: bool = False
    # How each peer combines what it reduces: "mean" or "centered_clip" (robust to attackers).
    aggregation: str = "mean"
    clip_radius: float = 1.0  # centered_clip: multiple of the median distance of the parts from their median
    clip_iterations: int = 3
    # centered_clip: a part farther than this many median distances from the median is an outlier.
    # A sender whose parts were mostly outliers (or non-finite) in a round becomes suspect: its
    # samples stop counting toward target_batch_size (crowdtrain.swarm.robust.SuspectPeers).
    outlier_distance: float = 4.0
    # centered_clip: a sender's weight (the samples it claims) counts at most this many times the
    # median weight of the slice's senders; a claim of 1000x would otherwise carry the estimate.
    max_weight_ratio: float = 4.0
    # Peers per averaging group (hivemind's target_group_size; Moshpit-style groups): 0, the whole
    # swarm in one group, is the only value crowdtrain trains one model with (see
    # ``_check_group_size``).
    target_group_size: int = 0

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        # NaN passes every `x <= 0` check below, and inf is no setting: refuse both first.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0 (--swarm lr=0.003), got {self.lr}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0 or not self.weight_decay >= 0 or not self.clip_grad_norm >= 0:
            raise ValueError(f"eps must be > 0, weight_decay >= 0 and clip_grad_norm >= 0 (0: no clipping), got "
                             f"{self.eps}, {self.weight_decay} and {self.clip_grad_norm}")
        if not self.load_state_timeout_s > 0 or self.average_state_every < 1 or self.checkpoint_every_epochs < 1:
            raise ValueError(f"load_state_timeout_s must be > 0, average_state_every and checkpoint_every_epochs "
                             f">= 1, got {self.load_state_timeout_s}, {self.average_state_every} and "
                             f"{self.checkpoint_every_epochs}")
        if not self.run_id or not self.run_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--run-id must be letters, digits, '-' or '_', got {self.run_id!r}")
        if self.max_state_uploads < 1:
            raise ValueError(f"max_state_uploads must be >= 1 (--swarm max_state_uploads=2), got "
                             f"{self.max_state_uploads}")
        if self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if self.matchmaking_time_s <= 0 or self.averaging_timeout_s <= self.matchmaking_time_s:
            raise ValueError("averaging_timeout_s must exceed matchmaking_time_s > 0 "
                             f"(got {self.averaging_timeout_s} and {self.matchmaking_time_s})")
        if not 0 <= self.warmup_epochs < self.total_epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be below total_epochs ({self.total_epochs})")
        if self.compression_threshold < 1:
            raise ValueError("compression_threshold must be >= 1")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (--swarm mode=diloco), got {self.mode!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS} (--swarm aggregation=centered_clip), "
                             f"got {self.aggregation!r}")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"inner_optimizer must be one of {INNER_OPTIMIZERS}, got {self.inner_optimizer!r}")
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr} and "
                             f"{self.outer_momentum}")
        if not self.clip_radius > 0 or self.clip_iterations < 1:
            raise ValueError(f"clip_radius must be > 0 and clip_iterations >= 1, got {self.clip_radius} and "
                             f"{self.clip_iterations}")
        if not self.max_weight_ratio >= 1:
            raise ValueError(f"max_weight_ratio must be >= 1 (times the median weight), got {self.max_weight_ratio}")
        if not self.outlier_distance > 1:
            raise ValueError(f"outlier_distance must be > 1 (in median distances; honest parts lie within about "
                             f"1.5), got {self.outlier_distance}")
        self._check_group_size()

    def _check_group_size(self) -> None:
        """Groups smaller than the swarm are refused: crowdtrain's consistency checks read a round
        as the swarm's one round. In sync mode a peer still matchmaking when another group has
        published its finished round takes itself for left out (``crowdtrain.swarm.rounds.
        LeftOutWatch``), drops its round and downloads the state, and every group steps on its own
        group's mean gradient, so peers drift apart between state rounds. In DiLoCo mode the
        groups' outer steps differ and the consistency check keeps one group's (the largest):
        every other group's pseudo-gradients are discarded and its peers download the state each
        round. ``centered_clip`` in small groups outvotes an attacker only where it is outnumbered
        within the group. ``docs/scale.md`` has the measurements."""
        if self.target_group_size < 0 or self.target_group_size == 1:
            raise ValueError(f"target_group_size must be 0 (the whole swarm in one group) or >= 2, got "
                             f"{self.target_group_size}")
        if self.target_group_size:
            raise ValueError(
                f"target_group_size={self.target_group_size} (averaging groups smaller than the swarm) is not "
                "supported: crowdtrain's round records, left-out watch and state checks assume each round is one "
                "group of every live peer, and with several groups per round peers would drop their rounds, "
                f"download the state or (DiLoCo) have their updates discarded. Remove target_group_size (or set "
                "--swarm target_group_size=0) and raise matchmaking_time_s if rounds miss peers; see docs/scale.md")

    @property
    def min_group_size(self) -> int:
        """Robust aggregation outvotes an attacker only where honest peers are the majority: with
        ``centered_clip``, groups of two (one of whom may be the attacker) do not form, and a peer
        without a group of three uses its own update for that round (a swarm of two trains apart)."""
        return 3 if self.aggregation == "centered_clip" else 2

    @property
    def load_state_give_up_s(self) -> float:
        """A peer that cannot get the swarm's current state for this long (every download failed,
        or the newest state served stays more than an epoch behind the swarm's progress records)
        leaves with a message instead of retrying forever: the run is over or unreachable."""
        return 5 * self.load_state_timeout_s

    @property
    def request_timeout_s(self) -> float:
        """Seconds a peer looking for a group waits on a would-be leader (hivemind's
        ``request_timeout``). Below the matchmaking time, as hivemind asks (it breaks
        request cycles), and at most hivemind's 3 s: a follower also gives up on its leader this
        long after its own deadline, and a leader's busy CPU should not cost it the follower
        (suspected, with 1 s, in one loaded testbed run: the group counted a peer that never
        ran the round, and the others got a partial average). 1 s at the tests' 3 s."""
        return min(3.0, self.matchmaking_time_s / 3)

    @property
    def next_chunk_timeout_s(self) -> float:
        """Seconds a groupmate may go silent mid all-reduce before the group goes on without it.
        hivemind's default (matchmaking_time) drops peers on a busy CPU or mid-step, and a dropped
        peer's part is lost to the whole group: allow a quarter of the round's budget."""
        return max(self.matchmaking_time_s, self.averaging_timeout_s / 4)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SwarmConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown swarm setting(s) {unknown}; this crowdtrain knows {sorted(known)}: "
                             "upgrade crowdtrain to join this run")
        return cls(**d)


def demo_swarm_config(run_id: str = "demo") -> SwarmConfig:
    """Settings for a swarm on one small machine: short epochs so the loss moves in minutes."""
    # Epochs of a few seconds (several matchmaking windows, so rounds do not miss each other).
    # LAMB moves each layer by about lr times its norm a step, and a demo takes tens of steps,
    # not thousands: at 39 steps of batch 256 (bench_quality's f-* arms, 10k samples) held-out
    # loss was 4.82 at lr 0.01, 4.06 at 0.03 and 3.04 at 0.1. The swarm tests train at 0.1 too.
    return SwarmConfig(run_id=run_id, target_batch_size=256, matchmaking_time_s=3.0, averaging_timeout_s=30.0,
                       lr=0.1, warmup_epochs=5, total_epochs=150, checkpoint_every_epochs=5)


def laptop_swarm_config(run_id: str = "demo") -> SwarmConfig:
    """A few peers sharing one small machine (``crowdtrain demo``): DiLoCo, chosen by
    ``benchmarks/bench_quality.py``.

    On 2 cores the whole swarm computes about 60 samples/s. Sync mode then takes one optimizer
    step per ``target_batch_size`` samples of the whole swarm (a 256-sample epoch every ~4 s, each
    with a round of matchmaking), which is a few dozen steps in five minutes: far too few. In
    DiLoCo mode every peer takes an AdamW step on each of its own batches, at the rate a lone
    peer would, and the swarm averages what the peers learned every ``target_batch_size``
    samples (about every 13 s here), so the model gets one process's number of updates with
    every peer's data. ``total_epochs`` is for the caller to size to the run's length: the inner
    learning rate decays to zero at its end, which is worth about 10% of held-out loss.

    The outer step is plain averaging (outer lr 1, no momentum), not DiLoCo's Nesterov 0.7/0.9,
    which was tuned for 500 inner steps a round; here a round is about 16.
    ``benchmarks/bench_diloco_outer.py`` at 11.5k samples (inner warm-up from zero over 2 rounds):
    held-out loss 0.65 against 0.68 for 0.7/0.9; 0.63 syncing twice as often. The inner rate:
    0.80 at 2e-3, 0.57 at 5e-3 and at 8e-3; in the real 5-minute demo 5e-3 ended level with 3e-3
    (held-out 0.385 and 0.377 against 0.380, one run each), so it stays at one process's rate.
    """
    return SwarmConfig(run_id=run_id, mode="diloco", inner_optimizer="adamw", lr=3e-3, target_batch_size=768,
                       outer_lr=1.0, outer_momentum=0.0,
                       matchmaking_time_s=3.0, averaging_timeout_s=30.0, warmup_epochs=2, total_epochs=20,
                       checkpoint_every_epochs=2)
