"""Every process of a run ends with the process that started it.

A run is a tree of processes: the coordinator starts the auxiliary peer; a volunteer and the
auxiliary peer fork hivemind's DHT and averagers, which exec p2p daemons. A stop that reaches
only the top (``kill``, ``systemctl stop``, ``docker stop``, a closed terminal, or the OOM killer)
must not leave the rest running: an orphaned auxiliary peer keeps the run's DHT port and identity,
so a restarted coordinator cannot start, and orphaned averagers keep answering for a peer that left.

Two mechanisms, both Linux's (elsewhere they do nothing and a stop relies on the clean path):

- the clean path: SIGTERM and SIGHUP end a process the way Ctrl-C does (``exit_on_signals``),
  so its ``finally`` blocks stop what it started;
- the hard path: ``PR_SET_PDEATHSIG`` makes the kernel send SIGTERM to a child when the thread
  that forked it dies, even by SIGKILL (``die_with_parent`` for ``subprocess``,
  ``forks_die_with_this_process`` for ``multiprocessing``'s forks).

A handler that stops a loop through a lock (``threading.Event.set``) goes through
``on_signals``, so that a second signal cannot deadlock it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_forked_from_main_thread = False


def die_with_parent() -> None:
    """In a child (``preexec_fn``, or its own first line): get SIGTERM when the parent thread dies.

    The setting survives ``exec``. The thread that forked the child must live as long as the
    child should: fork from the main thread or from a thread that outlives the child."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def niceness_to_session(pid: int = 0) -> None:
    """Give the session of process ``pid`` (0: this one) that process's niceness, if it is higher.

    Linux's autogroup scheduling (``CONFIG_SCHED_AUTOGROUP``, on in most distributions' kernels)
    makes each session a group that shares the CPU with the other sessions at equal weight,
    whatever nice values its processes have: a child started in its own session under
    ``nice -n 10 crowdtrain demo`` takes the CPU from the machine's other work as if it were not
    niced. Raising a group's value needs no privilege. Without autogroups (no such file), or for a
    process that has gone, there is nothing to do."""
    path = f"/proc/{pid or 'self'}/autogroup"
    try:
        nice = os.getpriority(os.PRIO_PROCESS, pid)
        fd = os.open(path, os.O_RDWR)  # plain system calls: this runs as a ``preexec_fn`` too
        try:
            if nice > int(os.read(fd, 64).split()[-1]):
                os.write(fd, str(nice).encode())
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        pass


def own_session_child() -> None:
    """``preexec_fn`` of a child started in its own session (``start_new_session=True``): it dies
    with its parent (``die_with_parent``) and keeps its parent's niceness (``niceness_to_session``)."""
    die_with_parent()
    niceness_to_session()


def _before_fork() -> None:
    global _forked_from_main_thread
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # A child forked from a short-lived helper thread would be killed when that thread ends, so
    # only forks of the main thread (hivemind starts its DHT and averagers there) get the signal.
    if _forked_from_main_thread:
        die_with_parent()


def forks_die_with_this_process() -> None:
    """From now on, every ``os.fork`` of this process's main thread (``multiprocessing`` with the
    fork start method: hivemind's DHT and averagers) gets SIGTERM when this process dies.
    The p2p daemons those children exec are ended by them on SIGTERM; after a SIGKILL of a
    child itself its daemon may stay (``crowdtrain coordinator`` ends an old run's leftovers)."""
    if sys.platform == "linux":
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)


def _hangup_as_terminate(signum, frame):
    signal.raise_signal(signal.SIGTERM)


def hangup_as_terminate() -> None:
    """SIGHUP (the terminal closed, ``systemctl reload`` without a reload command) does what
    SIGTERM does in this process at the moment it arrives, whoever handles SIGTERM then (uvicorn
    while it serves, a volunteer's clean leave). Python's default is to die at once."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, _hangup_as_terminate)


def exit_on_signals() -> None:
    """SIGTERM raises ``SystemExit`` in the main thread, as SIGINT raises ``KeyboardInterrupt``,
    and SIGHUP does the same: the ``finally`` blocks that stop child processes then run. Python's
    default for both is to die at once, leaving the children running. Only the main thread can
    set handlers: elsewhere (a test running a coordinator in a thread) this does nothing."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_system_exit)
        hangup_as_terminate()


