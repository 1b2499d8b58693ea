"""Refuse a run whose HTTP or DHT port another process already listens on, before anything starts.

Both ports are probed before the run folder, its keys or the DHT peer exist, because neither
failure shows up early by itself: hivemind's p2p daemon listens with SO_REUSEPORT, so a second
one binds a port that a live run's daemon holds and takes a share of its incoming connections;
and uvicorn opens the HTTP port last, after the DHT peer is up (tens of seconds in).

The message names who holds the port where that is cheap to find: a coordinator answering
``/api/join`` on it gives its run id, and ``/proc`` gives the listening process (for hivemind's
p2p daemon, also the crowdtrain process that started it). Linux only for the ``/proc`` part;
elsewhere the message names the port alone.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ASK_TIMEOUT_S = 2.0  # for the /api/join question to a live coordinator: a local answer takes milliseconds


@dataclass
class Port:
    label: str  # what the port is for, as the message says it: "HTTP port", "DHT port"
    host: str
    port: int
    flag: str  # the option that moves it, e.g. "--port"
    host_flag: str  # the option that sets its address, e.g. "--host"


def probe(host: str, port: int) -> OSError | None:
    """The error a listener on host:port would get now (None: it can listen).

    SO_REUSEADDR as uvicorn sets it, so connections of a run that just stopped (TIME_WAIT) do
    not count; no SO_REUSEPORT, so any listener does, hivemind's daemon included."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def parent_pid(pid: int) -> int | None:
    try:  # the command name in /proc/PID/stat may hold spaces and parentheses: split after the last ')'
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def listening_pids(port: int) -> list[int]:
    """Processes with a TCP socket listening on ``port`` (any address), from /proc; [] where unknown."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl, local HEXIP:HEXPORT, remote, state (0A = LISTEN), ..., inode (10th)
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(pids)


def _short(argv: list[str], limit: int = 240) -> str:
    text = " ".join([Path(argv[0]).name, *argv[1:]]) if argv else "?"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_process(pid: int) -> str:
    """``pid N (command)``. For a process that is not crowdtrain itself (hivemind's p2pd), its
    program's name and the nearest crowdtrain ancestor, which says whose it is (an auxiliary
    peer's run folder, a volunteer)."""
    argv = cmdline(pid)
    if any("crowdtrain" in a for a in argv):
        return f"pid {pid} ({_short(argv)})"
    text = f"pid {pid} ({Path(argv[0]).name if argv else '?'})"
    ancestor = parent_pid(pid)
    for _ in range(3):
        if not ancestor or ancestor <= 1:
            break
        if any("crowdtrain" in a for a in cmdline(ancestor)):
            return f"{text}, started by pid {ancestor} ({_short(cmdline(ancestor))})"
        ancestor = parent_pid(ancestor)
    return text


def ask_coordinator(host: str, port: int) -> str | None:
    """The run id of a crowdtrain coordinator serving host:port, if one answers at once."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/api/join"
    try:
        with urllib.request.urlopen(url, timeout=ASK_TIMEOUT_S) as response:
            run_id = json.loads(response.read()).get("run_id")
    except (OSError, ValueError, AttributeError):  # not HTTP, not JSON, not a dict: someone else's server
        return None
    return f"the coordinator of run {run_id!r} (it answers {url})" if isinstance(run_id, str) else None


def check_ports(ports: list[Port], *, ignore_pids: set[int] = frozenset()) -> None:
    """Raise ValueError naming every port of ``ports`` that cannot be listened on, and its holder.

    ``ignore_pids``: listeners that will be gone before the port is needed (a crashed run's own
    leftover auxiliary peer, which the coordinator ends before starting a new one)."""
    problems = []
    for p in ports:
        error = probe(p.host, p.port)
        if error is None:
            continue
        holders = listening_pids(p.port)
        if holders and set(holders) <= ignore_pids:
            continue
        who = [ask_coordinator(p.host, p.port) if p.label.startswith("HTTP") else None]
        who += [describe_process(pid) for pid in holders]
        who = [w for w in who if w]
        if error.errno == errno.EADDRINUSE:
            held = f"is in use by {', '.join(who)}" if who else "is in use by another process"
            problems.append(f"{p.label} {p.port} (on {p.host}) {held}. Stop that first, or pass {p.flag} with a "
                            "free port.")
        else:
            problems.append(f"cannot listen on {p.host}:{p.port} ({p.label}): {error}. Pass {p.host_flag} with an "
                            f"address of this machine (or 0.0.0.0) and {p.flag} with a free port.")
    if problems:
        raise ValueError("refusing to start: nothing of this run was created, and whatever holds the port is left "
                         "alone.\n  " + "\n  ".join(problems))
