"""A peer that cannot catch up with the swarm gives up with a reason instead of retrying forever
(the bounded ``SwarmOptimizer.load_state_from_peers``; hivemind's own loop never ends); a peer
left out of a round stops waiting for it and takes the group's state."""

import contextlib
import threading
import time
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm.hivemind_seam.optimizer import OptimizerSeam
from crowdtrain.swarm.optimizer import CatchUp, StateUnavailable, SwarmOptimizer
from crowdtrain.swarm.rounds import RoundLog, StateOffer


class _StateAverager:
    def __init__(self, outcomes):
        self.outcomes, self.calls, self.local_epoch = list(outcomes), 0, 0
        self.states_loaded = SimpleNamespace(value=0)  # as crowdtrain.swarm.hivemind_seam.state.StateUploadLimit counts

    def step(self, wait_for_delayed_updates):
        pass

    def load_state_from_peers(self, timeout):
        self.calls += 1
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        if outcome is not None:
            self.local_epoch = outcome
            self.states_loaded.value += 1


class _Optimizer(SimpleNamespace):
    @property
    def local_epoch(self):  # as hivemind's: the state averager's epoch
        return self.state_averager.local_epoch


class _DHT:
    """Peers' progress records as hivemind's ProgressTracker stores them."""

    def __init__(self, epochs=()):
        self.epochs = list(epochs)

    def get(self, key, latest, return_future=False):
        assert key == "run_progress" and latest
        records = {f"peer{i}": SimpleNamespace(value={"epoch": e, "samples_accumulated": 0})
                   for i, e in enumerate(self.epochs)}
        found = SimpleNamespace(value=records) if records else None
        return SimpleNamespace(result=lambda timeout=None: found) if return_future else found


def _optimizer(outcomes, global_epoch, give_up_s, swarm_epochs=()):
    averager = _StateAverager(outcomes)
    tracker = SimpleNamespace(global_epoch=global_epoch, pause_updates=contextlib.nullcontext,
                              report_local_progress=lambda **kw: None, dht=_DHT(swarm_epochs),
                              training_progress_key="run_progress")
    opt = _Optimizer(scheduled_grads=None, state_averager=averager, grad_averager=None, tracker=tracker,
                     load_state_timeout=1.0, averaging_timeout=30.0, give_up_s=give_up_s, catch_up=CatchUp(), client_mode=True,
                     use_gradient_averaging=False, offer=StateOffer(averager, client_mode=True),
                     _others_finished=lambda epoch: True)
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
    assert averager.calls == 2 and opt.local_epoch == 9 and opt.catch_up.behind_since is None


