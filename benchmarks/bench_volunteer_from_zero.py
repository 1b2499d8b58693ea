"""A volunteer from zero: a fresh Python with pip, the coordinator's install line, `crowdtrain join`.

Against a real local run (``crowdtrain.launch.LocalSwarm``: a coordinator on the shapes data, the
``tiny`` model, one volunteer already training), each repeat times, in a new virtual environment:

1. ``python -m venv`` (pip only);
2. torch, as a notebook or GPU machine already has it (``--torch``, the CPU build pinned here);
3. the install line the coordinator shows (``/api/version``), verbatim, with the venv first on PATH;
4. ``crowdtrain join`` until its first training step (the first progress line with samples).

The baseline, run once in the same session: the checkout's way before the install line, a fresh
venv with ``pip install ".[all]"`` from the source tree (everything: web server, database
drivers, browser driver, plots) before the same join. The pip cache is warm after the first
repeat; the figures are for that case (a volunteer's second run, or packages a notebook image
already holds).

    python benchmarks/bench_volunteer_from_zero.py [--repeats 3] [--no-baseline]   # JSON in benchmarks/results/

tests/test_volunteer_from_zero.py uses the same steps (``fresh_python``, ``run_install_line``,
``join_until_first_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = Path(__file__).resolve().parent / "results"
PROGRESS = re.compile(r"epoch (\d+) \| loss [\d.]+ \| [\d.]+ samples/s \| contributed (\d+)")


def torch_requirement() -> str:
    """The torch this machine's suite runs on, without its local build tag (pip finds the same one)."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PYTHONUNBUFFERED="1")
    return env


def _run(command, venv: Path, timeout_s: float, **kwargs) -> float:
    start = time.perf_counter()
    # In the venv's folder: run from a checkout, `python -c` would import the checkout's crowdtrain.
    done = subprocess.run(command, env=kwargs.pop("env", None) or _env(venv), capture_output=True, text=True,
                          timeout=timeout_s, cwd=kwargs.pop("cwd", venv), **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{command if isinstance(command, str) else shlex.join(command)} failed "
                           f"({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return time.perf_counter() - start


def fresh_python(venv: Path, *, torch: str | None, timeout_s: float = 600) -> dict:
    """A new virtual environment with nothing but pip (and ``torch`` when given). Seconds per step.

    ``torch="preinstalled"``: this interpreter's torch and what it requires, seen from outside
    the venv through a ``.pth`` file, as a notebook image's torch sits in the system's packages
    where pip finds it but does not own it. A second or so instead of a minute of pip (the suite
    uses it; the benchmark times the real ``pip install``)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    seconds = {"venv_s": time.perf_counter() - start}
    if torch == "preinstalled":
        start = time.perf_counter()
        link_preinstalled("torch", venv, venv.parent / f"{venv.name}-preinstalled")
        seconds["torch_s"] = time.perf_counter() - start
    elif torch:
        seconds["torch_s"] = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", torch], venv,
                                  timeout_s)
    return seconds


def link_preinstalled(name: str, venv: Path, folder: Path) -> list[str]:
    """Symlink distribution ``name`` of this interpreter, and every distribution it requires,
    into ``folder``, and put ``folder`` on ``venv``'s path with a ``.pth`` file. Returns the names."""
    from importlib import metadata

    from packaging.requirements import Requirement

    folder.mkdir(parents=True, exist_ok=True)
    own = {"pip", "setuptools"}  # the venv's own (pip upgrades them there if a requirement asks)
    todo, done = [name], []
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in done or key in own:
            continue
        done.append(key)
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or ()}
        for top in tops - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    (site_packages(venv) / "preinstalled.pth").write_text(f"{folder}\n")
    return done


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def run_install_line(venv: Path, line: str, timeout_s: float = 900, *, byte_compile: bool = True) -> float:
    """Run the coordinator's install line as a volunteer would type it, this venv's pip first.

    ``byte_compile=False``: pip leaves the installed modules' byte code to their first import
    (``PIP_COMPILE=false``), which compiles only what is imported: 18 s of CPU instead of 32 here
    (pyarrow's, pandas' and scipy's modules are most of it), 2-3 s more at the first join. The
    suite's choice; a volunteer's pip compiles, and that is what the benchmark times."""
    if not line.startswith("pip install "):
        raise ValueError(f"not an install line: {line!r}")
    env = None if byte_compile else dict(_env(venv), PIP_COMPILE="false")
    return _run(["bash", "-c", line], venv, timeout_s, env=env)


