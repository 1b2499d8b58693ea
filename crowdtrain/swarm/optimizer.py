"""The swarm optimizer: hivemind.Optimizer around an 8-bit LAMB, with the paper's schedule.

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

import bitsandbytes as bnb
import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.optim.grad_averager import GradientAverager

from crowdtrain.optim import linear_warmup_decay, param_groups
from crowdtrain.swarm.auth import AccessGuard, guarded
from crowdtrain.swarm.compression import PaperCompression
from crowdtrain.swarm.config import SwarmConfig
from crowdtrain.swarm.robust import RobustOptimizerMixin, make_aggregator

logger = logging.getLogger(__name__)


class ClippedLAMB8bit(bnb.optim.LAMB8bit):
    """bitsandbytes' 8-bit LAMB that first clips the (averaged) gradient's global norm."""

    def __init__(self, params, *, clip_grad_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad_norm = clip_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.clip_grad_norm and params:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        return super().step(closure)


def make_lamb(params, config: SwarmConfig) -> ClippedLAMB8bit:
    return ClippedLAMB8bit(params, lr=config.lr, betas=config.betas, eps=config.eps,
                           weight_decay=config.weight_decay, clip_grad_norm=config.clip_grad_norm)


def make_scheduler(optimizer, config: SwarmConfig):
    schedule = partial(linear_warmup_decay, warmup_steps=config.warmup_epochs, total_steps=config.total_epochs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


class StateUnavailable(RuntimeError):
    """No peer could serve the swarm's current state for a long time: the run is over or unreachable."""


class SwarmOptimizer(RobustOptimizerMixin, hivemind.Optimizer):
    """hivemind.Optimizer that remembers how many peers each gradient-averaging round had, whose
    averagers aggregate with the run's rule (``crowdtrain.swarm.robust``) and refuse peers without a
    valid access token (when given an ``access_guard``)."""

    def __init__(self, *args, access_guard: AccessGuard | None = None, give_up_s: float = 600.0, **kwargs):
        self.access_guard = access_guard
        if access_guard is not None:
            kwargs["grad_averager_factory"] = guarded(kwargs.get("grad_averager_factory") or GradientAverager,
                                                      access_guard)
        super().__init__(*args, **kwargs)
        self.give_up_s = give_up_s
        self._behind_since: float | None = None
        self._rounds_lock = threading.Lock()
        self.rounds: list[dict] = []  # {"epoch", "group_size", "swarm_peers"} per round

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        swarm_peers = self.tracker.global_progress.num_peers
        epoch = self.local_epoch
        triggered_unix = time.time()
        allreduce_unix = _wait_for_allreduce_start(maybe_step_control, self.averaging_timeout)
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        group_size = 1
        if maybe_step_control is not None and maybe_step_control.done() and not maybe_step_control.cancelled():
            try:
                group_size = len(maybe_step_control.result(0))
            except BaseException:  # the round failed: this peer used its local gradients
                group_size = 1
        with self._rounds_lock:
            # Wall-clock times (comparable across peers on one machine): the round was triggered
            # (this peer reached the target batch), its all-reduce began exchanging tensors, it ended.
            self.rounds.append({"epoch": epoch, "group_size": group_size, "swarm_peers": swarm_peers,
                                "triggered_unix": triggered_unix, "allreduce_unix": allreduce_unix,
                                "done_unix": time.time()})

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind's catch-up, bounded and without its second download (see below). hivemind
        retries a failed download forever, and a peer that is behind downloads again at every
        step; a peer left behind when everyone else has gone (they reached ``--max-epochs``, or
        the run is over) did that for good. Here a download that keeps failing, or a peer that
        stays behind after downloading, gives up after ``give_up_s`` with
        :class:`StateUnavailable`, which ``crowdtrain join`` reports."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)  # as hivemind: do not stall the round
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        started = time.monotonic()
        with self.tracker.pause_updates():
            while True:
                try:
                    # The state only: hivemind also downloads the gradient averager's "state", its
                    # fp32 gradient accumulators, then discards them (and zeroes its own below):
                    # a second, larger download (model x 4 bytes, uncompressed) for nothing, which
                    # more than doubled a newcomer's wait on a 10 Mbit/s link.
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
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
            if global_epoch - 1 <= self.local_epoch < global_epoch:
                logger.info("catching up with the swarm's epoch %d", global_epoch)
                self.state_averager.local_epoch = global_epoch
            if self.local_epoch < global_epoch - 1:  # the newest state served is still behind
                if self._behind_since is None:
                    self._behind_since = started
                if time.monotonic() - self._behind_since > self.give_up_s:
                    raise StateUnavailable(
                        f"the swarm reports epoch {global_epoch} but the newest state any peer served is epoch "
                        f"{self.local_epoch}, for {time.monotonic() - self._behind_since:.0f}s")
            else:
                self._behind_since = None
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def last_round(self) -> dict | None:
        with self._rounds_lock:
            return self.rounds[-1] if self.rounds else None

    def finish_pending_updates(self) -> None:
        """Apply the delayed optimizer step, if one is running in the background."""
        self.state_averager.step(wait_for_delayed_updates=True)