def test_a_peer_that_stays_behind_every_state_served_leaves(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("crowdtrain.swarm.optimizer.time.monotonic", lambda: now[0])
    opt, _ = _optimizer([3] * 10, global_epoch=40, give_up_s=300)  # the others left at epoch 40
    for _ in range(3):  # hivemind asks again at every step while the peer is behind
        SwarmOptimizer.load_state_from_peers(opt)
        now[0] += 120
    with pytest.raises(StateUnavailable, match="reports epoch 40 but the newest state any peer served is epoch 3"):
        SwarmOptimizer.load_state_from_peers(opt)


def test_a_peer_whose_donors_were_all_busy_is_not_relabelled_as_caught_up(monkeypatch):
    """Nothing served (every donor of the newest state busy): the peer keeps its epoch, and does
    not take the swarm's epoch for parameters it never downloaded; the next step asks again."""
    monkeypatch.setattr("crowdtrain.swarm.optimizer.time.sleep", lambda s: None)
    opt, averager = _optimizer([None, 9], global_epoch=1, give_up_s=600)  # a newcomer at epoch 0
    SwarmOptimizer.load_state_from_peers(opt)
    assert opt.local_epoch == 0 and opt.catch_up.behind_since is not None
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 2 and opt.local_epoch == 9 and opt.catch_up.behind_since is None


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
    # (5); the swarm moved to 6 meanwhile. A peer reports epoch 5's round done: one epoch behind
    # catches up (as hivemind does) instead of downloading again, as slowly, at the next step.
    opt, averager = _optimizer([5], global_epoch=5, give_up_s=600, swarm_epochs=[6, 6, 5])
    opt._others_finished = lambda epoch: epoch == 5
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 1 and opt.local_epoch == 6


def test_a_state_served_while_its_donors_update_runs_keeps_its_epoch():
    """The swarm reports epoch 6 and the donors serve epoch 5, their update still running (nobody
    reports epoch 5's round done). Labelled 6, this peer's next matchmaking would join that round
    as its epoch-6 round (group keys carry no epoch): its rounds one epoch off for good. It keeps
    epoch 5, steps at once, and joins that round; it is not behind enough to wait."""
    opt, averager = _optimizer([5], global_epoch=6, give_up_s=600, swarm_epochs=[6, 6])
    asked = []
    opt._others_finished = lambda epoch: asked.append(epoch) or False
    SwarmOptimizer.load_state_from_peers(opt)
    assert averager.calls == 1 and asked == [5] and opt.local_epoch == 5 and opt.catch_up.behind_since is None


def test_a_peer_left_out_of_a_round_stops_waiting_and_downloads_the_groups_state(monkeypatch):
    # A round that went on without this peer: it is still looking for a group after a
    # matchmaking time and another peer reports having finished this epoch's round in a group.
    # Waiting out the averaging timeout would only let that group leave before we download.
    control = SimpleNamespace(stage=AveragingStage.LOOKING_FOR_GROUP, done=lambda: False)
    asked = []
    opt = SimpleNamespace(averaging_timeout=30.0, matchmaking_time=0.2, _nobody_else=lambda: False,
                          _others_finished=lambda epoch: asked.append(epoch) or len(asked) >= 2)
    started = time.monotonic()
    allreduce_unix, left_out, deserted = SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4)
    assert left_out and not deserted and allreduce_unix is None and asked == [4, 4]
    assert 1.0 <= time.monotonic() - started < 5.0, "checked once a second after the matchmaking time"
    # A peer in a running all-reduce is not left out, whatever the others say.
    control.stage = AveragingStage.RUNNING_ALLREDUCE
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4)[1] is False

    # The next step downloads, with our diverged state hidden meanwhile from other left-out peers.
    opt, averager = _optimizer([5], global_epoch=5, give_up_s=600)
    opt.client_mode = False
    opt.catch_up.lose(4)
    opt.offer = StateOffer(averager, client_mode=False)
    # The next round, scheduled ahead, has no group yet: cancelled, not waited for (hivemind
    # tags along with zero weight and blocks until that round ends, maybe an epoch away).
    cancelled = []
    opt.scheduled_grads = SimpleNamespace(done=lambda: False, triggered=False, stage=AveragingStage.LOOKING_FOR_GROUP,
                                          cancel=lambda: cancelled.append(True))
    monkeypatch.setattr("crowdtrain.swarm.rounds.tag_along",
                        lambda control, timeout: pytest.fail("waited for a round with no group yet"))
    opt.state_averager.allow_state_sharing = True
    sharing = []
    averager.load_state_from_peers = lambda timeout: (sharing.append(averager.allow_state_sharing),
                                                      setattr(averager, "local_epoch", 5),
                                                      setattr(averager.states_loaded, "value", 1))
    SwarmOptimizer.load_state_from_peers(opt)
    assert sharing == [False] and averager.allow_state_sharing is True and opt.catch_up.lost_epoch is None
    assert cancelled == [True] and opt.scheduled_grads is None


