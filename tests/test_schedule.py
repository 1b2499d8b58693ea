"""The run's schedule as pure pieces: the mutable learning-rate schedule the optimizers read, the
time budget sized from the swarm's pace, the schedule a restarted coordinator starts with, and
which setting changes a restart refuses (no processes, no network)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from crowdtrain.coordinator.restart import compare_specs
from crowdtrain.coordinator.run import CoordinatorConfig, settle_with_stored_run
from crowdtrain.optim import Schedule, linear_warmup_decay, warmup_decay_at
from crowdtrain.runspec.schedule import (EpochRate, RunSchedule, ScheduleKeeper, parse_duration, read_schedule,
                                         schedule_at_start, size_total_epochs)
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm import metrics as swarm_metrics
from crowdtrain.swarm.optimizer import make_scheduler


# ---- the schedule the optimizers read ---------------------------------------------------------

def test_the_schedule_object_is_the_warmup_decay_and_an_extension_continues_from_the_current_epoch():
    schedule = Schedule(warmup_epochs=10, total_epochs=100)
    for e in (0, 5, 10, 50, 99, 100, 120):
        assert schedule.step_factor(e) == linear_warmup_decay(e, warmup_steps=10, total_steps=100)
        assert schedule.factor_at(e + 0.5) == warmup_decay_at(e + 0.5, warmup=10, total=100)
    assert schedule.factor_at(100) == 0.0 and schedule.finished(100) and not schedule.finished(99)
    # Extended at its end to 200: the rate at epoch 100 is the new line's, as if planned so from the start.
    assert schedule.update(warmup_epochs=10, total_epochs=200) and not schedule.finished(100)
    assert schedule.factor_at(100) == pytest.approx(1 - 90 / 190) and schedule.factor_at(200) == 0.0
    assert not schedule.update(warmup_epochs=10, total_epochs=200)  # the same: no change
    # A total not known yet (a time budget being sized): the warm-up, then the peak.
    sizing = Schedule(warmup_epochs=4, total_epochs=None)
    assert sizing.factor_at(2) == 0.5 and sizing.factor_at(40) == 1.0 and sizing.step_factor(1) == 0.5
    assert sizing.step_factor(400) == 1.0 and not sizing.finished(10**6)
    with pytest.raises(ValueError, match="warmup_epochs < total_epochs"):
        schedule.update(warmup_epochs=10, total_epochs=10)


def test_sync_modes_scheduler_and_dilocos_inner_rate_follow_a_total_moved_mid_run():
    """The frozen config says 20 epochs; the live schedule moves to 40 at epoch 10: the next
    scheduler step (hivemind's, keyed on the epoch) and the next inner step use the new total."""
    config = SwarmConfig(lr=1.0, warmup_epochs=0, total_epochs=20)
    schedule = Schedule.from_config(config)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
    scheduler = make_scheduler(optimizer, config, schedule)
    for _ in range(10):
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5)  # epoch 10 of 20
    schedule.update(warmup_epochs=0, total_epochs=40)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1 - 11 / 40)
    assert "lr_lambdas" in scheduler.state_dict()  # storable: no lock in the state

    from crowdtrain.swarm.diloco import DiLoCoOptimizer

    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trainer = SimpleNamespace(config=config, schedule=schedule, inner=inner, _progress_epoch=10,
                              tracker=SimpleNamespace(global_progress=SimpleNamespace(samples_accumulated=0)))
    DiLoCoOptimizer._set_inner_lr(trainer)
    assert inner.param_groups[0]["lr"] == pytest.approx(1 - 10 / 40)


# ---- a time budget ------------------------------------------------------------------------------

def test_durations_take_hours_and_minutes_and_refuse_a_bare_number():
    assert parse_duration("2h") == 7200 and parse_duration("90m") == 5400 and parse_duration("45min") == 2700
    assert parse_duration("1h30m") == 5400 and parse_duration("1.5h") == 5400 and parse_duration("2 hours") == 7200
    for bad in ("90", "two hours", "2h x", "0m"):
        with pytest.raises(ValueError, match="--time-budget"):
            parse_duration(bad)


