"""A peer that cannot catch up with the swarm gives up with a reason instead of retrying forever
(the bounded ``SwarmOptimizer.load_state_from_peers``; hivemind's own loop never ends)."""

import contextlib
from types import SimpleNamespace

import pytest

from crowdtrain.swarm.config import SwarmConfig
from crowdtrain.swarm.optimizer import StateUnavailable, SwarmOptimizer


class _StateAverager:
    def __init__(self, outcomes):
        self.outcomes, self.calls, self.local_epoch = list(outcomes), 0, 0

    def step(self, wait_for_delayed_updates):
        pass

    def load_state_from_peers(self, timeout):
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        if outcome is not None:
            self.local_epoch = outcome


class _Optimizer(SimpleNamespace):
    @property
    def local_epoch(self):  # as hivemind's: the state averager's epoch
        return self.state_averager.local_epoch


class _DHT:
    """Peers' progress records as hivemind's ProgressTracker stores them."""

    def __init__(self, epochs=()):
        self.epochs = list(epochs)

    def get(self, key, latest):
        assert key == "run_progress" and latest
        records = {f"peer{i}": SimpleNamespace(value={"epoch": e, "samples_accumulated": 0})
                   for i, e in enumerate(self.epochs)}
        return SimpleNamespace(value=records) if records else None


def _optimizer(outcomes, global_epoch, give_up_s, swarm_epochs=()):
    averager = _StateAverager(outcomes)
    tracker = SimpleNamespace(global_epoch=global_epoch, pause_updates=contextlib.nullcontext,
                              report_local_progress=lambda **kw: None, dht=_DHT(swarm_epochs),
                              training_progress_key="run_progress")
    opt = _Optimizer(scheduled_grads=None, state_averager=averager, grad_averager=None, tracker=tracker,
                     load_state_timeout=1.0, give_up_s=give_up_s, _behind_since=None, client_mode=True,
                     use_gradient_averaging=False)
    return opt, averager


def test_a_download_that_keeps_failing_gives_up_after_the_limit_and_says_why(monkeypatch):
    clock = iter(range(0, 10_000, 100))  # every attempt "takes" 100 s
    monkeypatch.setattr("crowdtrain.swarm.optimizer.time.monotonic", lambda: next(clock))
    opt, averager = _optimizer([TimeoutError("no answer")] * 100, global_epoch=9, give_up_s=450)
    with pytest.raises(StateUnavailable, match="no peer served the swarm's state in 500s"):
        SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 5, "retried until the limit, not forever"


def test_a_transient_failure_is_retried_and_a_peer_one_epoch_behind_catches_up():
    opt, averager = _optimizer([TimeoutError("busy"), 8], global_epoch=9, give_up_s=600)
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 2 and opt.local_epoch == 9 and opt._behind_since is None


def test_a_peer_that_stays_behind_every_state_served_leaves(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("crowdtrain.swarm.optimizer.time.monotonic", lambda: now[0])
    opt, _ = _optimizer([3] * 10, global_epoch=40, give_up_s=300)  # the others left at epoch 40
    for _ in range(3):  # hivemind asks again at every step while the peer is behind
        SwarmOptimizer.load_state_from_peers(opt)
        now[0] += 120
    with pytest.raises(StateUnavailable, match="reports epoch 40 but the newest state any peer served is epoch 3"):
        SwarmOptimizer.load_state_from_peers(opt)


def test_the_give_up_time_follows_the_load_timeout():
    assert SwarmConfig(load_state_timeout_s=30).load_state_give_up_s == 150


class _GradAverager:
    def __init__(self):
        self.downloads = self.resets = 0

    def load_state_from_peers(self, timeout):
        self.downloads += 1

    def reset_accumulated_grads_(self):
        self.resets += 1


def test_catching_up_downloads_the_state_once_not_the_gradient_buffers_too():
    # hivemind also downloads the gradient averager's fp32 accumulators (model x 4 bytes) and
    # throws them away: on a 10 Mbit/s link that more than doubled a newcomer's wait.
    opt, averager = _optimizer([5], global_epoch=5, give_up_s=600)
    opt.grad_averager, opt.use_gradient_averaging = _GradAverager(), True
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 1 and opt.local_epoch == 5
    assert opt.grad_averager.downloads == 0 and opt.grad_averager.resets == 1


def test_after_a_long_download_the_epoch_check_reads_the_swarm_afresh():
    # The tracker is paused during the download, so its epoch is as old as the download start
    # (5); the swarm moved to 6 meanwhile. One epoch behind catches up (as hivemind intends)
    # instead of downloading again at the next step.
    opt, averager = _optimizer([5], global_epoch=5, give_up_s=600, swarm_epochs=[6, 6, 5])
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 1 and opt.local_epoch == 6
