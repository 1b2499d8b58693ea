"""The coordinator on a real PostgreSQL (`--db postgresql://...`), as docs/dashboard.md promises: a run's
rows go there, and a restart of the coordinator loses none of them. The storage tests of
tests/test_coordinator_db.py run on both SQLite and PostgreSQL (the ``db_url`` fixture)."""

from __future__ import annotations

import signal
import time

import pytest

from crowdtrain.launch import get_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


# In the swarm lane: its auxiliary peer must keep up with the volunteers' rounds to checkpoint.
@pytest.mark.swarm
def test_a_coordinator_on_postgres_keeps_every_row_across_a_restart(postgres, swarm_factory):
    import psycopg

    url = postgres.new_database()
    swarm = swarm_factory(swarm={"target_batch_size": 96, "checkpoint_every_epochs": 2, "matchmaking_time_s": 2.0})
    extra = ["--db", url]
    swarm.start_coordinator(extra=extra)
    # The volunteers train until the auxiliary peer has checkpointed (it downloads the state from
    # them; on a busy machine that can come epochs after the first one due), then leave on Ctrl-C.
    for name in ("alice", "bob"):
        swarm.join(name, batch_size=4, max_epochs=1000)
    def checkpointed() -> bool:
        try:
            return bool(get_json(f"{swarm.url}/api/checkpoints")) and swarm.status()["epoch"] >= 6
        except OSError:  # a busy machine's slow answer: ask again
            return False

    deadline = time.monotonic() + 200
    while not checkpointed():
        assert time.monotonic() < deadline, swarm.log("coordinator")[-2000:] + (swarm.run_dir / "aux.log").read_text()[-3000:]
        assert all(swarm.procs[n].poll() is None for n in ("alice", "bob")), {n: swarm.log(n)[-2000:] for n in ("alice", "bob")}
        time.sleep(1)
    codes = swarm.interrupt_all(["alice", "bob"])
    assert codes == {"alice": 0, "bob": 0}, {n: swarm.log(n)[-3000:] for n in codes}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        board = get_json(f"{swarm.url}/api/leaderboard")
        checkpoints = get_json(f"{swarm.url}/api/checkpoints")
        if len(board) == 2 and all(row["samples"] > 0 for row in board) and checkpoints:
            break
        time.sleep(1)
    assert sorted(row["user"] for row in board) == ["alice", "bob"] and checkpoints, (board, checkpoints)
    history = get_json(f"{swarm.url}/api/history")
    assert history and not (swarm.run_dir / "coordinator.sqlite").exists()
    with psycopg.connect(url) as conn:  # the rows are in PostgreSQL
        assert conn.execute("SELECT count(*) FROM contributions").fetchone()[0] > 0
        assert conn.execute("SELECT count(*) FROM checkpoints WHERE NOT pruned").fetchone()[0] >= len(checkpoints)

    swarm.kill("coordinator", signal.SIGTERM)
    swarm.start_coordinator(extra=extra)
    def counted(rows):  # what was earned, not whether the user is active now
        return sorted((r["user"], r["samples"], r["compute_s"], r["epochs"]) for r in rows)

    assert counted(get_json(f"{swarm.url}/api/leaderboard")) == counted(board)
    names = {c["name"] for c in get_json(f"{swarm.url}/api/checkpoints")}
    assert {c["name"] for c in checkpoints} <= names
    after = get_json(f"{swarm.url}/api/history")
    kept = {(p["time"], p["epoch"]) for p in after}
    assert all((p["time"], p["epoch"]) in kept for p in history), "every point from before the restart"
