"""Generalization measured during a run: the auxiliary peer's validation loss at every checkpoint,
the best checkpoint kept besides the last N, the memorising warning, and how the web side shows
them (``/api/history``, ``/api/checkpoints``, ``/api/status``, the dashboard, /checkpoints).

In-process and fast: the checkpointer runs its real ``maybe_checkpoint`` against a stand-in for
the swarm's state averager (no DHT); the web side is the real app on the database it wrote.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from tests._data_helpers import make_stripes_shards, stripes_items
from crowdtrain.auxpeer import AuxPeer
from crowdtrain.checkpoint import (best_checkpoint, latest_checkpoint, list_checkpoints, load_checkpoint,
                                   prune_checkpoints, read_meta, save_checkpoint)
from crowdtrain.coordinator import pages
from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.service import AuthSettings, create_app
from crowdtrain.coordinator.status import run_status
from crowdtrain.data.image_tokenizer import load_image_tokenizer
from crowdtrain.data.shards import prepare_shards
from crowdtrain.data.tokenizers import SHAPES_TEXT_TOKENIZER, load_text_tokenizer
from crowdtrain.model.config import get_preset
from crowdtrain.model.transformer import DalleTransformer
from crowdtrain.runspec.validation import memorising, memorising_problem
from crowdtrain.train import validate
from crowdtrain.train.validate import HeldOutSet

pytestmark = pytest.mark.timeout(180)

CONFIG = get_preset("tiny", text_len=16, text_vocab_size=128, image_vocab_size=512)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """An organizer's own pictures (not the shapes): train, valid (9 rows) and heldout (5 rows) splits."""
    folder, vq = make_stripes_shards(tmp_path_factory.mktemp("stripes"), train=12, valid=9)
    prepare_shards(None, folder, load_image_tokenizer(vq), split="heldout", shard_size=20, progress=False,
                   items=(stripes_items(5, seed=2), 5))
    return folder


def text_tokenizer():
    return load_text_tokenizer(SHAPES_TEXT_TOKENIZER)


# ---- the rows, loaded once --------------------------------------------------------------------------

def test_the_held_out_set_measures_every_split_but_train_on_the_same_rows_each_time(shards, monkeypatch):
    loads = []
    real = validate.valid_rows
    monkeypatch.setattr(validate, "valid_rows", lambda *a, **kw: loads.append(kw["split"]) or real(*a, **kw))
    held_out = HeldOutSet(str(shards), text_tokenizer=text_tokenizer(), model_config=CONFIG, max_rows=7)
    torch.manual_seed(0)
    model = DalleTransformer(CONFIG)
    losses, rows = held_out.losses(model)
    assert set(losses) == {"valid", "heldout"} and rows == {"valid": 7, "heldout": 5}  # bounded by max_rows
    assert losses == held_out.losses(model)[0]  # the same rows: the same figure
    assert loads == ["valid", "heldout"]  # read once, reused at every later checkpoint
    # The figure is the model's mean loss on exactly those rows.
    assert losses["heldout"] == pytest.approx(validate.valid_loss(model, held_out.rows["heldout"]))


def test_data_that_cannot_be_read_gives_no_loss_one_warning_and_no_error(caplog):
    held_out = HeldOutSet("http://127.0.0.1:9/shards", text_tokenizer=text_tokenizer(), model_config=CONFIG)
    model = DalleTransformer(CONFIG)
    with caplog.at_level(logging.DEBUG, logger="crowdtrain.train.validate"):
        for _ in range(5):  # five checkpoints: tried three times, then given up
            assert held_out.losses(model) == ({}, {})
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "cannot read the split list" in warnings[0].getMessage()
    assert "gave up" in warnings[1].getMessage() and held_out.failures == {"the split list": 3}