def on_signals(callback, signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP), *,
               ctrl_c_again_quits: bool = False) -> None:
    """Run ``callback(signum)`` for each of ``signals``, in a helper thread, not in the handler.

    A Python signal handler runs in the main thread between two of its bytecodes, so one that
    takes a lock (``threading.Event.set`` does) deadlocks when the main thread already holds it:
    inside ``Event.wait`` on that event, or inside the same handler, interrupted by a second
    signal. Two signals at once are common (a parent-death SIGTERM and the process group's), and
    a process hung that way keeps its ports for good. Here the
    handler only writes the signal's number to a pipe (no lock); the helper thread reads it and
    calls ``callback``, which may take locks and start threads. Call from the main thread.

    ``ctrl_c_again_quits``: once any of ``signals`` has arrived, a SIGINT raises
    ``KeyboardInterrupt`` in the main thread from the handler itself (a raise takes no lock), for
    a user who will not wait for the clean stop the first one began. A repeated SIGTERM or
    SIGHUP only reaches ``callback`` again: two of them at once are a parent's death and its
    process group's stop, not a user in a hurry."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    owner = os.getpid()
    arrived = False

    def handler(signum, frame):
        nonlocal arrived
        if os.getpid() != owner:
            # A fork (hivemind's DHT and averagers) inherited this handler but not the helper
            # thread. Ctrl-C reaches the whole process group: the fork ignores it and is shut
            # down by its parent; any other signal ends it.
            if signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if ctrl_c_again_quits and arrived and signum == signal.SIGINT:
            raise KeyboardInterrupt
        arrived = True
        try:
            os.write(write_end, bytes([signum]))
        except OSError:  # the pipe is full: enough signals are already on their way
            pass

    def pump():
        while True:
            for signum in os.read(read_end, 64):
                callback(signum)

    threading.Thread(target=pump, name="signals", daemon=True).start()
    for sig in signals:
        signal.signal(sig, handler)


def exit_now(code: int) -> None:
    """End this process at once, its forks (hivemind's DHT and averagers) first: for a process
    whose clean exit waits on something that will never answer. Their p2p daemons get SIGTERM
    from the kernel as their parent dies (``die_with_parent``) or SIGPIPE at their next line."""
    import logging
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            os.kill(child.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
    logging.shutdown()  # what was logged reaches the file or terminal
    os._exit(code)


class Deadline:
    """Ends the process (:func:`exit_now`) a bound after :meth:`start`, unless it has exited by
    then: a clean leave waits on the network (the round under way, the last records), and a wait
    on a child process that died or froze never ends. The first start's bound holds unless a
    later one asks for a sooner end."""

    def __init__(self, *, exit_code: int = 1, clock=None):
        import time

        self.exit_code, self.clock = exit_code, clock or time.monotonic
        self._lock = threading.Lock()
        self._until: float | None = None
        self._wake = threading.Event()
        self.why = ""

    def start(self, why: str, bound_s: float) -> None:
        with self._lock:
            until = self.clock() + bound_s
            if self._until is not None and self._until <= until:
                return
            first, self._until, self.why = self._until is None, until, why
            self._wake.set()
        if first:
            threading.Thread(target=self._run, name="leave-deadline", daemon=True).start()

    def _run(self) -> None:
        import logging

        while True:
            with self._lock:
                left = self._until - self.clock()
                self._wake.clear()
            if left <= 0:
                break
            self._wake.wait(left)
        logging.getLogger(__name__).error("%s; still not gone at the bound: exiting now (what it waited on is "
                                          "lost, e.g. its last records)", self.why)
        exit_now(self.exit_code)


class ChildWatch:
    """Calls ``on_death(name, process)`` once if one of ``processes`` (multiprocessing children
    this process depends on: hivemind's DHT, its averagers) is no longer alive, checked every
    ``every_s`` in a daemon thread until :meth:`stop` (before they are shut down on purpose)."""

    def __init__(self, processes: dict, on_death, *, every_s: float = 2.0):
        self.processes, self.on_death, self.every_s = processes, on_death, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="child-watch", daemon=True)

    def start(self) -> "ChildWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, process in self.processes.items():
                if not process.is_alive() and not self._stop.is_set():
                    self.on_death(name, process)
                    return


def how_it_ended(exitcode: int | None) -> str:
    """A child's exit code in words, with what usually causes it."""
    if exitcode is None:
        return "it is gone"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        if exitcode == -signal.SIGKILL:
            return f"killed by {name} (the kernel's OOM killer does this when memory runs out: `dmesg` says so)"
        return f"killed by {name}"
    return f"exited with code {exitcode}"