def test_the_pace_counts_epoch_changes_not_time_before_the_first_and_falls_during_a_stall():
    rate = EpochRate(window_s=180)
    rate.observe(0.0, 5)  # the run was at epoch 5 when first seen: when it began is unknown
    rate.observe(100.0, 5)
    assert rate.rate(100.0) is None
    for t, e in ((110, 6), (120, 7), (130, 8), (140, 9)):
        rate.observe(t, e)
    assert rate.rate(141.0) == pytest.approx(0.1)  # 3 epochs in 30 s, not 4 in 141
    assert rate.rate(149.0) == pytest.approx(0.1)  # between changes it does not creep
    assert rate.rate(200.0) == pytest.approx(4 / 90)  # 60 s without a change: stalled, slower
    # Old changes leave the window, but a slow swarm keeps its last ones.
    rate.observe(1000.0, 10)
    assert rate.rate(1001.0) == pytest.approx(1 / 860)
    rate.observe(1010.0, 3)  # went back (restarted from an older state): measured afresh
    assert rate.rate(1011.0) is None


def test_a_time_budget_holds_the_peak_until_measured_then_fixes_the_total_once_and_finishes_at_it():
    state = RunSchedule(total_epochs=None, warmup_epochs=2, time_budget_s=3600)
    keeper = ScheduleKeeper(state)
    assert keeper.observe(0.0, epoch=0, training=False) == []  # nobody trains: the clock has not started
    assert "training started" in keeper.observe(10.0, epoch=0, training=True)[0] and state.started == 10.0
    t, epoch = 10.0, 0
    while t < 125.0:  # an epoch every 10 s; sizing waits min(2 min, budget / 10) = 2 min
        t += 5.0
        epoch += int(t) % 10 == 0
        assert keeper.observe(t, epoch=epoch, training=True) == [] and state.total_epochs is None
    t += 5.0
    epoch += 1
    changes = keeper.observe(t, epoch=epoch, training=True)
    remaining = 10.0 + 3600 - t
    assert state.total_epochs == epoch + round(remaining / 10) == size_total_epochs(
        epoch=epoch, remaining_s=remaining, epochs_per_s=0.1, warmup_epochs=2)
    assert "total_epochs = " in changes[0] and state.sized_rate == pytest.approx(0.1) and state.sized_epoch == epoch
    total = state.total_epochs
    keeper.observe(t + 500, epoch=epoch + 100, training=True)  # the swarm grew: the total stays
    assert state.total_epochs == total and not state.finished
    assert "finished" in keeper.observe(t + 600, epoch=total, training=False)[0]
    assert state.finished_epoch == total and state.finished_at == t + 600
    # A budget that runs out before any pace is measured ends the run where it is.
    short = RunSchedule(total_epochs=None, warmup_epochs=0, time_budget_s=60, started=0.0)
    ScheduleKeeper(short).observe(61.0, epoch=3, training=True)
    assert short.total_epochs == 4 and size_total_epochs(epoch=3, remaining_s=0, epochs_per_s=1, warmup_epochs=8) == 9


# ---- a restart ------------------------------------------------------------------------------------

def test_a_restart_keeps_the_stored_schedule_unless_told_and_an_extension_reopens_a_finished_run():
    kw = dict(total_epochs=20, warmup_epochs=2, explicit_total=False, explicit_warmup=False, now=10_000.0)
    fresh, notes = schedule_at_start(None, time_budget_s=None, **kw)
    assert (fresh.total_epochs, fresh.warmup_epochs, notes) == (20, 2, [])
    assert schedule_at_start(None, time_budget_s=600.0, **kw)[0].total_epochs is None  # sized later
    finished = RunSchedule(total_epochs=140, warmup_epochs=5, finished_at=9_000.0, finished_epoch=140)
    same, notes = schedule_at_start(finished, time_budget_s=None, **kw)  # the same command: nothing moves
    assert same == finished and notes == []
    extended, notes = schedule_at_start(finished, time_budget_s=None, **{**kw, "total_epochs": 200,
                                                                          "explicit_total": True})
    assert extended.total_epochs == 200 and not extended.finished and extended.warmup_epochs == 5
    assert any("140 -> 200" in n and "extending" in n for n in notes) and any("reopens" in n for n in notes)
    shorter, notes = schedule_at_start(RunSchedule(total_epochs=100, warmup_epochs=5), time_budget_s=None,
                                       reached_epoch=80, **{**kw, "total_epochs": 60, "explicit_total": True})
    assert shorter.total_epochs == 60 and any("shortening" in n for n in notes) and any("at once" in n for n in notes)
    # A new budget counts from when training started; a live run keeps its total until re-sized.
    sized = RunSchedule(total_epochs=300, warmup_epochs=5, time_budget_s=3600.0, started=5_000.0,
                        sized_at=5_200.0, sized_epoch=20, sized_rate=0.1)
    assert schedule_at_start(sized, time_budget_s=3600.0, **kw)[0] == sized
    longer, notes = schedule_at_start(sized, time_budget_s=7200.0, **kw)
    assert longer.sizing and longer.total_epochs == 300 and longer.started == 5_000.0 and "1h -> 2h" in notes[0]
    with pytest.raises(ValueError, match="counts from when training started"):
        schedule_at_start(sized, time_budget_s=1800.0, **kw)
    with pytest.raises(ValueError, match="give one of them"):
        schedule_at_start(sized, time_budget_s=7200.0, **{**kw, "explicit_total": True})
    with pytest.raises(ValueError, match="give one of them"):
        CoordinatorConfig(run_dir="x", swarm_overrides={"total_epochs": 9}, time_budget_s=60.0)
    # With a budget the stored total is a placeholder that must only be valid, whatever the warm-up.
    config = CoordinatorConfig(run_dir="x", swarm_preset="laptop", swarm_overrides={"warmup_epochs": 50},
                               time_budget_s=60.0)
    assert config.swarm_config().total_epochs == 51


