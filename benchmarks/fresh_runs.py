"""Fresh runs typed as a user types them: does every averaging round hold every volunteer?

Each run is a new run folder, a `crowdtrain coordinator` and N `crowdtrain join` started by a
bash script with nothing but the guide's flags: the defaults a person gets (listening on every
interface, threads picked per machine, the environment as it is), not the tests' harness, which
pins hosts to 127.0.0.1 and threads to 1. From each volunteer's summary (``--summary-file``):
its rounds, and which of them held every volunteer that was training at that epoch; from its
log, the rounds that found no group and the states downloaded only to be thrown away.

A cell is one configuration (mode, joins together or seconds apart, threads, validation and
gallery on or off, number of volunteers); the matrix runs every cell ``--runs`` times, one run
at a time (they would share the machine's cores otherwise), prints a table and writes JSON:

    python benchmarks/fresh_runs.py --runs 3            # the whole matrix (hours on 2 cores)
    python benchmarks/fresh_runs.py --cells issue --runs 10   # the two configurations of the report
    python benchmarks/fresh_runs.py --list              # the cells' names

tests/test_fresh_runs.py runs the report's two configurations through :func:`fresh_run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
NO_GROUP = "could not find a group"
THROWN_AWAY = re.compile(r"the newest state on offer is from epoch \d+, older than ours")


@dataclass(frozen=True)
class Cell:
    mode: str = "diloco"  # the coordinator's --swarm-preset: laptop (DiLoCo) or demo (sync)
    volunteers: int = 2
    apart_s: float = 0.0  # between one `join` and the next
    threads: str = "auto"  # `join --threads`: auto (not given) or a number
    validation: bool = True  # False: --valid-rows 0 --samples-every 0
    batch_size: int | None = None  # `join --batch-size`; None: auto
    minutes: float = 1.5  # `join --minutes`
    max_epochs: int | None = None  # `join --max-epochs`: leave at that epoch (a run's length in rounds, at any speed)

    @property
    def name(self) -> str:
        return (f"{self.mode}-{self.volunteers}v-{'together' if not self.apart_s else f'{self.apart_s:g}s-apart'}"
                f"-threads-{self.threads}-{'valid' if self.validation else 'novalid'}")


# The report's two configurations (issue "A fresh run that averages"), with --minutes as given.
CONFIG_1 = Cell(mode="diloco", volunteers=2, apart_s=0.0, threads="1", validation=True, batch_size=16)
CONFIG_2 = Cell(mode="diloco", volunteers=2, apart_s=3.0, threads="auto", validation=False)


def matrix(minutes: float) -> list[Cell]:
    """Sync and DiLoCo, joins together or 3 s apart, threads auto or 1, validation and gallery
    on or off, 2 and 3 volunteers: 32 cells."""
    return [Cell(mode=m, volunteers=n, apart_s=a, threads=t, validation=v, minutes=minutes)
            for m, n, a, t, v in itertools.product(("diloco", "sync"), (2, 3), (0.0, 3.0), ("auto", "1"),
                                                   (True, False))]


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the coordinator's HTTP and DHT ports)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


_READY = ("import json, sys, urllib.request; "
          "sys.exit(not json.load(urllib.request.urlopen('http://127.0.0.1:{port}/api/join', timeout=5))"
          "['initial_peers'])")


def script_for(cell: Cell, folder: Path, port: int, *, total_epochs: int = 40) -> str:
    """The bash script a person would type: the coordinator in the background, then the joins."""
    crowdtrain = shlex.quote(str(Path(sys.executable).with_name("crowdtrain")))
    preset = "laptop" if cell.mode == "diloco" else "demo"
    coordinator = (f"{crowdtrain} coordinator --run-id fresh --run-dir run --preset demo --data shapes "
                   f"--swarm-preset {preset} --swarm total_epochs={total_epochs} "
                   + ("" if cell.validation else "--valid-rows 0 --samples-every 0 ")
                   + f"--port {port} --dht-port {port + 1}")
    lines = ["set -u", f"cd {shlex.quote(str(folder))}", f"{coordinator} > coordinator.log 2>&1 &",
             "echo $! > coordinator.pid",
             # As a person would: the join line once the coordinator says it is up (its join
             # info lists the run's first DHT peer).
             f"until {shlex.quote(sys.executable)} -c {shlex.quote(_READY.format(port=port))} 2> /dev/null; "
             "do sleep 1; done"]
    for i in range(cell.volunteers):
        flags = [f"--user v{i}", f"--minutes {cell.minutes:g}", f"--summary-file v{i}.json"]
        if cell.max_epochs:
            flags.append(f"--max-epochs {cell.max_epochs}")
        if cell.batch_size:
            flags.append(f"--batch-size {cell.batch_size}")
        if cell.threads != "auto":
            flags.append(f"--threads {cell.threads}")
        if i and cell.apart_s:
            lines.append(f"sleep {cell.apart_s:g}")
        lines.append(f"{crowdtrain} join http://127.0.0.1:{port} {' '.join(flags)} > v{i}.log 2>&1 &")
        lines.append(f"echo $! > v{i}.pid")
    lines.append("wait $(cat v*.pid)")
    return "\n".join(lines) + "\n"


def whole_rounds(summaries: list[dict]) -> tuple[int, int, list]:
    """(rounds that held every volunteer training at their epoch, rounds, the others as (volunteer,
    epoch, group, expected)). Counted up to the last epoch every volunteer reached (after that the
    first to leave is gone); a volunteer is training at an epoch from the one it joined at."""
    last = min((max((r["epoch"] for r in s["rounds"]), default=-1) for s in summaries), default=-1)
    whole, total, short = 0, 0, []
    for i, s in enumerate(summaries):
        for r in s["rounds"]:
            if r["epoch"] > last:
                continue
            expected = sum(1 for o in summaries if o["joined_epoch"] <= r["epoch"])
            total += 1
            if r["group_size"] == expected:
                whole += 1
            else:
                short.append((f"v{i}", r["epoch"], r["group_size"], expected))
    return whole, total, short


def fresh_run(cell: Cell, folder: Path, *, timeout_s: float | None = None) -> dict:
    """One fresh run of ``cell`` in ``folder`` (made empty); what it showed."""
    folder.mkdir(parents=True, exist_ok=True)
    port = _free_port_pair()
    script = folder / "run.sh"
    script.write_text(script_for(cell, folder, port))
    timeout_s = timeout_s or 180 + cell.minutes * 60 + cell.apart_s * cell.volunteers
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _stop(folder, proc)
    result = {"cell": cell.name, "folder": str(folder), "wall_s": round(time.monotonic() - t0, 1),
              "script_rc": rc, "volunteers": []}
    summaries = []
    for i in range(cell.volunteers):
        log = (folder / f"v{i}.log").read_text(errors="replace") if (folder / f"v{i}.log").exists() else ""
        path = folder / f"v{i}.json"
        summary = json.loads(path.read_text()) if path.exists() else None
        if summary is not None:
            summaries.append(summary)
        result["volunteers"].append({
            "summary": summary is not None, "joined_epoch": summary and summary["joined_epoch"],
            "groups": [r["group_size"] for r in summary["rounds"]] if summary else [],
            "no_group": log.count(NO_GROUP), "states_thrown_away": len(THROWN_AWAY.findall(log)),
            "credited_steps": summary and summary.get("credited_steps")})
    whole, total, short = whole_rounds(summaries) if len(summaries) == cell.volunteers else (0, 0, ["summaries"])
    result.update(rounds=total, whole=whole, short=short,
                  ok=len(summaries) == cell.volunteers and total > 0 and whole == total
                  and all(v["no_group"] == 0 for v in result["volunteers"]))
    return result


def _stop(folder: Path, proc: subprocess.Popen) -> None:
    """The coordinator leaves on Ctrl-C as a person stops it; whatever is left is killed."""
    pid_file = folder / "coordinator.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGINT)
            for _ in range(60):
                os.kill(int(pid_file.read_text()), 0)
                time.sleep(0.5)
        except (ProcessLookupError, ValueError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per cell")
    parser.add_argument("--cells", default="all", help="all, issue (the report's two configurations), or "
                                                      "comma-separated cell names (--list)")
    parser.add_argument("--minutes", type=float, default=1.5, help="each volunteer's --minutes (matrix cells)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", default=None, help="JSON file (default: results/fresh_runs_TIME.json)")
    args = parser.parse_args()
    cells = matrix(args.minutes)
    if args.cells == "issue":
        cells = [dataclasses.replace(c, minutes=args.minutes) for c in (CONFIG_1, CONFIG_2)]
    elif args.cells != "all":
        wanted = set(args.cells.split(","))
        cells = [c for c in cells if c.name in wanted]
    if args.list or not cells:
        print("\n".join(c.name for c in matrix(args.minutes)))
        return 0 if args.list else 2
    out = Path(args.out) if args.out else RESULTS / f"fresh_runs_{time.strftime('%Y%m%d_%H%M%S')}.json"
    rows = []
    with tempfile.TemporaryDirectory(prefix="fresh-runs-") as tmp:
        for cell in cells:
            for k in range(args.runs):
                r = fresh_run(cell, Path(tmp) / f"{cell.name}-{k}")
                r["cell_settings"] = dataclasses.asdict(cell)
                rows.append(r)
                print(f"{cell.name} run {k + 1}: {r['whole']}/{r['rounds']} rounds whole, rounds without a group "
                      f"{[v['no_group'] for v in r['volunteers']]}, {r['wall_s']:.0f} s", flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"runs": rows}, indent=1))
    print("\n| cell | runs | runs with every round whole | whole rounds | rounds without a group |")
    print("| --- | --- | --- | --- | --- |")
    for cell in cells:
        mine = [r for r in rows if r["cell"] == cell.name]
        print(f"| {cell.name} | {len(mine)} | {sum(r['ok'] for r in mine)} | "
              f"{sum(r['whole'] for r in mine)}/{sum(r['rounds'] for r in mine)} | "
              f"{sum(v['no_group'] for r in mine for v in r['volunteers'])} |")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