def test_round_records_are_signed_and_validated():
    validators, signer = swarm_metrics.make_validators("run")
    other_validators, other = swarm_metrics.make_validators("run")
    dht = hivemind.DHT(start=True, record_validators=validators)
    peer = hivemind.DHT(initial_peers=dht.get_visible_maddrs(), start=True, record_validators=other_validators)
    try:
        assert swarm_metrics.largest_finished_group(dht, "run", 3) == 0
        swarm_metrics.publish_round(peer, "run", other, epoch=3, group_size=2)
        deadline = time.monotonic() + 10
        while swarm_metrics.largest_finished_group(dht, "run", 3) != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert swarm_metrics.largest_finished_group(dht, "run", 3) == 2
        assert swarm_metrics.largest_finished_group(dht, "run", 4) == 0, "a record names its epoch"
        assert swarm_metrics.largest_finished_group(dht, "run", 2, or_later=True) == 2
        assert swarm_metrics.largest_finished_group(dht, "run", 4, or_later=True) == 0
        # Nobody can write a round record in another peer's name, nor a malformed one.
        forged = peer.store(swarm_metrics.rounds_key("run"), subkey=signer.local_public_key,
                            value={"epoch": 3, "group_size": 5}, expiration_time=get_dht_time() + 60)
        malformed = peer.store(swarm_metrics.rounds_key("run"), subkey=other.local_public_key,
                               value={"epoch": 3, "group_size": 1}, expiration_time=get_dht_time() + 60)
        assert not forged and not malformed
        assert swarm_metrics.largest_finished_group(dht, "run", 3) == 2
    finally:
        peer.shutdown()
        dht.shutdown()