def installed(venv: Path) -> dict[str, str]:
    """{distribution name (lower case): version} in ``venv``: the first of a name on its path,
    the one it imports."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import json, importlib.metadata as m; found = {}\n"
                          "for d in m.distributions(): found.setdefault(d.metadata['Name'].lower(), d.version)\n"
                          "print(json.dumps(found))"],
                         env=_env(venv), capture_output=True, text=True, check=True, timeout=60, cwd=venv)
    return json.loads(out.stdout)


def join_until_first_step(venv: Path, url: str, *, user: str, log: Path, extra=(), timeout_s: float = 300):
    """Start ``crowdtrain join`` from ``venv``; return (seconds to its first training step, process)
    once it has taken one. The process keeps training: stop it with ``leave``."""
    command = [str(venv / "bin" / "crowdtrain"), "join", url, "--user", user, "--threads", "1", *extra]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env(venv), cwd=venv,
                                start_new_session=True)
    deadline = start + timeout_s
    while time.perf_counter() < deadline:
        text = log.read_text(errors="replace")
        if any(int(m.group(2)) > 0 for m in PROGRESS.finditer(text)):
            return time.perf_counter() - start, proc
        if proc.poll() is not None:
            raise RuntimeError(f"crowdtrain join exited with {proc.returncode} before a step:\n{text[-3000:]}")
        time.sleep(0.25)
    leave(proc)
    raise TimeoutError(f"no training step within {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def leave(proc: subprocess.Popen, timeout_s: float = 90) -> int:
    """Ctrl-C, as a volunteer leaves; SIGKILL if it does not within ``timeout_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode


def one_volunteer(tmp: Path, url: str, install: str | None, name: str) -> dict:
    venv = tmp / name
    start = time.perf_counter()
    row = fresh_python(venv, torch=torch_requirement())
    if install is None:  # the baseline: everything, from the source tree
        row["install_s"] = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{ROOT}[all]"],
                                venv, 900)
    else:
        row["install_s"] = run_install_line(venv, install)
    row["packages"] = len(installed(venv))
    row["join_to_first_step_s"], proc = join_until_first_step(venv, url, user=name, log=tmp / f"{name}.log",
                                                              extra=["--batch-size", "8"])
    row["total_s"] = time.perf_counter() - start
    row["leave_rc"] = leave(proc)
    return row


def main(argv=None) -> int:
    from crowdtrain.launch import LocalSwarm, get_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the install-everything-from-the-checkout run")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-zero-") as d:
        tmp = Path(d)
        swarm = LocalSwarm(tmp, data="shapes", swarm={"total_epochs": 100_000})
        try:
            swarm.start_coordinator(timeout=900)  # a fresh machine makes the 50,000 shapes first (minutes)
            swarm.join("first", batch_size=8, max_epochs=100_000)
            install = get_json(f"{swarm.url}/api/version")["install"]
            if not args.no_baseline:
                rows.append({"path": "checkout: pip install .[all]", **one_volunteer(tmp, swarm.url, None, "baseline")})
            for i in range(args.repeats):
                rows.append({"path": "install line", "repeat": i, **one_volunteer(tmp, swarm.url, install, f"zero{i}")})
        finally:
            swarm.close()
    print(f"{'path':30} {'venv':>6} {'torch':>6} {'install':>8} {'pkgs':>5} {'join->step':>10} {'total':>7}")
    for r in rows:
        print(f"{r['path']:30} {r['venv_s']:6.1f} {r['torch_s']:6.1f} {r['install_s']:8.1f} {r['packages']:5d} "
              f"{r['join_to_first_step_s']:10.1f} {r['total_s']:7.1f}")
    ours = [r for r in rows if r["path"] == "install line"]
    base = [r for r in rows if r["path"] != "install line"]
    if ours and base:
        totals = sorted(r["total_s"] for r in ours)
        print(f"install line total: median {totals[len(totals) // 2]:.1f} s (range {totals[0]:.1f}-{totals[-1]:.1f}); "
              f"{totals[len(totals) // 2] / base[0]['total_s']:.2f}x the checkout's {base[0]['total_s']:.1f} s")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"bench_volunteer_from_zero_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
