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
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
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


def test_the_idle_meter_counts_the_machines_idle_core_seconds_from_proc_stat():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_suite_cpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # user nice system idle iowait irq softirq steal (guest, guest_nice: within user, not summed)
    before = bench.cpu_times("cpu  100 0 50 800 50 0 0 0 7 7\ncpu0 1 2 3\n")
    assert before == (850, 1000)
    meter = bench.IdleMeter(read=lambda: "cpu  250 0 100 1000 50 0 0 0 9 9\n")
    assert meter.sample(before, cores=2, wall_s=10.0) == (1050, 1400)
    # 200 of 400 jiffies idle over 10 s on 2 cores: 10 idle core-seconds.
    assert meter.idle_core_s == 10.0