def test_the_runs_initial_model_is_the_same_bits_in_every_process():
    """Peers that join before the first step skip the download only because of this."""
    import subprocess
    import sys

    from crowdtrain.model import get_preset
    from crowdtrain.train.task import DalleTask, build_initial_model, model_digest, stable_seed

    seed = stable_seed("some-run")
    torch_state = torch.random.get_rng_state()
    here = model_digest(build_initial_model(DalleTask(get_preset("tiny")), seed))
    assert torch.equal(torch.random.get_rng_state(), torch_state), "the global RNG is left alone"
    code = ("from crowdtrain.model import get_preset; from crowdtrain.train.task import *; import torch;"
            "torch.rand(3);"  # another RNG history before the build
            f"print(model_digest(build_initial_model(DalleTask(get_preset('tiny')), {seed})))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    other = model_digest(build_initial_model(DalleTask(get_preset("tiny")), stable_seed("another-run")))
    assert other != here


class _CatchingUpDHT(_DHT):
    """A laggard's progress record that reaches our epoch after ``catch_up_after`` reads."""

    def __init__(self, catch_up_after: int | None):
        super().__init__([6, 5])
        self.reads, self.catch_up_after = 0, catch_up_after

    def get(self, key, latest, return_future=False):
        self.reads += 1
        if self.catch_up_after is not None and self.reads > self.catch_up_after:
            self.epochs = [6, 6]
        return super().get(key, latest, return_future)


@pytest.mark.parametrize("catch_up_after", [3, None])
def test_after_a_round_that_missed_a_peer_a_leaving_peer_serves_until_it_caught_up(catch_up_after):
    # The left-out peer downloads our state; the coordinator's copy may be epochs old, so we stay
    # until its record shows our epoch, or at most min(averaging timeout, 20 s) for a dead peer.
    dht = _CatchingUpDHT(catch_up_after)
    tracker = SimpleNamespace(dht=dht, training_progress_key="run_progress")
    opt = SimpleNamespace(matchmaking_time=0.1, averaging_timeout=4.0, tracker=tracker, local_epoch=6,
                          dht=SimpleNamespace(peer_id=SimpleNamespace(to_bytes=lambda: b"me")))
    started = time.monotonic()
    SwarmOptimizer._serve_laggards(opt, missed=1)
    waited = time.monotonic() - started
    if catch_up_after is not None:
        assert dht.reads == catch_up_after + 1 and 0.2 <= waited < 3.5, (dht.reads, waited)
    else:
        assert 4.0 <= waited < 5.0, waited


def test_a_peer_left_out_of_a_round_ranks_its_state_below_the_groups_at_once():
    # Between the round it missed and its download, its parameters take a step the swarm did not.
    # At its epoch they would tie with the group's; not offered at all, the coordinator's copy
    # (epochs old) would be the best on offer. Half an epoch lower: below the group, above that.
    averager = SimpleNamespace(state_sharing_priority=7.0)
    opt = SimpleNamespace(state_averager=averager, local_epoch=7, offer=StateOffer(averager, client_mode=False))
    SwarmOptimizer._demote_state(opt)
    assert averager.state_sharing_priority == 6.5


@pytest.fixture
def sgd_state_averager():
    """A peer's state averager over one parameter of ones, SGD at lr 0.5, offloaded as in a run."""
    from crowdtrain.swarm.hivemind_seam.state import ConsistentStateAverager

    dht = hivemind.DHT(start=True)
    param = torch.nn.Parameter(torch.ones(4))
    averager = ConsistentStateAverager(dht=dht, prefix="run_state_averager", params=[param],
                                       optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                                       offload_optimizer=True, custom_gradients=True, state_wait_s=0.5, start=True)
    try:
        yield averager
    finally:
        averager.shutdown()
        dht.shutdown()


def test_a_peer_mid_update_serves_a_copy_never_last_epochs_parameters_as_this_epochs(sgd_state_averager):
    # The delayed update: the epoch is incremented at once, the step runs in the background. A
    # download in between must not get the old parameters labelled with the new epoch: the peer
    # that took them would stay one update behind the swarm.
    from crowdtrain.swarm.hivemind_seam.state import ConsistentStateAverager

    averager = sgd_state_averager
    assert ConsistentStateAverager.__name__ == "TrainingStateAverager", "RPC names follow the class name"
    opt_param = averager.optimizer.param_groups[0]["params"][0]
    opt_param.grad = torch.ones(4)
    release = threading.Event()
    averager.step(increment_epoch=True, optimizer_step=True, delay_optimizer_step=True,
                  wait_for_trigger=lambda: release.wait(10))
    assert averager.local_epoch == 1 and averager.update_in_flight()
    metadata, tensors, _ = averager.get_current_state()  # waits 0.5 s, then labels honestly
    assert metadata["epoch"] == 0 and torch.equal(tensors[0], torch.ones(4))
    served_before_the_step = tensors
    # Asked while the update runs, answered once it is done: the new parameters, the new epoch.
    answer = {}
    asker = threading.Thread(target=lambda: answer.update(state=averager.get_current_state()))
    averager.state_wait_s = 10.0
    asker.start()
    time.sleep(0.2)
    release.set()
    asker.join(10)
    metadata, tensors, _ = answer["state"]
    assert metadata["epoch"] == 1 and torch.allclose(tensors[0], torch.full((4,), 0.5))
    assert not averager.update_in_flight()
    # What was served is a copy: a download still streaming it when the step ran (minutes, over
    # a home link) goes on sending epoch 0's parameters, not a mix of both epochs.
    assert torch.equal(served_before_the_step[0], torch.ones(4))


def test_a_peer_whose_step_ran_but_whose_state_round_has_not_ended_serves_the_new_epoch(
        sgd_state_averager):
    # The step and a state-averaging round run in one background update. Once the step has run,
    # the parameters are the new epoch's, even while the round goes on: labelling them with the
    # previous epoch would make the peer that takes them apply this epoch's step a second time.
    averager = sgd_state_averager
    round_ends = threading.Event()
    state_round = SimpleNamespace(triggered=False, done=lambda: False, allow_allreduce=lambda: None,
                                  result=lambda timeout=None: round_ends.wait(10) and {})
    try:
        averager.optimizer.param_groups[0]["params"][0].grad = torch.ones(4)
        averager.step(increment_epoch=True, optimizer_step=True, delay_optimizer_step=True,
                      averaging_round=True, delay_averaging=True, averaging_control=state_round)
        deadline = time.monotonic() + 10
        while averager.optimizer.param_groups[0]["params"][0][0] != 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert averager.update_in_flight(), "the state round is still running"
        metadata, tensors, _ = averager.get_current_state()
        assert metadata["epoch"] == 1 and torch.allclose(tensors[0], torch.full((4,), 0.5))
    finally:
        round_ends.set()


def test_the_step_into_a_peers_last_epoch_does_not_average_state(monkeypatch):
    # It leaves right after that step: a state round it joins would lose it mid-way and leave the
    # rest of its group with a partial average of parameters.
    seen = []
    monkeypatch.setattr(hivemind.Optimizer, "_update_global_epoch",
                        lambda self, grad_scaler: seen.append(self.average_state_every % 3 == 0))
    monkeypatch.setattr(hivemind.Optimizer, "_maybe_schedule_state_averaging", lambda self: seen.append("scheduled"))
    # hivemind.Optimizer's steps go through the seam to SwarmOptimizer's hooks.
    seam = OptimizerSeam.__new__(OptimizerSeam)
    opt = SwarmOptimizer.__new__(SwarmOptimizer)
    seam.hooks, opt.hivemind = opt, seam
    seam._parent_pid = None  # not started: nothing for hivemind to shut down
    seam.average_state_every, opt.final_epoch, opt.leaving = 3, 6, None
    opt.catch_up = CatchUp()
    seam.tracker = SimpleNamespace(global_epoch=0, global_progress=SimpleNamespace(num_peers=2))
    seam.state_averager = SimpleNamespace(local_epoch=4)
    seam._update_global_epoch(None)
    seam._maybe_schedule_state_averaging()
    assert seen == [True, "scheduled"], "epoch 4 -> 5: as hivemind does"
    seen.clear()
    seam.state_averager.local_epoch = 5
    seam._update_global_epoch(None)
    seam._maybe_schedule_state_averaging()
    assert seen == [False] and seam.average_state_every == 3, "epoch 5 -> 6, the last: no state round"
    seen.clear()
    opt.final_epoch = None  # no --max-epochs: every step as hivemind does
    seam._update_global_epoch(None)
    assert seen == [True]
    # Ctrl-C (or SIGTERM) during a step: that step is the last, whatever the epoch. A state round
    # there would hold the leaving peer for up to an averaging timeout (seen: 27 s, its groupmates
    # gone) and lose it mid-way otherwise.
    seen.clear()
    opt.leaving = threading.Event()
    seam._update_global_epoch(None)
    seam._maybe_schedule_state_averaging()
    assert seen == [True, "scheduled"], "not leaving: as hivemind does"
    seen.clear()
    opt.leaving.set()
    seam._update_global_epoch(None)
    seam._maybe_schedule_state_averaging()
    assert seen == [False] and seam.average_state_every == 3, "leaving after this step: no state round"


def _partial(finished_after: int | None, deadline_s: float):
    asked = []
    averager = SimpleNamespace(state_sharing_priority=4.5)
    catch_up = CatchUp()
    catch_up.partial(4, time.monotonic() + deadline_s)
    opt = SimpleNamespace(catch_up=catch_up, local_epoch=5, state_averager=averager, offer=StateOffer(averager, client_mode=False),
                          _others_finished=lambda epoch: asked.append(epoch) or (
                              finished_after is not None and len(asked) > finished_after))
    return opt, asked


def test_a_peer_given_part_of_the_average_downloads_if_a_groupmate_got_all_of_it():
    # A groupmate failed mid-round and never returned its part to us: we kept our own gradients
    # there. The groupmates that got the whole average finish later (their reducers wait out the
    # failed peer), so the training loop asks at its next steps, at most once a second.
    opt, asked = _partial(finished_after=1, deadline_s=30.0)
    SwarmOptimizer._resolve_partial_round(opt, wait=False)
    SwarmOptimizer._resolve_partial_round(opt, wait=False)  # within the second: not asked again
    assert asked == [4] and opt.catch_up.lost_epoch is None and opt.catch_up.partial_epoch == 4
    SwarmOptimizer._resolve_partial_round(opt, wait=True)  # before leaving: until decided
    assert asked == [4, 4] and opt.catch_up.lost_epoch == 4 and opt.catch_up.partial_epoch is None
    assert opt.state_averager.state_sharing_priority == 4.5, "our partial step ranks below the group's"


def test_when_every_groupmate_got_part_of_the_average_a_peer_keeps_its_state_and_offers_it_again():
    opt, asked = _partial(finished_after=None, deadline_s=1.2)
    started = time.monotonic()
    SwarmOptimizer._resolve_partial_round(opt, wait=True)
    assert 1.2 <= time.monotonic() - started < 3.0 and len(asked) >= 2
    assert opt.catch_up.lost_epoch is None and opt.catch_up.partial_epoch is None
    assert opt.state_averager.state_sharing_priority == 5, "as good as anyone's: offered at our epoch again"


def test_a_lost_round_stays_lost_until_a_download_brings_a_state():
    catch_up = CatchUp()
    assert not catch_up.off_step and catch_up.start_download() is None
    catch_up.lose(4)
    assert catch_up.off_step
    lost = catch_up.start_download()
    assert lost == 4 and not catch_up.off_step, "while downloading"
    catch_up.download_failed(lost)
    assert catch_up.lost_epoch == 4, "nobody served a state: the next step tries again"
    catch_up.start_download()
    catch_up.download_failed(None)
    assert not catch_up.off_step, "a plain catch-up that failed loses nothing"


def _in_round(stats: dict):
    """A sync-mode optimizer at epoch 5 in a four-peer swarm, with only what a gradient round
    reads (``stats``: the gradient averager's wire counters); and its state averager."""
    averager = SimpleNamespace(state_sharing_priority=5)
    opt = SwarmOptimizer.__new__(SwarmOptimizer)
    opt.hivemind = SimpleNamespace(
        delay_grad_averaging=True, local_epoch=5, state_averager=SimpleNamespace(local_epoch=5),
        tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=4)),
        grad_averager=SimpleNamespace(wire_stats=SimpleNamespace(snapshot=lambda: dict(stats))),
        next_chunk_timeout=7.5, matchmaking_time=3.0)
    opt.catch_up, opt.signer, opt.rounds, opt.ledger = CatchUp(), object(), RoundLog(), swarm_metrics.Ledger()
    opt.hivemind.dht, opt.hivemind.run_id = None, "run"
    opt.offer = StateOffer(averager, client_mode=False)
    opt.lonely = SimpleNamespace(after=lambda epoch, **counts: None)  # what a lonely round probes: not here
    return opt, averager