def swarm_epoch_now(tracker) -> int:
    """The newest epoch any peer reports, read from the DHT now: a paused ProgressTracker's view is
    frozen (during a round or a state download). Falls back to the tracker's view."""
    try:
        found = tracker.dht.get(tracker.training_progress_key, latest=True)
    except Exception as e:  # the DHT is busy
        logger.debug("could not read the swarm's progress: %r", e)
        return tracker.global_epoch
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    epochs = [v.value["epoch"] for v in entries.values()
              if isinstance(getattr(v, "value", None), dict) and isinstance(v.value.get("epoch"), int)]
    return max([tracker.global_epoch, *epochs])


def _wait_for_allreduce_start(control, timeout_s: float) -> float | None:
    """When the averager (a child process) began exchanging tensors: its stage lives in shared
    memory, so poll it until the all-reduce starts or the step ends. None if it never started."""
    if control is None:
        return None
    deadline = time.monotonic() + timeout_s
    while not control.done() and time.monotonic() < deadline:
        if control.stage == AveragingStage.RUNNING_ALLREDUCE:
            return time.time()
        time.sleep(0.005)
    return None


def build_optimizer(dht: hivemind.DHT, model: torch.nn.Module, config: SwarmConfig, *, batch_size: int | None,
                    client_mode: bool = False, auxiliary: bool = False, verbose: bool = False, attack=None,
                    access_guard: AccessGuard | None = None):
    """The run's optimizer for its ``mode``: SwarmOptimizer (sync) or DiLoCoOptimizer (diloco).

    ``attack`` (``crowdtrain.swarm.attacks``, tests only) crafts what this peer sends.
    """
    if config.mode == "diloco":
        from crowdtrain.swarm.diloco import DiLoCoOptimizer

        return DiLoCoOptimizer(dht=dht, model=model, config=config, batch_size=batch_size, client_mode=client_mode,
                               attack=attack, verbose=verbose, access_guard=access_guard)
    compression = PaperCompression(config.compression_threshold)
    return SwarmOptimizer(
        access_guard=access_guard, give_up_s=config.load_state_give_up_s,
        dht=dht, run_id=config.run_id, target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size,
        optimizer=partial(make_lamb, config=config), params=param_groups(model, config.weight_decay),
        scheduler=partial(make_scheduler, config=config),
        matchmaking_time=config.matchmaking_time_s, averaging_timeout=config.averaging_timeout_s,
        load_state_timeout=config.load_state_timeout_s, average_state_every=config.average_state_every,
        offload_optimizer=config.offload_optimizer, delay_optimizer_step=config.delay_optimizer_step,
        delay_grad_averaging=config.delay_optimizer_step,
        grad_compression=compression, state_averaging_compression=compression, load_state_compression=compression,
        client_mode=client_mode, auxiliary=auxiliary, verbose=verbose,
        aggregator=make_aggregator(config), attack=attack,
        # request_timeout below min_matchmaking_time avoids rare matchmaking deadlocks.
        averager_opts=dict(request_timeout=min(1.0, config.matchmaking_time_s / 3),
                           min_group_size=config.min_group_size),
        next_chunk_timeout=config.next_chunk_timeout_s,
        tracker_opts=dict(min_refresh_period=0.5, max_refresh_period=max(2.0, config.matchmaking_time_s)),
    )


def all_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors if t is not None)


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into named tensors and JSON, for safetensors checkpoints."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            name = "/".join(path)
            tensors[name] = obj
            return {"__tensor__": name}
        if isinstance(obj, dict):
            return {"__dict__": [[k, walk(v, path + [str(k)])] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"__list__": [walk(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"cannot store optimizer state entry {'/'.join(path)} of type {type(obj).__name__}")

    return tensors, {"structure": walk(state_dict, [])}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    def build(node):
        if isinstance(node, dict) and "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if isinstance(node, dict) and "__dict__" in node:
            return {k: build(v) for k, v in node["__dict__"]}
        if isinstance(node, dict) and "__list__" in node:
            return [build(v) for v in node["__list__"]]
        return node

    return build(meta["structure"])
