"""A run's schedule on the coordinator's side and a volunteer's: the finished state in the API and
pages, live peers and the time to the end, a volunteer picking up an extension while it trains
(the real service over HTTP, in this process). A real-process run to the end of its time budget
is tests/test_own_data_run.py's (``check_the_run_ended``)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest
from fastapi.testclient import TestClient

from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.coordinator.status import time_to_the_end
from crowdtrain.optim import Schedule
from crowdtrain.runspec.schedule import RunSchedule
from crowdtrain.swarm.schedule_watch import RunFinished, ScheduleWatch, check_not_finished

URL = "http://coord.example.org:8000"
TINY = {"width": 64, "depth": 4, "heads": 4, "head_dim": 16, "ff_mult": 4, "text_len": 16, "text_vocab_size": 256,
        "text_pad_id": 0, "image_height": 8, "image_width": 8, "image_vocab_size": 64,
        "patterns": ["axial_row", "axial_col", "axial_row", "conv_like"], "share_ids": [0, 1, 2, 3],
        "conv_kernel": 5, "rotary": True, "reversible": False, "checkpointing": False, "image_loss_weight": 7.0,
        "dropout": 0.0}


def peer(name: str, *, epoch: int = 30, rate: float = 20.0, **extra) -> dict:
    return {"peer_id": f"Qm{name}", "user": name, "time": time.time(), "epoch": epoch, "loss": 2.0, "samples": 10,
            "samples_per_second": rate, "steps": 3, "client_mode": False, "last_round_peers": 2, "swarm_peers": 2,
            **extra}


class Run:
    """A run folder as the auxiliary peer leaves it, served by the real app."""

    def __init__(self, tmp_path):
        self.dir = tmp_path / "run"
        self.dir.mkdir()
        self.store = Store(f"sqlite:///{self.dir / 'coordinator.sqlite'}")
        self.key_path = tmp_path / "coordinator_key.pem"
        self.info(RunSchedule(total_epochs=60, warmup_epochs=2))
        self.status(epoch=30, peers=[peer("alice"), peer("bob")])

    def info(self, schedule: RunSchedule, **swarm) -> None:
        (self.dir / "run.json").write_text(json.dumps({
            "run_id": "r", "fingerprint": "ab12", "task": {"name": "dalle", "model": TINY, "data": "pattern"},
            "swarm": {"target_batch_size": 400, "total_epochs": schedule.total_epochs or 99, "warmup_epochs": 2,
                      "lr": 0.1, **swarm},
            "initial_peers": [], "schedule": schedule.to_dict()}))

    def status(self, **fields) -> None:
        (self.dir / "status.json").write_text(json.dumps({"updated": time.time(), "total_epochs": 60,
                                                          "target_batch_size": 400, **fields}))

    def client(self) -> TestClient:
        return TestClient(create_app(self.dir, store=self.store, public_url=URL,
                                     auth=AuthSettings(key_path=self.key_path)))


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.store.close()


def test_the_time_to_the_end_is_the_recent_epoch_pace_else_samples_against_the_target_batch(run):
    assert time_to_the_end(epoch=30, total=60, epochs_per_second=0.1, samples_per_second=1.0,
                           target_batch_size=400) == pytest.approx(300)
    assert time_to_the_end(epoch=30, total=60, epochs_per_second=None, samples_per_second=40.0,
                           target_batch_size=400) == pytest.approx(300)
    assert time_to_the_end(epoch=30, total=0, epochs_per_second=0.1, samples_per_second=1, target_batch_size=1) is None
    # Ten minutes of history at another pace (the run's slow start) do not move it: the aux peer's pace does.
    for i in range(60):
        run.store.record_swarm_point(epoch=i // 20, loss=3.0, active_peers=2, samples_per_second=1.0,
                                     at=time.time() - 600 + 10 * i)
    run.status(epoch=30, peers=[peer("alice"), peer("bob")], epochs_per_second=0.1)
    status = run.client().get("/api/status").json()
    assert status["eta_s"] == pytest.approx(300) and status["epochs_per_second"] == 0.1
    assert not status["finished"] and status["total_epochs"] == 60


def test_without_a_measured_pace_the_time_to_the_end_is_the_live_peers_samples_against_the_target_batch(run):
    run.status(epoch=30, peers=[peer("alice")], samples_per_second=20.0)
    status = run.client().get("/api/status").json()
    assert status["active_peers"] == 1 and [p["user"] for p in status["peers"]] == ["alice"]
    assert status["eta_s"] == pytest.approx(30 / (20 / 400))  # alice's 20 samples/s, a 400-sample epoch


def test_a_time_budget_being_sized_shows_no_total_and_the_budgets_end(run):
    started = time.time() - 60
    run.info(RunSchedule(total_epochs=None, warmup_epochs=2, time_budget_s=3600, started=started))
    run.status(epoch=3, peers=[peer("alice", epoch=3)], total_epochs=0)
    client = run.client()
    status = client.get("/api/status").json()
    assert status["total_epochs"] == 0 and 3530 < status["eta_s"] <= 3540 and status["schedule"]["time_budget_s"] == 3600
    html = client.get("/dashboard").text
    assert re.search(r'data-stat="total_epochs">\?<', html) and "sized to the 1 h 00 min time budget" in html


def test_a_finished_run_says_so_in_the_api_the_dashboard_and_the_join_page(run):
    client = run.client()
    assert 'id="run-finished" data-stat="finished" hidden' in client.get("/dashboard").text
    assert "has finished" not in client.get("/join").text
    finished_at = time.time() - 120
    run.info(RunSchedule(total_epochs=60, warmup_epochs=2, finished_at=finished_at, finished_epoch=60))
    run.status(epoch=60, peers=[], finished_at=finished_at)
    status = client.get("/api/status").json()
    assert status["finished"] is True and status["finished_at"] == finished_at and status["eta_s"] is None
    assert status["active_peers"] == 0
    joined = client.get("/api/join").json()
    assert joined["schedule"]["finished_at"] == finished_at and joined["schedule"]["finished_epoch"] == 60
    dashboard = client.get("/dashboard").text
    assert re.search(r'data-stat="eta">finished<', dashboard)
    notice = " ".join(dashboard.split('id="run-finished"')[1].split("</p>")[0].split())
    assert "hidden" not in notice.split(">")[0] and "last epoch (60 of 60) 2 min" in notice
    assert "This run has finished" in client.get("/").text
    join_page = " ".join(client.get("/join").text.split())
    assert "This run has finished" in join_page and "stops at once" in join_page
    js = client.get("/static/dashboard.js").text
    assert "status.finished" in js
    # A newcomer stops at once with the message, before any of its slow start-up.
    with pytest.raises(RunFinished, match=r"the run reached its last epoch \(60 of 60\): thank you; the final model "
                                          r"is at http://h:1/checkpoints"):
        check_not_finished(joined, "http://h:1")
    check_not_finished({"schedule": RunSchedule(total_epochs=60, warmup_epochs=2).to_dict()}, "http://h:1")


@pytest.fixture
def served(run):
    """The real app over HTTP on a free port, in this process (what a volunteer polls)."""
    import uvicorn

    from crowdtrain.launch import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(run.dir, store=run.store, public_url=URL,
                                                      auth=AuthSettings(key_path=run.key_path)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_a_volunteer_picks_up_an_extension_while_it_trains_and_refuses_other_changes(run, served, caplog):
    caplog.set_level(logging.INFO)
    joined = json.loads((run.dir / "run.json").read_text())
    schedule = Schedule(warmup_epochs=2, total_epochs=60)
    watch = ScheduleWatch(served, joined, schedule, poll_s=0.1, timeout_s=2.0, confirm_s=3.0)
    assert watch.poll_once() and schedule.total_epochs == 60
    watch.start()
    try:
        # The organizer restarts the coordinator with --swarm total_epochs=90: run.json says so.
        run.info(RunSchedule(total_epochs=90, warmup_epochs=2))
        deadline = time.monotonic() + 10
        while schedule.total_epochs != 90 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert schedule.total_epochs == 90 and "total_epochs 60 -> 90" in caplog.text
        # Anything else that changed is said once, loudly, and not applied; what peers may mix
        # (a timeout) is said quietly.
        run.info(RunSchedule(total_epochs=90, warmup_epochs=2), lr=0.5, matchmaking_time_s=9.0)
        time.sleep(0.6)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "swarm.lr: 0.1 -> 0.5" in errors[0] and "restart it" in errors[0]
        assert "matchmaking" not in errors[0] and caplog.text.count("swarm.matchmaking_time_s: null -> 9.0") == 1
        assert watch._joined["swarm"]["lr"] == 0.1
    finally:
        watch.stop()
    assert watch.final_epoch(None) == 90 and watch.final_epoch(70) == 70
    # At the total it knew, a peer asks again before leaving: an extension a moment ago is not missed.
    late = Schedule(warmup_epochs=2, total_epochs=60)
    assert not ScheduleWatch(served, joined, late, confirm_s=3.0).at_end(60) and late.total_epochs == 90
    assert not ScheduleWatch(served, joined, late).at_end(89)
    run.info(RunSchedule(total_epochs=90, warmup_epochs=2, finished_at=time.time(), finished_epoch=90))
    done = ScheduleWatch(served, joined, late, confirm_s=3.0)
    assert done.at_end(90) and done.finished_message(90) == (f"the run reached its last epoch (90 of 90): thank you; "
                                                             f"the final model is at {served}/checkpoints")
    # The final checkpoint: waited for (bounded), and found once the coordinator has it.
    run.status(epoch=90, last_checkpoint_epoch=85)
    assert not done.wait_for_final_checkpoint(90, timeout_s=0.5, every_s=0.1)
    run.status(epoch=90, last_checkpoint_epoch=90)
    assert done.wait_for_final_checkpoint(90, timeout_s=5, every_s=0.1)
    # A peer that heard of the total after it had stepped past it waits for the total's checkpoint
    # (the coordinator saves no later one), not out the minute.
    started = time.monotonic()
    assert done.wait_for_final_checkpoint(91, timeout_s=5, every_s=0.1) and time.monotonic() - started < 1


def test_while_a_time_budget_is_sized_each_new_epoch_asks_the_coordinator_at_once():
    # The coordinator sizes the total from the swarm's pace, and when the first epochs were slow it
    # can name the next epoch: a peer that only asked every 5 s stepped past it (7 of 6).
    started = time.time()
    coordinator = {"schedule": RunSchedule(time_budget_s=20, started=started).to_dict()}
    asked: list[float] = []

    def fetch():
        asked.append(time.monotonic())
        return json.loads(json.dumps(coordinator))

    schedule = Schedule(warmup_epochs=0, total_epochs=None)
    watch = ScheduleWatch("http://coordinator", coordinator, schedule, poll_s=60, fetch=fetch).start()

    def asked_within(count: int, seconds: float = 3.0) -> bool:
        deadline = time.monotonic() + seconds
        while len(asked) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(asked) >= count

    try:
        assert not watch.at_end(4) and asked_within(1)  # a new epoch: asked at once, not in 4-6 s
        assert not watch.at_end(4) and not asked_within(2, 0.5)  # the same epoch's other steps do not ask
        coordinator["schedule"] = RunSchedule(time_budget_s=20, started=started, total_epochs=6, sized_at=time.time(),
                                              sized_epoch=5).to_dict()
        assert not watch.at_end(5) and asked_within(2)
        assert schedule.total_epochs == 6 and watch.at_end(6)  # heard in epoch 5: it leaves at 6, not past it
        later = len(asked)
        assert not watch.at_end(4) and not asked_within(later + 1, 0.5), "once the total is known, epochs do not ask"
    finally:
        watch.stop()


def test_a_coordinator_that_is_down_leaves_the_volunteers_schedule_as_it_was():
    schedule = Schedule(warmup_epochs=2, total_epochs=60)
    watch = ScheduleWatch("http://127.0.0.1:9", {"schedule": RunSchedule(total_epochs=60, warmup_epochs=2).to_dict()},
                          schedule, timeout_s=0.5, confirm_s=1.0)
    started = time.monotonic()
    assert not watch.poll_once() and schedule.total_epochs == 60
    assert watch.at_end(60) and time.monotonic() - started < 5  # leaves at the total it has, after a bounded wait
    watch.apply(["not", "a", "run"])
    watch.apply({"schedule": {"total_epochs": "many"}})
    assert schedule.total_epochs == 60