@pytest.mark.parametrize("absent", [False, True])
def test_a_partial_round_waits_for_a_whole_average_only_when_one_can_exist(absent, monkeypatch):
    # A groupmate that failed mid-round may have returned the whole average to the others: wait
    # for their report, offering our state low. One absent from the whole all-reduce left its
    # slice out of every member's average (``rounds_missing_a_slice``): nothing to wait for (seen:
    # seven peers leaving a run each waiting a minute for a report nobody could make), and the
    # round record tells the absent one, still looking for the group, that the round is over.
    published = []
    monkeypatch.setattr(swarm_metrics, "publish_round",
                        lambda dht, run_id, signer, *, epoch, group_size: published.append((epoch, group_size)))

    stats = {"weight_averaged": 0, "elements_missing": 0, "rounds_missing_a_slice": 0}

    def upstream():  # the round: part of the average never came back
        stats["elements_missing"] += 100
        stats["rounds_missing_a_slice"] += int(absent)

    opt, averager = _in_round(stats)
    opt._wait_for_allreduce_start = lambda control, epoch: (time.time(), False, False)
    opt._others_finished = lambda epoch: False
    control = SimpleNamespace(done=lambda: True, cancelled=lambda: False, result=lambda timeout: [1, 2, 3, 4],
                              weight=16.0)
    opt.around_gradient_round(control, upstream)
    assert opt.rounds.last().partial
    if absent:
        assert opt.catch_up.partial_epoch is None and averager.state_sharing_priority == 5
        assert published == [(4, 4)]
        started = time.monotonic()
        opt._resolve_partial_round(wait=True)  # what a leaving peer does
        assert time.monotonic() - started < 0.5
    else:
        assert opt.catch_up.partial_epoch == 4 and averager.state_sharing_priority < 5
        assert published == [], "a partial average is not reported as a finished round"


