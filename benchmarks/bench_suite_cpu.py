"""Where the suite's time goes: each test's wall time and CPU (its own and its processes'), by
module, and the floor the CPU puts under the suite's wall time on this machine.

    python benchmarks/bench_suite_cpu.py [--workers 2] [--tests tests] [--out results/suite_cpu.json]

It runs the suite as ``make test`` does (pytest-xdist workers, the swarm lane) with this file as a
pytest plugin. A test's CPU is what its worker process spent during the test plus what the
processes it started and reaped spent (``RUSAGE_CHILDREN``): a volunteer, its DHT and averager
processes, its p2p daemon. A module-scoped fixture's processes count where they are reaped, at
the module's last test. Two figures bound the wall time:

- the CPU floor, all tests' CPU over the machine's cores: no order of the tests beats it;
- the swarm lane, the wall time of the tests marked ``swarm`` (they run one after another).

To make the suite faster, cut the larger of the two: CPU (fewer swarm runs, fewer epochs, fewer
peer processes) or the lane's wall time (shorter waits in its tests). A third figure says how far
the wall time is above the floor: the machine's idle CPU while the suite ran (``idle_core_s``,
from /proc/stat, in core-seconds), what both workers' tests spent waiting on rounds, restarts or
a browser at the same moments.

``--by-process`` also says which kinds of process spent the CPU (volunteers, their p2p daemons,
the coordinators' auxiliary peers, the test workers themselves...), from /proc every 2 s: what
to make cheaper when a swarm test's CPU is mostly start-up or protocol rather than its steps.
A process that lives less than the interval is missed there (its test's figure counts it); a
sample takes about 3 ms of CPU with a hundred processes running.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT_ENV = "CROWDTRAIN_SUITE_CPU_OUT"


def _cpu_s() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Plugin side (``-p bench_suite_cpu``): one JSON line per test, set-up and teardown included."""
    own0, children0 = _cpu_s()
    start = time.time()
    yield
    own1, children1 = _cpu_s()
    out = os.environ.get(OUT_ENV)
    if out:
        row = {"test": item.nodeid, "start": start, "wall_s": time.time() - start, "own_cpu_s": own1 - own0,
               "children_cpu_s": children1 - children0, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
               "swarm": item.get_closest_marker("swarm") is not None}
        with open(out, "a") as f:  # one short line per write: the workers' lines do not interleave
            f.write(json.dumps(row) + "\n")