def test_a_split_that_fails_is_left_out_and_the_others_are_measured(shards, tmp_path):
    broken = tmp_path / "shards"
    broken.mkdir()
    for f in shards.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    for f in broken.glob("heldout-*.parquet"):
        f.write_bytes(b"not a parquet file")
    held_out = HeldOutSet(str(broken), text_tokenizer=text_tokenizer(), model_config=CONFIG)
    losses, rows = held_out.losses(DalleTransformer(CONFIG))
    assert set(losses) == {"valid"} and rows == {"valid": 9}


# ---- the checkpointer ------------------------------------------------------------------------------------

class FakeAverager:
    """What maybe_checkpoint uses of the swarm's state averager: each download puts the next
    scripted state into the model and moves to its epoch."""

    def __init__(self, model, states):
        self.model, self.states = model, list(states)
        self.local_epoch = 0
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.allow_state_sharing, self.state_sharing_priority = False, 0.0
        self.states_loaded = SimpleNamespace(value=0)

    def load_state_from_peers(self, timeout=None):
        self.model.load_state_dict(self.states.pop(0))
        self.local_epoch += 1
        self.states_loaded.value += 1


def trained_state(held_out: HeldOutSet) -> dict:
    """A model that has learnt the valid rows: its validation loss is far below an untrained one's."""
    torch.manual_seed(1)
    model = DalleTransformer(CONFIG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = held_out.load()["valid"]
    for _ in range(30):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    return model.state_dict()


def random_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return DalleTransformer(CONFIG).state_dict()


def checkpointer(run_dir, shards, *, states, keep: int = 1) -> AuxPeer:
    """The coordinator's auxiliary peer, its checkpointing part (no DHT, no swarm)."""
    aux = AuxPeer.__new__(AuxPeer)
    aux.run_dir, aux.checkpoint_dir, aux.keep = run_dir, run_dir / "checkpoints", keep
    aux.spec = {"task": {"name": "dalle", "model": CONFIG.to_dict(), "data": str(shards)},
                "text_tokenizer": {"path": str(SHAPES_TEXT_TOKENIZER)}, "samples_every_checkpoints": 0,
                "valid_rows": 512}
    aux.swarm = SimpleNamespace(checkpoint_every_epochs=1, load_state_timeout_s=5.0, to_dict=lambda: {})
    aux.model_config = CONFIG
    aux.model = DalleTransformer(CONFIG)
    aux.averager = FakeAverager(aux.model, states)
    aux.store = Store(f"sqlite:///{run_dir / 'coordinator.sqlite'}")
    aux.last_checkpoint_epoch, aux.checkpoints_written, aux.samples_possible = 0, 0, False
    aux.state_trail, aux._logged = 0, set()
    aux.held_out = aux._held_out_set()
    return aux


def peers(loss: float, epoch: int) -> list:
    return [SimpleNamespace(epoch=epoch, loss=loss, samples_per_second=10.0)]


def test_the_checkpointer_records_validation_keeps_the_best_and_the_web_side_shows_it(shards, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "task": {"data": str(shards)}}))
    probe = HeldOutSet(str(shards), text_tokenizer=text_tokenizer(), model_config=CONFIG)
    # Epoch 2 learns the held-out rows (the best); 1, 3, 4, 5 are untrained, far worse. The peers'
    # training loss falls all along: the run memorises from epoch 3 on.
    states = [random_state(10), trained_state(probe), random_state(11), random_state(12), random_state(13)]
    aux = checkpointer(run_dir, shards, states=states, keep=1)
    train_losses = [3.0, 2.5, 2.0, 1.5, 1.0]
    for epoch, train in enumerate(train_losses, start=1):
        aux.maybe_checkpoint(peers(train, epoch))
        assert aux.last_checkpoint_epoch == epoch

    # Every checkpoint's metadata carries both losses; the best is kept besides the newest one.
    kept = [p.name for p in list_checkpoints(aux.checkpoint_dir)]
    assert kept == ["step-0000002", "step-0000005"]
    assert best_checkpoint(aux.checkpoint_dir).name == "step-0000002"
    assert latest_checkpoint(aux.checkpoint_dir).name == "step-0000005"  # resuming takes the newest, not the best
    meta = read_meta(aux.checkpoint_dir / "step-0000002")
    assert meta["loss"] == 2.5 and set(meta["valid_loss"]) == {"valid", "heldout"}
    assert meta["valid_rows"] == {"valid": 9, "heldout": 5}
    assert meta["valid_loss"]["valid"] < 0.8 * read_meta(aux.checkpoint_dir / "step-0000005")["valid_loss"]["valid"]
    model, _ = load_checkpoint(aux.checkpoint_dir / "step-0000002")  # the figure is the saved model's
    assert validate.valid_loss(model, probe.load()["valid"]) == pytest.approx(meta["valid_loss"]["valid"], rel=1e-5)

    # The database: every checkpoint with its losses, the best marked; a history point at each.
    rows = aux.store.checkpoints(include_pruned=True)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5] and [r["loss"] for r in rows] == train_losses
    assert [r["best"] for r in rows] == [False, True, False, False, False]
    assert all(set(r["valid_loss"]) == {"valid", "heldout"} for r in rows)
    assert [r["pruned"] for r in rows] == [True, False, True, True, False]
    points = [p for p in aux.store.swarm_history() if p["valid_loss"]]
    assert [p["epoch"] for p in points] == [1, 2, 3, 4, 5] and [p["loss"] for p in points] == train_losses
    assert [p["valid_loss"] for p in points] == [r["valid_loss"] for r in rows]

    # The web side reads it all without torch: the API, the warning, the pages.
    client = TestClient(create_app(run_dir, store=aux.store, public_url="http://x:8000",
                                   auth=AuthSettings(key_path=tmp_path / "key.pem")))
    api = client.get("/api/checkpoints").json()
    assert [(c["name"], c["best"]) for c in api] == [("step-0000002", True), ("step-0000005", False)]
    assert api[0]["valid_loss"] == rows[1]["valid_loss"] and api[0]["valid_rows"] == {"valid": 9, "heldout": 5}
    history = client.get("/api/history").json()
    assert [p["valid_loss"] for p in history if p["valid_loss"]] == [r["valid_loss"] for r in rows]
    problems = client.get("/api/status").json()["problems"]
    assert len(problems) == 1 and "memorising" in problems[0] and "total_epochs" in problems[0]
    assert "--preset" in problems[0] and "more data" in problems[0]
    dashboard = client.get("/dashboard").text
    assert 'id="problems"' in dashboard and "the model is memorising" in dashboard
    assert "Validation loss at checkpoints" in dashboard and f"{rows[1]['valid_loss']['valid']:.4f}" in dashboard
    page = client.get("/checkpoints").text
    assert "valid loss" in page and "heldout loss" in page and '<span class="badge best">best</span>' in page
    aux.store.close()