def test_a_leaving_peer_whose_round_finds_no_group_stops_waiting_after_two_matchmaking_times():
    # Ctrl-C during a round that will fail ("could not find a group" after the averaging
    # timeout): the leave waited that long, then for the last step and records (seen: a minute).
    cancelled = []
    control = SimpleNamespace(stage=AveragingStage.LOOKING_FOR_GROUP, done=lambda: bool(cancelled),
                              cancel=lambda: cancelled.append(True))
    leaving = threading.Event()
    opt = SimpleNamespace(averaging_timeout=30.0, matchmaking_time=0.5, _others_finished=lambda epoch: False,
                          _nobody_else=lambda: False, leaving=leaving)
    opt.averaging_timeout = 2.0
    started = time.monotonic()
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4) == (None, False, False)
    assert time.monotonic() - started >= 1.9 and cancelled == [], "not leaving: it waits for a group"
    leaving.set()
    opt.averaging_timeout = 30.0
    started = time.monotonic()
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4) == (None, False, False)
    assert 1.0 <= time.monotonic() - started < 3.0 and cancelled == [True], "two matchmaking times, then cancelled"
    # A round already exchanging tensors is finished, leaving or not.
    control = SimpleNamespace(stage=AveragingStage.RUNNING_ALLREDUCE, done=lambda: False)
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4)[0] is not None


