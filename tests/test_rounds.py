"""What sync and DiLoCo mode share about rounds (crowdtrain.swarm.rounds), in one process."""

from types import SimpleNamespace

from crowdtrain.swarm.rounds import RoundLog, RoundSummary, StateOffer, tag_along


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
