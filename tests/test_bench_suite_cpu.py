"""benchmarks/bench_suite_cpu.py, the measure of where the suite's time goes, on a suite of two tests:
a test's CPU includes what its processes spent, and a test that waits spends none."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_suite_cpu.py"

SUITE = '''
import subprocess, sys, time
import pytest

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                    "while time.process_time() - t < 0.6: pass"], check=True)

@pytest.mark.swarm
def test_waits():
    time.sleep(0.6)
'''


def test_a_tests_cpu_counts_its_processes_and_the_lane_its_swarm_tests(tmp_path):
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_two.py").write_text(SUITE)
    (tmp_path / "suite" / "pytest.ini").write_text("[pytest]\nmarkers =\n    swarm: a real-process swarm\n")
    out = tmp_path / "suite_cpu.json"
    done = subprocess.run([sys.executable, str(BENCH), "--workers", "0", "--tests", str(tmp_path / "suite"),
                           "--out", str(out), "--by-process"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    rows = {r["test"].split("::")[1]: r for r in summary["per_test"]}
    burner, waiter = rows["test_burns_in_a_child"], rows["test_waits"]
    assert burner["children_cpu_s"] >= 0.55 and not burner["swarm"], burner
    assert waiter["wall_s"] >= 0.6 and waiter["own_cpu_s"] + waiter["children_cpu_s"] < 0.3 and waiter["swarm"], waiter
    assert summary["swarm_lane_s"] == waiter["wall_s"]
    assert abs(summary["cpu_floor_s"] * summary["cores"] - summary["cpu_s"]) < 1e-6
    assert summary["cpu_s"] >= burner["children_cpu_s"] and summary["pytest_exit_code"] == 0
    assert "a floor of" in done.stdout and "test_two.py" in done.stdout, done.stdout
    assert 0 <= summary["idle_core_s"] and "idle CPU while the suite ran" in done.stdout, done.stdout
    # pytest itself ran throughout (the burner's child lived less than the meter's 2 s interval).
    assert summary["cpu_by_process_kind"]["test workers"] > 0, summary["cpu_by_process_kind"]
    assert "CPU by kind of process" in done.stdout, done.stdout


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_suite_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_idle_meter_counts_the_machines_idle_core_seconds_from_proc_stat():
    bench = _bench()
    # user nice system idle iowait irq softirq steal (guest, guest_nice: within user, not summed)
    before = bench.cpu_times("cpu  100 0 50 800 50 0 0 0 7 7\ncpu0 1 2 3\n")
    assert before == (850, 1000)
    meter = bench.IdleMeter(read=lambda: "cpu  250 0 100 1000 50 0 0 0 9 9\n")
    assert meter.sample(before, cores=2, wall_s=10.0) == (1050, 1400)
    # 200 of 400 jiffies idle over 10 s on 2 cores: 10 idle core-seconds.
    assert meter.idle_core_s == 10.0


def test_the_process_meter_counts_each_kind_from_the_first_sample_or_the_process_start():
    bench = _bench()
    volunteer = "/venv/bin/python -m crowdtrain.cli join http://127.0.0.1:8000 --batch-size 8"
    snapshots = iter([
        {(10, 5): (100.0, "/venv/bin/python -m pytest -q -n 2"), (11, 6): (7.0, "")},  # already running
        {(10, 5): (103.0, "/venv/bin/python -m pytest -q -n 2"), (11, 6): (7.5, ""),
         (20, 900): (2.0, volunteer), (21, 901): (1.0, volunteer)},  # a volunteer and its DHT fork
        {(10, 5): (104.0, "/venv/bin/python -m pytest -q -n 2"), (11, 6): (7.5, ""),
         (20, 900): (5.0, ""), (22, 950): (0.5, "p2pd -listen=/unix/tmp/x.sock"),  # the volunteer exited, unreaped
         (23, 960): (0.25, "/venv/bin/python -m crowdtrain.auxpeer /tmp/run")},  # the fork ended: its last figure
    ])
    meter = bench.ProcessMeter(read=lambda: next(snapshots))
    meter.sample()
    meter.sample()
    meter.sample()
    assert meter.by_kind() == {"volunteers": 6.0, "test workers": 4.0, "p2p daemons": 0.5, "kernel threads": 0.5,
                               "auxiliary peers": 0.25}
    assert bench.process_kind("/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == "test workers"
    assert bench.process_kind("/venv/bin/python -m crowdtrain.cli coordinator --run-id x") == "coordinators"


def test_the_process_meter_reads_this_process_from_proc():
    import os

    bench = _bench()
    found = {pid: v for (pid, _), v in bench.read_processes().items()}
    cpu_s, command = found[os.getpid()]
    # `python -m pytest`, or a pytest-xdist worker's `python -c ...`
    assert cpu_s > 0 and bench.process_kind(command) == "test workers", (cpu_s, command)