def test_a_peer_whose_groupmates_all_left_steps_alone_at_once_and_is_credited():
    # The others were Ctrl-C'd a step before their trigger and left (a clean leave erases the
    # progress record): nobody can join this round. Seen: the last peer waited out the averaging
    # timeout (27 s) for a group, holding its own Ctrl-C that long.
    control = SimpleNamespace(stage=AveragingStage.LOOKING_FOR_GROUP, done=lambda: False)
    reads = []
    opt = SimpleNamespace(averaging_timeout=30.0, matchmaking_time=0.2, _others_finished=lambda epoch: False,
                          _nobody_else=lambda: reads.append(1) or len(reads) >= 2)
    started = time.monotonic()
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4) == (None, False, True)
    assert 1.0 <= time.monotonic() - started < 5.0, "checked once a second after the matchmaking time"
    # While a group could still form (another peer reports progress), it waits on.
    opt.averaging_timeout, opt._nobody_else = 1.5, lambda: False
    assert SwarmOptimizer._wait_for_allreduce_start(opt, control, epoch=4) == (None, False, False)

    # The round is cancelled and the step taken alone counts as the swarm's, as a lone peer's does
    # (not as a round apart from a swarm of four).
    stats = {"weight_averaged": 0, "elements_missing": 0, "rounds_missing_a_slice": 0}
    opt, averager = _in_round(stats)
    opt._wait_for_allreduce_start = lambda control, epoch: (None, False, True)
    opt._others_finished = lambda epoch: False
    cancelled = []
    control = SimpleNamespace(done=lambda: bool(cancelled), cancelled=lambda: bool(cancelled),
                              cancel=lambda: cancelled.append(True), weight=16.0)
    opt.around_gradient_round(control, lambda: None)
    assert cancelled == [True]
    last = opt.rounds.last()
    assert (last.epoch, last.group_size, last.swarm_peers, last.credited) == (4, 1, 1, True)
    assert opt.ledger.samples == 16 and opt.ledger.round_counts(time.time()).rounds_apart == 0
    assert opt.catch_up.lost_epoch is None, "nobody else holds a state to download"


def test_nobody_else_reads_the_progress_records_on_a_real_dht():
    from crowdtrain.swarm.rounds import nobody_else

    dht = hivemind.DHT(start=True)
    try:
        me, other = dht.peer_id.to_bytes(), b"another peer"
        tracker = SimpleNamespace(dht=dht, training_progress_key="run_progress")
        assert nobody_else(tracker, me=me), "no records: nobody"

        def report(subkey, value):
            assert dht.store("run_progress", subkey=subkey, value=value, expiration_time=get_dht_time() + 60)

        report(b"mine", {"peer_id": me, "epoch": 3, "samples_accumulated": 8, "samples_per_second": 1.0,
                         "time": get_dht_time(), "client_mode": False})
        assert nobody_else(tracker, me=me), "only this peer's own record"
        report(b"theirs", {"peer_id": other, "epoch": 3, "samples_accumulated": 8, "samples_per_second": 1.0,
                           "time": get_dht_time(), "client_mode": False})
        assert not nobody_else(tracker, me=me)
        report(b"theirs", None)  # the tombstone hivemind's tracker stores as a peer leaves
        assert nobody_else(tracker, me=me)
        broken = SimpleNamespace(dht=SimpleNamespace(get=lambda *a, **k: (_ for _ in ()).throw(TimeoutError())),
                                 training_progress_key="run_progress")
        assert not nobody_else(broken, me=me), "a DHT that does not answer: in doubt, a group may still form"
    finally:
        dht.shutdown()