def spec(**changes) -> dict:
    base = {"preset": "tiny", "task": {"name": "dalle", "model": {"width": 64, "depth": 4}, "data": "shards/"},
            "swarm": SwarmConfig(run_id="r", total_epochs=100, warmup_epochs=5).to_dict(),
            "text_tokenizer": {"sha256": "a" * 64, "path": "t.json"}, "assets": {}}
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            base[section] = {**base[section], name: value}
        else:
            base[key] = value
    return base


def test_a_restart_refuses_what_breaks_a_live_swarm_naming_the_flag_and_accepts_the_rest():
    old = spec()
    assert compare_specs(old, spec()).refused == [] and compare_specs(old, spec()).accepted == []
    # The schedule is an extension, not a change of the swarm: left to schedule_at_start.
    assert compare_specs(old, spec(swarm__total_epochs=500, swarm__warmup_epochs=9)).refused == []
    for changed, flag in ((spec(preset="demo"), "--preset"),
                          (spec(task={**old["task"], "model": {"width": 128, "depth": 4}}), "--model width: 64 -> 128"),
                          (spec(swarm__lr=0.1), "--swarm lr: 0.0025 -> 0.1"),
                          (spec(swarm__target_batch_size=512), "--swarm target_batch_size: 4096 -> 512"),
                          (spec(swarm__mode="diloco"), "--swarm mode: sync -> diloco"),
                          (spec(swarm__aggregation="centered_clip"), "--swarm aggregation"),
                          (spec(swarm__run_id="other"), "--run-id: r -> other"),
                          (spec(text_tokenizer={"sha256": "b" * 64, "path": "mine.json"}), "--text-tokenizer")):
        refused = compare_specs(old, changed).refused
        assert len(refused) == 1 and refused[0].startswith(flag), (flag, refused)
    accepted = compare_specs(old, spec(swarm__matchmaking_time_s=9.0, swarm__checkpoint_every_epochs=3,
                                       task={**old["task"], "data": "more_shards/"}))
    assert accepted.refused == [] and len(accepted.accepted) == 3
    assert any("--swarm matchmaking_time_s: 5.0 -> 9.0" in a for a in accepted.accepted)
    assert any("--data: shards/ -> more_shards/" in a for a in accepted.accepted)


def test_image_tokenizers_are_compared_by_content_not_by_path(tmp_path):
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    a.write_bytes(b"codes")
    b.write_bytes(b"codes")
    c.write_bytes(b"other codes")
    old = spec(assets={"image_tokenizer.safetensors": str(a)})
    assert compare_specs(old, spec(assets={"image_tokenizer.safetensors": str(b)})).refused == []
    assert compare_specs(old, spec(assets={"image_tokenizer.safetensors": str(c)})).refused[0].startswith(
        "--image-tokenizer")


