"""Network namespaces joined by a bridge, each node's link shaped with token-bucket filters.

    hub namespace        br0 ─┬─ v-coord ──── eth0 10.213.0.2   coordinator namespace
                              ├─ v-p1 ─────── eth0 10.213.0.11  peer p1 namespace
                              └─ v-p2 ─────── eth0 10.213.0.12  peer p2 namespace ...

A node's upload is shaped by a ``tbf`` qdisc on its own ``eth0`` (egress), its download by one
on the hub-side veth toward it. Every address and interface lives in a namespace this testbed
created (the machine's own network is not touched), so tearing down is deleting namespaces.

Only bandwidth is emulated. ``netem`` (delay, loss) is not available on the kernels this runs
on, so links have sub-millisecond latency: real home links add 10-100 ms of round trip, which
matters for matchmaking and for TCP on fast links, not for moving megabytes at 10-100 Mbit/s.

Tear-down happens on leaving the ``with`` block, on Ctrl-C or SIGTERM, and at interpreter exit;
processes started in the namespaces get SIGTERM if this process dies. Namespaces left over by a
process that was SIGKILLed are swept by the next testbed (or ``crowdtrain testbed cleanup``):
names carry the owner's pid (``ctb<pid>-...``), so only those whose owner is gone are touched.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from crowdtrain import launch
from crowdtrain.lifecycle import own_session_child, raise_system_exit
from crowdtrain.testbed.links import LinkSpec, tbf_args

logger = logging.getLogger(__name__)

PREFIX = "ctb"
SUBNET = "10.213.0"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
_COUNTER = itertools.count()


def require_root() -> None:
    """The testbed makes namespaces and qdiscs: that needs root. Fail with how to fix it."""
    if os.geteuid() != 0:
        raise ValueError("the testbed creates network namespaces (ip netns) and shapes links (tc): it must run "
                         "as root, e.g. `sudo env PATH=$PATH python -m crowdtrain.cli testbed ...`")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class Node:
    name: str  # short: "coord", "p1", ...
    namespace: str
    address: str
    link: LinkSpec

    @property
    def hub_port(self) -> str:
        return f"v-{self.name}"  # the hub-side veth; interface names are per namespace


class Testbed:
    """``with Testbed({"coord": link, "p1": link, ...}) as tb: tb.spawn("p1", [...])``."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, links: dict[str, LinkSpec], *, queue_ms: float = 50.0):
        if not links:
            raise ValueError("a testbed needs at least one node")
        for name in links:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", name):
                raise ValueError(f"node names are short lowercase words (<=12 chars), got {name!r}")
        # Unique per testbed: the owner's pid (for sweeping) and a counter (several testbeds per process).
        tag = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.hub = f"{tag}-hub"
        self.nodes = {name: Node(name, f"{tag}-{name}", f"{SUBNET}.{2 + i}", link)
                      for i, (name, link) in enumerate(links.items())}
        if len(self.nodes) > 250:
            raise ValueError("at most 250 nodes fit the testbed's /24 subnet")
        self.queue_ms = queue_ms
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._old_handlers: dict[int, object] = {}

    # ---- building and tearing down

    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        require_root()
        sweep_stale()
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # turn them into exceptions so `finally` tears down
            self._old_handlers[sig] = signal.signal(sig, raise_system_exit)
        try:
            self._make_namespace(self.hub)
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for node in self.nodes.values():
                self._make_node(node)
        except BaseException:
            self.down()
            raise
        logger.info("testbed up: %s", ", ".join(f"{n.name} {n.address} ({n.link})" for n in self.nodes.values()))

    def _make_namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._made.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _make_node(self, node: Node) -> None:
        self._make_namespace(node.namespace)
        # Create the pair inside the hub and move one end into the node: nothing in the root namespace.
        sh("ip", "-n", self.hub, "link", "add", node.hub_port, "type", "veth", "peer", "name", "eth0",
           "netns", node.namespace)
        sh("ip", "-n", self.hub, "link", "set", node.hub_port, "master", "br0")
        sh("ip", "-n", self.hub, "link", "set", node.hub_port, "up")
        sh("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
        sh("ip", "-n", node.namespace, "link", "set", "eth0", "up")
        for namespace, dev, rate in ((node.namespace, "eth0", node.link.up_bps),
                                     (self.hub, node.hub_port, node.link.down_bps)):
            result = sh("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf",
                        *tbf_args(rate, queue_ms=self.queue_ms), check=False)
            if result.returncode != 0:
                raise RuntimeError(f"tc could not add a tbf qdisc ({result.stderr.strip()}): the kernel needs "
                                   "sch_tbf (modprobe sch_tbf)")

    def down(self) -> None:
        """Stop every process started here, then delete the namespaces. Safe to call twice."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for proc in self.procs:
                launch.stop(proc, signal.SIGTERM, 10)
            self.procs.clear()
            for name in reversed(self._made):
                remove_namespace(name)
            self._made.clear()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            atexit.unregister(self.down)

    # ---- running things inside

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def namespace(self, node: str) -> str:
        return self.hub if node == "hub" else self.nodes[node].namespace

    def spawn(self, node: str, argv: list[str], *, log: Path | None = None, env: dict | None = None,
              stdout=None) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace, in its own process group."""
        out = open(log, "ab") if log is not None else stdout
        proc = subprocess.Popen(self.exec_argv(node, argv), stdout=out, stderr=subprocess.STDOUT if log else None,
                                env=env, start_new_session=True, preexec_fn=own_session_child)
        if log is not None:
            out.close()  # the child holds its own descriptor
        self.procs.append(proc)
        return proc

    def run(self, node: str, argv: list[str], *, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True, timeout=timeout)


def namespace_pids(name: str) -> list[int]:
    result = sh("ip", "netns", "pids", name, check=False)
    return [int(p) for p in result.stdout.split()]


def remove_namespace(name: str) -> None:
    """Kill what still runs inside (processes this testbed started there) and delete it."""
    for attempt in range(20):
        pids = namespace_pids(name)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    result = sh("ip", "netns", "del", name, check=False)
    if result.returncode != 0 and name in list_namespaces():
        logger.error("could not delete namespace %s: %s", name, result.stderr.strip())


def list_namespaces() -> list[str]:
    result = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def testbed_namespaces() -> list[str]:
    return [name for name in list_namespaces() if _NAME.match(name)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(*, everything: bool = False) -> list[str]:
    """Delete testbed namespaces whose owner process is gone (all of them with ``everything``)."""
    removed = []
    for name in testbed_namespaces():
        owner = int(_NAME.match(name).group(1))
        if everything or not _alive(owner):
            remove_namespace(name)
            removed.append(name)
    if removed:
        logger.warning("removed %d namespaces left by an earlier testbed: %s", len(removed), " ".join(removed))
    return removed
