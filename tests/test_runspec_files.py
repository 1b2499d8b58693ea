"""The files the auxiliary peer writes for the web side (crowdtrain.runspec.files): what the
writer writes reads back as its schema, and a broken file reads as "nothing yet" with a problem
that names it, never an exception."""

import json

import pytest

from crowdtrain.runspec import files


def test_what_the_aux_peer_writes_reads_back_as_its_schema(tmp_path):
    info = files.RunInfo(run_id="r", fingerprint="ab12", swarm={"target_batch_size": 8}, task={"data": "x"},
                         initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/QmX"], coordinator_peer_id="QmX",
                         auth={"mode": "open"}, initial_model={"seed": 1, "digest": "d"})
    status = files.RunStatus(epoch=3, peers=[{"peer_id": "p", "loss": 2.0}], updated=1.0, samples_per_second=4.5,
                             total_epochs=10, target_batch_size=8, metrics_records_dropped={"time": 2})
    files.write_json_atomic(tmp_path / files.RUN_INFO, info.to_dict())
    files.write_json_atomic(tmp_path / files.STATUS, status.to_dict())
    assert files.read_run_info(tmp_path) == (info, None)
    assert files.read_status(tmp_path) == (status, None)
    assert not list(tmp_path.glob(".*.tmp")), "the temporary file is renamed into place"


def test_a_missing_file_is_nothing_yet_and_a_broken_one_names_the_field(tmp_path):
    assert files.read_run_info(tmp_path) == (None, None)
    assert files.read_status(tmp_path) == (files.RunStatus(), None)
    (tmp_path / files.STATUS).write_text(json.dumps({"epoch": "three", "peers": []}))
    status, problem = files.read_status(tmp_path)
    assert status == files.RunStatus() and "status.json.epoch must be an integer" in problem
    (tmp_path / files.STATUS).write_text(json.dumps({"epoch": 3, "surprise": 1}))
    assert "unknown fields ['surprise']" in files.read_status(tmp_path)[1]
    (tmp_path / files.RUN_INFO).write_text('{"run_id": "r", "swarm": ')
    info, problem = files.read_run_info(tmp_path)
    assert info is None and "run.json is not valid JSON" in problem
    (tmp_path / files.RUN_INFO).write_text(json.dumps({"run_id": "r", "initial_peers": "not a list"}))
    assert "run.json.initial_peers must be a list" in files.read_run_info(tmp_path)[1]


def test_a_torn_metrics_line_is_skipped_and_counted(tmp_path):
    files.append_metrics(tmp_path, [{"peer_id": "a", "epoch": 1}, {"peer_id": "b", "epoch": 1}])
    with open(tmp_path / files.METRICS, "a") as f:
        f.write('[1, 2]\n{"peer_id": "c", "ep')  # not an object; a line cut by a crash
    records, skipped = files.read_metrics(tmp_path / files.METRICS)
    assert [r["peer_id"] for r in records] == ["a", "b"] and skipped == 2


def test_known_peers_of_the_wrong_shape_are_left_out_and_an_unreadable_file_is_no_peers(tmp_path):
    path = tmp_path / files.KNOWN_PEERS
    path.write_text(json.dumps({"QmA": ["/ip4/1.2.3.4/tcp/1/p2p/QmA"], "QmB": "/ip4/x", "QmC": [1]}))
    peers, problem = files.read_known_peers(tmp_path)
    assert peers == {"QmA": ["/ip4/1.2.3.4/tcp/1/p2p/QmA"]} and "left out 2 entries" in problem
    path.write_bytes(b"\x00\xff garbage")
    peers, problem = files.read_known_peers(tmp_path)
    assert peers == {} and "known_peers.json is unreadable" in problem


def test_a_writer_that_breaks_the_schema_is_stopped_before_the_file_is_written(tmp_path):
    with pytest.raises(ValueError, match="RunStatus.metrics_records_dropped must be an object"):
        files.RunStatus(epoch=1, metrics_records_dropped=3).to_dict()


def test_a_file_written_whole_is_never_seen_empty_by_a_reader_in_another_process(tmp_path):
    """The auxiliary peer's pid file and status are read by the coordinator (and the tests) while
    they are rewritten: a reader must see the old text or the new, never an empty file."""
    import subprocess
    import sys

    path = tmp_path / "aux.pid"
    path.write_text("1")
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from crowdtrain.runspec import files\n"
        "for i in range(5000): files.write_text_atomic(Path(sys.argv[1]), str(100000 + i))"), str(path)])
    seen = set()
    try:
        while writer.poll() is None:
            seen.add(len(path.read_text()))
    finally:
        writer.wait(60)
    assert writer.returncode == 0
    assert seen <= {1, 6}, f"a reader saw a file of lengths {sorted(seen)}"