def summarize(rows: list[dict], cores: int) -> dict:
    """Per module and overall: tests, wall time, CPU; the CPU floor and the swarm lane's wall time."""
    modules: dict[str, dict] = {}
    for r in rows:
        m = modules.setdefault(r["test"].split("::")[0], {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0})
        m["tests"] += 1
        m["wall_s"] += r["wall_s"]
        m["cpu_s"] += r["own_cpu_s"] + r["children_cpu_s"]
    cpu = sum(m["cpu_s"] for m in modules.values())
    span = (max(r["start"] + r["wall_s"] for r in rows) - min(r["start"] for r in rows)) if rows else 0.0
    return {"tests": len(rows), "cores": cores, "span_s": span, "cpu_s": cpu, "cpu_floor_s": cpu / cores,
            "swarm_lane_s": sum(r["wall_s"] for r in rows if r["swarm"]),
            "swarm_lane_cpu_s": sum(r["own_cpu_s"] + r["children_cpu_s"] for r in rows if r["swarm"]),
            "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1]["cpu_s"]))}


def table(summary: dict, top: int = 15) -> str:
    lines = [f"{'module':<44} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'CPU share':>9}"]
    for name, m in list(summary["modules"].items())[:top]:
        lines.append(f"{name:<44} {m['tests']:>5} {m['wall_s']:>8.1f} {m['cpu_s']:>8.1f} "
                     f"{m['cpu_s'] / max(summary['cpu_s'], 1e-9):>9.1%}")
    lines.append(f"{summary['tests']} tests in {summary['span_s']:.0f} s; CPU {summary['cpu_s']:.0f} s, a floor of "
                 f"{summary['cpu_floor_s']:.0f} s on {summary['cores']} cores; the swarm lane "
                 f"{summary['swarm_lane_s']:.0f} s of wall time ({summary['swarm_lane_cpu_s']:.0f} s of CPU)")
    return "\n".join(lines)


def cpu_times(stat: str) -> tuple[int, int]:
    """(idle, total) jiffies of all cores from /proc/stat's first line (idle counts iowait too)."""
    fields = [int(v) for v in stat.splitlines()[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    return fields[3] + fields[4], sum(fields)


class IdleMeter:
    """The machine's idle CPU, in core-seconds, between ``start()`` and ``stop()``."""

    def __init__(self, read=lambda: Path("/proc/stat").read_text(), every_s: float = 1.0):
        self.read, self.every_s = read, every_s
        self.idle_core_s, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-meter", daemon=True)

    def sample(self, before: tuple[int, int], cores: int, wall_s: float) -> tuple[int, int]:
        now = cpu_times(self.read())
        idle, total = now[0] - before[0], now[1] - before[1]
        if total > 0:
            self.idle_core_s += idle / total * cores * wall_s
        return now

    def _run(self) -> None:
        cores, last, t = os.cpu_count() or 1, cpu_times(self.read()), time.monotonic()
        while not self._stop.wait(self.every_s):
            now = time.monotonic()
            last, t = self.sample(last, cores, now - t), now

    def start(self) -> "IdleMeter":
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.idle_core_s


# (kind, what its command line holds): the first kind that matches wins. A volunteer's DHT and
# averager processes are forks of it, with its command line.
PROCESS_KINDS = (
    ("volunteers", ("crowdtrain.cli join", "crowdtrain join")),
    ("coordinators", ("crowdtrain.cli coordinator", "crowdtrain coordinator")),
    ("auxiliary peers", ("crowdtrain.auxpeer",)),
    ("p2p daemons", ("p2pd",)),
    ("notebook kernels", ("ipykernel",)),
    ("browsers", ("chrom", "playwright")),
    ("pip", ("-m pip", "bin/pip")),
    ("other crowdtrain commands", ("crowdtrain.cli", "bin/crowdtrain")),
    ("test workers", ("pytest", "exec(eval(")),  # pytest-xdist starts its workers with `python -c`
    ("this benchmark", ("bench_suite_cpu.py",)),
)


def process_kind(command: str) -> str:
    if not command:
        return "kernel threads"
    return next((kind for kind, marks in PROCESS_KINDS if any(m in command for m in marks)), "other")


def read_processes(proc: Path = Path("/proc")) -> dict[tuple[int, int], tuple[float, str]]:
    """Every process now: (pid, start time in ticks) -> (CPU seconds so far, command line)."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue  # it ended while being read
        found[(int(entry.name), int(fields[19]))] = ((int(fields[11]) + int(fields[12])) / tick, command)
    return found


class ProcessMeter:
    """CPU by kind of process (``PROCESS_KINDS``) between ``start()`` and ``stop()``: a process
    already running at the first sample counts from there, a later one from its start."""

    def __init__(self, read=read_processes, every_s: float = 2.0):
        self.read, self.every_s = read, every_s
        self.baseline: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], tuple[float, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-meter", daemon=True)

    def sample(self) -> None:
        first = not self.last
        for key, (cpu_s, command) in self.read().items():
            known = self.last.get(key)
            if known is None:
                self.baseline[key] = cpu_s if first else 0.0
            # An exited process not yet reaped (a zombie) reads with no command line: keep its own.
            self.last[key] = (cpu_s, command or (known[1] if known else ""))

    def by_kind(self) -> dict[str, float]:
        kinds: dict[str, float] = {}
        for key, (cpu_s, command) in self.last.items():
            kind = process_kind(command)
            kinds[kind] = kinds.get(kind, 0.0) + cpu_s - self.baseline[key]
        return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> "ProcessMeter":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.by_kind()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, as `make test` (0: one process)")
    parser.add_argument("--tests", default="tests", help="what pytest runs (a folder, a file or a node id)")
    parser.add_argument("--out", default=str(HERE / "results" / "suite_cpu.json"))
    parser.add_argument("--by-process", action="store_true",
                        help="also the CPU by kind of process (volunteers, p2p daemons, ...), sampled from /proc")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = out.with_suffix(".jsonl")
    lines.unlink(missing_ok=True)
    env = {**os.environ, OUT_ENV: str(lines),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "bench_suite_cpu", "-n", str(args.workers), args.tests]
    meter = IdleMeter().start()
    processes = ProcessMeter().start() if args.by_process else None
    code = subprocess.run(command, env=env, check=False).returncode
    idle_core_s = meter.stop()
    by_kind = processes.stop() if processes else None
    rows = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
    lines.unlink(missing_ok=True)
    summary = {**summarize(rows, os.cpu_count() or 1), "pytest_exit_code": code, "workers": args.workers,
               "idle_core_s": idle_core_s, "cpu_by_process_kind": by_kind, "per_test": rows}
    print(table(summary))
    print(f"the machine's idle CPU while the suite ran: {idle_core_s:.0f} core-seconds")
    if by_kind:
        print("CPU by kind of process (sampled every 2 s): "
              + ", ".join(f"{kind} {cpu_s:.0f} s" for kind, cpu_s in by_kind.items() if cpu_s >= 0.05))
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
