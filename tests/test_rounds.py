"""What sync and DiLoCo mode share about rounds (crowdtrain.swarm.rounds), in one process."""

from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage

from crowdtrain.swarm import rounds
from crowdtrain.swarm.rounds import (LeftOutWatch, RoundLog, RoundSummary, StateOffer, Trainer, release_scheduled,
                                     tag_along)


def test_a_round_record_leaves_out_what_its_mode_does_not_measure():
    sync = RoundSummary(epoch=3, group_size=2, swarm_peers=3, weight=16, credited=True, done_unix=1.0)
    assert "seconds" not in sync.to_dict() and sync.to_dict()["done_unix"] == 1.0
    diloco = RoundSummary(epoch=3, group_size=3, swarm_peers=3, seconds=2.5, params_sha="ab")
    assert "done_unix" not in diloco.to_dict() and diloco.to_dict()["seconds"] == 2.5


def test_the_log_marks_only_its_latest_round():
    log = RoundLog()
    assert log.last() is None and not log.mark(1, diverged=True)
    log.append(RoundSummary(epoch=1, group_size=2, swarm_peers=2))
    log.append(RoundSummary(epoch=2, group_size=2, swarm_peers=2))
    assert not log.mark(1, diverged=True), "an older round is history"
    assert log.mark(2, diverged=True, healed=True) and log.last().healed and not log[0].diverged
    assert [r["epoch"] for r in log.to_dicts()] == [1, 2] and len(log) == 2


def test_state_offers_rank_a_demoted_state_half_an_epoch_down_and_a_client_offers_nothing():
    averager = SimpleNamespace(allow_state_sharing=False, state_sharing_priority=0.0)
    offer = StateOffer(averager, client_mode=False)
    offer.offer(7)
    assert averager.allow_state_sharing and averager.state_sharing_priority == 7
    offer.demote(7)
    assert averager.state_sharing_priority == 6.5, "below the group's epoch 7, above any epoch-6 state"
    offer.withdraw()
    assert not averager.allow_state_sharing
    client = SimpleNamespace()
    for act in (lambda o: o.offer(3), lambda o: o.demote(3), lambda o: o.withdraw()):
        act(StateOffer(client, client_mode=True))
    assert vars(client) == {}, "a client-mode peer serves nobody: hivemind refuses the setting"


class _Control:
    def __init__(self, *, triggered=False, fails=False):
        self.triggered, self.fails, self.weight, self.cancelled, self.allowed = triggered, fails, 5, False, False

    def allow_allreduce(self):
        self.allowed = True

    def result(self, timeout):
        if self.fails:
            raise TimeoutError("no group")
        return {}

    def done(self):
        return not self.fails

    def cancel(self):
        self.cancelled = True


def test_tagging_along_puts_zero_weight_in_an_untriggered_round_and_cancels_a_failed_one():
    control = _Control()
    tag_along(control, timeout=1.0)
    assert control.weight == 0 and control.allowed and not control.cancelled
    triggered = _Control(triggered=True)
    tag_along(triggered, timeout=1.0)
    assert triggered.weight == 5 and not triggered.allowed, "our samples are already in it"
    failed = _Control(fails=True)
    tag_along(failed, timeout=1.0)
    assert failed.cancelled


def test_the_left_out_watch_asks_only_after_a_matchmaking_time_only_while_looking_and_at_most_once_per_period(
        monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rounds.time, "monotonic", lambda: now[0])
    reads = []
    control = SimpleNamespace(stage=AveragingStage.LOOKING_FOR_GROUP)
    watch = LeftOutWatch(control, matchmaking_time=3.0, went_on=lambda: reads.append(now[0]) or True)
    now[0] = 102.9
    assert not watch.left_out() and reads == [], "the others may still be forming their group"
    now[0] = 103.0
    assert watch.left_out() and reads == [103.0]
    now[0] = 103.5
    assert not watch.left_out() and reads == [103.0], "one DHT read per period"
    now[0], control.stage = 104.0, AveragingStage.RUNNING_ALLREDUCE
    assert not watch.left_out() and reads == [103.0], "a peer in an all-reduce is in its round"
    now[0], control.stage = 107.0, AveragingStage.LOOKING_FOR_GROUP
    assert watch.left_out(every=5.0) and reads == [103.0, 107.0]
    now[0] = 111.0
    assert not watch.left_out() and reads == [103.0, 107.0], "the period the last read asked for"
    quiet = LeftOutWatch(control, matchmaking_time=0.0, went_on=lambda: False)
    assert not quiet.left_out(), "nobody reports the round done: still in it"


def test_a_scheduled_round_nobody_waits_on_is_cancelled_and_one_with_a_group_is_tagged_along(monkeypatch):
    tagged = []
    monkeypatch.setattr(rounds, "tag_along", lambda control, timeout: tagged.append((control, timeout)))

    def control(stage, *, triggered=False, done=False):
        c = SimpleNamespace(stage=stage, triggered=triggered, cancelled=False, done=lambda: done)
        c.cancel = lambda: setattr(c, "cancelled", True)
        return c

    release_scheduled(None, 5.0)
    for stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
        looking = control(stage)
        release_scheduled(looking, 5.0)
        assert looking.cancelled and not tagged
    for grouped in (control(AveragingStage.AWAITING_TRIGGER), control(AveragingStage.RUNNING_ALLREDUCE),
                    control(AveragingStage.LOOKING_FOR_GROUP, triggered=True)):
        release_scheduled(grouped, 5.0)
        assert not grouped.cancelled and tagged[-1] == (grouped, 5.0)
    finished = control(AveragingStage.FINISHED, done=True)
    release_scheduled(finished, 5.0)
    assert not finished.cancelled and len(tagged) == 3


@pytest.mark.timeout(120)
def test_both_modes_give_the_training_loop_one_interface():
    import dataclasses

    import hivemind
    import torch

    from crowdtrain.runspec.swarm import demo_swarm_config
    from crowdtrain.swarm.optimizer import build_optimizer

    dht = hivemind.DHT(start=True)
    try:
        for mode in ("sync", "diloco"):
            config = dataclasses.replace(demo_swarm_config(f"interface-{mode}"), mode=mode)
            opt = build_optimizer(dht, torch.nn.Linear(4, 4), config, batch_size=4)
            try:
                assert isinstance(opt, Trainer), f"{mode}: {type(opt).__name__} lacks part of the trainer interface"
                assert opt.local_epoch == 0 and opt.last_round() is None and len(opt.rounds) == 0
                assert opt.state_averager.upload_stats() is not None, "the loop reports its state uploads"
            finally:
                opt.shutdown()
    finally:
        dht.shutdown()