def test_a_run_on_generated_data_checkpoints_without_validation(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    aux = checkpointer(run_dir, "pattern", states=[random_state(1)])
    assert aux.held_out is None
    aux.maybe_checkpoint(peers(3.0, 1))
    meta = read_meta(aux.checkpoint_dir / "step-0000001")
    assert "valid_loss" not in meta and meta["loss"] == 3.0
    row = aux.store.checkpoints()[0]
    assert row["valid_loss"] is None and row["best"] is False
    assert all(p["valid_loss"] is None for p in aux.store.swarm_history())


def test_the_checkpointer_survives_a_failing_evaluation(shards, tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    aux = checkpointer(run_dir, shards, states=[random_state(1), random_state(2)])

    def broken(model):
        raise RuntimeError("out of memory")

    aux.held_out.losses = broken
    with caplog.at_level(logging.WARNING, logger="crowdtrain.auxpeer"):
        aux.maybe_checkpoint(peers(3.0, 1))
        aux.maybe_checkpoint(peers(2.0, 2))
    assert [p.name for p in list_checkpoints(aux.checkpoint_dir)] == ["step-0000002"]
    assert [r.getMessage()[:30] for r in caplog.records] == ["held-out evaluation failed (lo"]  # logged once


class TrailingAverager:
    """A swarm whose served state trails its reported epoch by one (the volunteers' update in
    flight), whose donors may serve nothing; counts its states as hivemind's downloader does."""

    def __init__(self, model):
        self.model, self.local_epoch, self.swarm_epoch, self.serving = model, 0, 0, True
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.allow_state_sharing, self.state_sharing_priority = False, 0.0
        self.states_loaded, self.downloads = SimpleNamespace(value=0), 0

    def load_state_from_peers(self, timeout=None):
        self.downloads += 1
        if self.serving:
            self.local_epoch = self.swarm_epoch - 1
            self.states_loaded.value += 1


def test_the_checkpointer_keeps_its_cadence_in_served_epochs_and_says_when_nobody_serves(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    aux = checkpointer(run_dir, "pattern", states=[])
    aux.swarm.checkpoint_every_epochs = 2
    aux.averager = swarm = TrailingAverager(aux.model)
    swarm.serving = False
    with caplog.at_level(logging.WARNING, logger="crowdtrain.auxpeer"):
        for epoch in (2, 3):
            swarm.swarm_epoch = epoch
            aux.maybe_checkpoint(peers(3.0, epoch))
    assert aux.last_checkpoint_epoch == 0 and swarm.downloads == 2
    assert [r.getMessage()[:48] for r in caplog.records] == ["no peer served its state for a checkpoint while "]
    swarm.serving = True
    for epoch in range(3, 15):
        swarm.swarm_epoch = epoch
        aux.maybe_checkpoint(peers(3.0, epoch))
    # Every 2 epochs of the states served (not at every epoch, as counting the swarm's epochs did),
    # with one download each once the trail is known.
    assert [r["epoch"] for r in aux.store.checkpoints(include_pruned=True)] == [2, 4, 6, 8, 10, 12]
    assert swarm.downloads == 2 + 6
    # A finished run's last checkpoint (forced) is written once, however often it is asked for
    # while the volunteers' final update holds the last epoch's state back.
    for _ in range(3):
        aux.maybe_checkpoint(peers(3.0, 14), force=True)
    assert [r["epoch"] for r in aux.store.checkpoints(include_pruned=True)] == [2, 4, 6, 8, 10, 12, 13]
    assert aux.checkpoints_written == 7, "the same epoch saved (and evaluated) again"
    aux.store.close()


class BlockingAverager(TrailingAverager):
    """A download that fails (a donor left mid-download), one that succeeds, then one that hangs
    until released (a large state over a slow link)."""

    def __init__(self, model):
        super().__init__(model)
        self.release, self.hanging = threading.Event(), threading.Event()

    def load_state_from_peers(self, timeout=None):
        if self.downloads == 0:
            self.downloads += 1
            raise TimeoutError("the donor left")
        if self.downloads >= 2:
            self.hanging.set()
            assert self.release.wait(60), "the test never released the download"
        super().load_state_from_peers(timeout)


def test_the_auxiliary_peer_collects_while_a_checkpoint_downloads_and_finishes_it_when_stopped(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    aux = checkpointer(run_dir, "pattern", states=[])
    aux.averager = swarm = BlockingAverager(aux.model)
    swarm.swarm_epoch = 3
    aux.stop, aux.schedule = threading.Event(), SimpleNamespace(state=SimpleNamespace(finished=False))
    # collect() reads the DHT (tests/test_hostile_records.py runs it for real); here it counts.
    collections, shut_down = [], []
    aux.collect = lambda: collections.append(time.monotonic()) or peers(3.0, swarm.swarm_epoch)
    aux.announce, aux.shutdown = lambda: None, lambda: shut_down.append(aux.last_checkpoint_epoch)
    evaluate = aux.evaluate_held_out
    faults = [OSError("No space left on device")]

    def evaluate_once_failing():  # a fault past the download: that turn fails, the next goes on
        if faults:
            raise faults.pop()
        return evaluate()

    aux.evaluate_held_out = evaluate_once_failing
    loop = threading.Thread(target=aux.run, kwargs={"refresh_s": 0.05}, daemon=True)
    loop.start()
    try:
        assert swarm.hanging.wait(30), "the failed download, or the failed checkpoint, was not retried"
        hanging_since = len(collections)
        deadline = time.monotonic() + 30
        while len(collections) < hanging_since + 5:
            assert time.monotonic() < deadline, "collecting stopped while a checkpoint downloads"
            time.sleep(0.05)
        aux.stop.set()
        time.sleep(0.2)
        assert shut_down == [], "stopped with a checkpoint under way"
    finally:
        aux.stop.set()
        swarm.release.set()
        loop.join(30)
    assert not loop.is_alive()
    assert shut_down == [2] and [c["epoch"] for c in aux.store.checkpoints()] == [2], \
        "the checkpoint under way is written, then the peer stops"
    assert aux.store.counters().get("aux_peer_errors") == 1, "the failed checkpoint is counted"
    aux.store.close()


# ---- the rules -----------------------------------------------------------------------------------------

def ckpt(epoch, train, valid, **more):
    return {"name": f"step-{epoch:07d}", "epoch": epoch, "loss": train, "valid_loss": {"valid": valid, **more}}


def test_prune_keeps_the_best_by_validation_loss_besides_the_newest(tmp_path):
    model = DalleTransformer(CONFIG)
    for step, valid in ((1, 4.0), (2, 3.0), (3, 3.5), (4, 3.2), (5, None)):
        save_checkpoint(tmp_path / f"step-{step:07d}", model, step=step,
                        valid_loss={"valid": valid, "heldout": 1.0} if valid else None)
    deleted = prune_checkpoints(tmp_path, keep=2, keep_best=True)
    assert sorted(p.name for p in deleted) == ["step-0000001", "step-0000003"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000002", "step-0000004", "step-0000005"]
    assert latest_checkpoint(tmp_path).name == "step-0000005"
    # Without the flag, as before: only the newest.
    prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000005"]
    # An older checkpoint's config without the field still loads.
    _, meta = load_checkpoint(tmp_path / "step-0000005")
    assert meta["step"] == 5 and "valid_loss" not in meta


def test_the_memorising_rule():
    falling = [ckpt(1, 3.0, 3.2), ckpt(2, 2.5, 2.8), ckpt(3, 2.0, 2.6)]
    assert memorising(falling) is None  # both falling: learning
    rising = falling + [ckpt(4, 1.8, 2.8), ckpt(5, 1.6, 2.9), ckpt(6, 1.4, 3.0)]
    found = memorising(rising)
    assert found["best_epoch"] == 3 and found["valid_loss"] == 3.0 and found["train_loss"] == 1.4
    assert "memorising" in memorising_problem(rising) and "step-0000003" in memorising_problem(rising)
    # Two checkpoints above the best are not yet enough; nor is a rise under 5%.
    assert memorising(rising[:-1]) is None
    assert memorising(falling + [ckpt(4, 1.8, 2.7), ckpt(5, 1.6, 2.7), ckpt(6, 1.4, 2.7)]) is None
    # The training loss rose too: not memorising (the run diverges; another problem).
    assert memorising(falling + [ckpt(4, 2.1, 2.8), ckpt(5, 2.2, 2.9), ckpt(6, 2.3, 3.0)]) is None
    # Checkpoints without a validation loss do not count; only valid, not heldout, ranks them.
    gaps = rising[:3] + [{"epoch": 9, "loss": 1.0, "valid_loss": None}] + rising[3:]
    assert memorising(gaps)["best_epoch"] == 3
    assert memorising([ckpt(e, 3 - 0.1 * e, 2.0, heldout=9.0 - e) for e in range(1, 8)]) is None


def test_history_downsampling_keeps_every_validation_point():
    points = [{"time": float(i), "epoch": i // 10, "loss": 5.0, "active_peers": 2, "samples_per_second": 1.0,
               "valid_loss": {"valid": 3.0 + i} if i % 100 == 50 else None} for i in range(1000)]
    out = pages.downsample(points, 50)
    assert len(out) <= 50 + 10
    assert [p["valid_loss"]["valid"] for p in out if p["valid_loss"]] == [3.0 + i for i in range(50, 1000, 100)]
    assert [p["time"] for p in out] == sorted(p["time"] for p in out)
    gaps = pages.mark_gaps([points[0], {**points[1], "time": 1000.0}])
    assert gaps[1]["gap"] and gaps[1]["valid_loss"] is None


def test_the_new_columns_are_added_to_an_older_database(db_url):
    """A database from before validation losses (SQLite or PostgreSQL) opens and keeps its rows."""
    from sqlalchemy import text

    store = Store(db_url)
    with store.engine.begin() as conn:
        for column in ("valid_loss", "valid_rows", "best"):
            conn.execute(text(f"ALTER TABLE checkpoints DROP COLUMN {column}"))
        conn.execute(text("ALTER TABLE swarm_points DROP COLUMN valid_loss"))
        conn.execute(text("INSERT INTO checkpoints (name, epoch, loss, time, files, pruned) VALUES "
                          "('step-0000004', 4, 2.0, 0, '[]', FALSE)"))
        conn.execute(text("INSERT INTO swarm_points (time, epoch, loss, active_peers, samples_per_second) "
                          "VALUES (1, 4, 2.0, 1, 5)"))
    store.close()
    store = Store(db_url)
    assert store.checkpoints() == [{"name": "step-0000004", "epoch": 4, "loss": 2.0, "time": 0.0, "files": [],
                                    "pruned": False, "valid_loss": None, "valid_rows": None, "best": False}]
    assert store.swarm_history()[0]["valid_loss"] is None
    store.record_checkpoint(name="step-0000006", epoch=6, loss=1.5, files=[], valid_loss={"valid": 2.5})
    store.mark_best("step-0000006")
    assert [(c["valid_loss"], c["best"]) for c in store.checkpoints()] == [(None, False), ({"valid": 2.5}, True)]
    store.close()


def test_the_store_keeps_validation_losses_and_one_best(db_url):
    store = Store(db_url)
    now = time.time()
    for epoch, valid in ((2, 3.0), (4, 2.5)):
        store.record_checkpoint(name=f"step-{epoch:07d}", epoch=epoch, loss=2.0, files=[], at=now + epoch,
                                valid_loss={"valid": valid, "heldout": valid + 1}, valid_rows={"valid": 512})
        store.record_swarm_point(epoch=epoch, loss=2.0, active_peers=1, samples_per_second=3.0, at=now + epoch,
                                 valid_loss={"valid": valid})
    store.mark_best("step-0000002")
    store.mark_best("step-0000004")
    rows = store.checkpoints()
    assert [r["best"] for r in rows] == [False, True]
    assert rows[1]["valid_loss"] == {"valid": 2.5, "heldout": 3.5} and rows[1]["valid_rows"] == {"valid": 512}
    assert [p["valid_loss"] for p in store.swarm_history()] == [{"valid": 3.0}, {"valid": 2.5}]
    store.mark_best(None)
    assert not any(r["best"] for r in store.checkpoints())
    store.close()


def test_status_lists_the_memorising_problem_from_the_database(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'c.sqlite'}")
    for c in [ckpt(1, 3.0, 3.2), ckpt(2, 2.5, 2.8), ckpt(3, 2.0, 3.0), ckpt(4, 1.8, 3.05)]:
        store.record_checkpoint(name=c["name"], epoch=c["epoch"], loss=c["loss"], files=[],
                                valid_loss=c["valid_loss"])
    assert run_status(tmp_path, store)["problems"] == []  # two checkpoints above the best: not yet
    store.record_checkpoint(name="step-0000005", epoch=5, loss=1.5, files=[], valid_loss={"valid": 3.1})
    store.mark_pruned(["step-0000005"])  # pruned checkpoints still count: their losses are in the database
    problems = run_status(tmp_path, store)["problems"]
    assert len(problems) == 1 and "rose from its best 2.8000 at epoch 2" in problems[0]
    store.close()