def test_a_restarted_coordinator_refuses_a_new_model_once_the_run_trained_and_extends_its_schedule(tmp_path, caplog):
    run_dir = tmp_path / "run"
    stored = spec(checkpoint_dir=str(run_dir / "checkpoints"))
    run_dir.mkdir()
    (run_dir / "coordinator.json").write_text(json.dumps(stored))
    (run_dir / "schedule.json").write_text(json.dumps(RunSchedule(total_epochs=100, warmup_epochs=5,
                                                                  finished_at=1.0, finished_epoch=100).to_dict()))
    # This start's spec, as build_spec makes it from --swarm total_epochs=150 (and a wider model).
    longer = spec(checkpoint_dir=stored["checkpoint_dir"], swarm__total_epochs=150)
    wider = {**longer, "task": {**stored["task"], "model": {"width": 128, "depth": 4}}}
    config = CoordinatorConfig(run_id="r", run_dir=str(run_dir), swarm_overrides={"total_epochs": 150})
    # Not trained yet (no checkpoint, no metrics): a start that failed may be fixed; the change is logged.
    with caplog.at_level(logging.WARNING):
        schedule = settle_with_stored_run(run_dir, config, json.loads(json.dumps(wider)))
    assert "--model width: 64 -> 128" in caplog.text and "(accepted: the run has not trained yet)" in caplog.text
    assert schedule.total_epochs == 150 and not schedule.finished
    (run_dir / "checkpoints" / "step-0000100").mkdir(parents=True)  # now it has trained
    with pytest.raises(ValueError, match=r"--model width: 64 -> 128.*\n.*another --run-id"):
        settle_with_stored_run(run_dir, config, json.loads(json.dumps(wider)))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        new_spec = json.loads(json.dumps(longer))
        schedule = settle_with_stored_run(run_dir, config, new_spec)
    assert schedule.total_epochs == 150 and not schedule.finished and new_spec["swarm"]["total_epochs"] == 150
    assert "total_epochs: 100 -> 150" in caplog.text and "reopens" in caplog.text
    # A start without a total keeps the stored schedule, whatever the preset says.
    from crowdtrain.runspec.schedule import write_schedule

    write_schedule(run_dir, RunSchedule(total_epochs=100, warmup_epochs=5, finished_at=1.0, finished_epoch=100))
    keep = spec(checkpoint_dir=stored["checkpoint_dir"], swarm__total_epochs=1000)
    schedule = settle_with_stored_run(run_dir, CoordinatorConfig(run_id="r", run_dir=str(run_dir)), keep)
    assert schedule.total_epochs == 100 and schedule.finished and keep["swarm"]["total_epochs"] == 100
    assert read_schedule(run_dir)[1] is None


# ---- peers that leave ---------------------------------------------------------------------------

def test_a_peer_that_said_it_is_leaving_counts_as_gone_at_once_and_no_other_peer_can_say_it_for_it(tmp_path):
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPrivateKey

    from crowdtrain.runspec.tokens import peer_id_of_key
    from crowdtrain.swarm.auth import load_identity

    run_id, now = "r", 1.7e9
    names = ("alice", "bob", "eve")
    identity = {n: load_identity(tmp_path / f"{n}.key") for n in names}
    signer = {n: RSASignatureValidator(RSAPrivateKey()) for n in names}
    peer_id = {n: peer_id_of_key(identity[n].get_public_key().to_bytes()) for n in names}

    def stored(name: str, t: float, *, as_peer: str | None = None) -> swarm_metrics.StoredRecord:
        who = as_peer or name
        value = {"peer_id": peer_id[who], "epoch": 7, "samples": 64, "samples_per_second": 10.0, "loss": 3.0,
                 "steps": 4, "time": t, "client_mode": False, "last_round_peers": 2, "swarm_peers": 3,
                 "fingerprint": "f" * 16, "user": who, "maddrs": [],
                 **swarm_metrics.endorsement(identity[who], run_id, signer[who])}
        return swarm_metrics.StoredRecord(signer[name].local_public_key, value, t + 60)

    # bob said he is leaving; eve says it under her own key of a copy of alice's record.
    records = [stored("alice", now - 1), stored("bob", now - 2), stored("eve", now - 1, as_peer="alice")]
    leaving = {signer["bob"].local_public_key, signer["eve"].local_public_key}
    gone = swarm_metrics.leaving_peer_ids(records, leaving, run_id)
    assert gone == {peer_id["bob"]}
    kept, _ = swarm_metrics.screen(records[:2], run_id=run_id, now=now, user_of=lambda ids: {
        peer_id[n]: n for n in names})
    old = swarm_metrics.PeerMetrics.parse_obj({**records[0].value, "time": now - 61})
    recent, live = swarm_metrics.live_records(kept + [old], now=now, gone=gone)
    assert len(recent) == 2 and [r.user for r in live] == ["alice"]
    # The leaving notice is a record of its own under a key of its own: the metrics record keeps its
    # fields, which peers of every version check exactly.
    stored_values = []
    dht = SimpleNamespace(store=lambda **kw: stored_values.append(kw))
    swarm_metrics.publish_leaving(dht, run_id, signer["bob"], epoch=7)
    assert stored_values[0]["key"] == "r_leaving" and stored_values[0]["subkey"] == signer["bob"].local_public_key
    assert set(stored_values[0]["value"]) == {"time", "epoch"}
    assert "leaving" in swarm_metrics.RunSchema.__fields__
    assert set(swarm_metrics.PeerMetrics.__fields__) >= {"peer_id", "epoch"} and \
        "leaving" not in swarm_metrics.PeerMetrics.__fields__
