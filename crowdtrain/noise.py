"""Third-party log lines that a run's user cannot act on, dropped where they are made.

A volunteer reads its log to see whether it is training; a warning there should mean something
to do. Each entry names the line and why it is noise for crowdtrain. Filters sit on the library's
own logger, so they hold in the processes hivemind forks from this one (its DHT and averagers).
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings

NOISE: dict[str, tuple[str, ...]] = {
    # bitsandbytes looks for an optional package of 4-bit CPU matmul kernels at import; crowdtrain
    # uses only its 8-bit optimizer states, which need none ("pip install kernels" fixes nothing).
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # A peer schedules its next round's matchmaking ahead, while the last one may still be looking
    # for a group (a peer alone, or early in a run): hivemind queues it, by design.
    "hivemind.averaging.matchmaking": ("Another look_for_group is already in progress",),
}


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_RESOURCE_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


class _DropRequestsOfExitedSenders(logging.Filter):
    """The DHT process's report of a request it could not read because its sender has exited. A
    request carries its reply pipe, which multiprocessing passes through the sending process's
    resource-sharing socket; once that process is gone (one of a leaving peer's processes racing
    its shutdown) the socket is missing, refuses, resets, or closes mid-handshake (which
    ``crowdtrain.swarm.hivemind_seam.p2p.guard_request_pipe`` reports as an error raised from the
    resource sharer's), and the request is dropped, with nobody left to answer. Any other failure
    to read a request is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        error = record.exc_info[1]
        while error is not None:  # and what it was raised from (crowdtrain's guard of the request pipe)
            if any(frame.filename.endswith(_RESOURCE_SHARER) for frame in traceback.extract_tb(error.__traceback__)):
                return False
            error = error.__cause__
        return True


class _DropHivemindTaskReports(logging.Filter):
    """asyncio's reports about two kinds of hivemind's tasks, neither for the volunteer to act on;
    reports about any other task are kept.

    - p2p stream handlers whose connection to the p2p daemon closed while they waited (a groupmate
      cancelled its stream, or left). CPython 3.11's StreamReaderProtocol drops its reference to
      the handler's task when the connection is lost, so a handler still waiting is
      garbage-collected ("Task was destroyed but it is pending!"), and its torn-down coroutine
      then fails twice more in the same way. The averaging round already treats the lost stream
      as a failed sender.
    - An averaging step that crowdtrain cancelled (the swarm went on without this peer) after its
      group had formed: hivemind checks for cancellation only while matchmaking, so the all-reduce
      runs to its end and then fails to hand over a result nobody waits for ("Can't set_result to
      a future that is CANCELLED"). The groupmates got their parts; this peer downloads the state.
    - An averaging step's own tasks garbage-collected while pending (hivemind's ``_step``, its
      cancellation watcher and its matchmaking; seen for a step cancelled after its group had
      formed, its cancel already delivered). The trainer follows every step through its control,
      not through these tasks: a step that vanished ends as a failed round at its timeout, which
      the round log and the dashboard show.
    - An averaging step that failed because its connection to this peer's own p2p daemon was reset
      (the daemon closes its streams as the peer leaves, seen on Ctrl-C while a round was looking
      for a group). hivemind hands the error to the step's control before the task ends, so the
      trainer already counted the round as failed; a step failing any other way is kept.
    """

    # (how the report starts, what its error or text says, where the task ran: None for anywhere)
    SYMPTOMS = (("Task was destroyed but it is pending", None, "hivemind/p2p/"),
                ("Task was destroyed but it is pending", None, "hivemind/averaging/"),
                ("Unhandled exception in client_connected_cb", "cannot reuse already awaited coroutine", None),
                ("Task exception was never retrieved", "aclose(): asynchronous generator is already running", None),
                ("Task exception was never retrieved", "Can't set_result to a future that is CANCELLED",
                 "DecentralizedAverager._step()"),
                ("Task exception was never retrieved", "Connection reset by peer", "DecentralizedAverager._step()"))

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        error = str(record.exc_info[1]) if record.exc_info and record.exc_info[1] is not None else ""
        for prefix, cause, where in self.SYMPTOMS:
            if (text.startswith(prefix) and (cause is None or cause in error or cause in text)
                    and (where is None or where in text)):
                return False
        return True


class _DropResetLeaderRequests(logging.Filter):
    """hivemind's report of a request to a would-be group leader that failed because the connection
    to this peer's own p2p daemon was reset, which it logs with a traceback as it cancels the
    request: the daemon closes its streams as the peer leaves (seen on Ctrl-C, the leader leaving
    at the same moment). Matchmaking counts the request as failed either way; any other failure of
    it, or of another task, is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, ConnectionResetError)
                    and "Matchmaking._request_join_potential_leaders()" in str(record.msg))


def drop_exit_noise() -> None:
    """Call when a process has shut down what it started and is about to exit: asyncio then
    reports each task of hivemind's background event loops that the interpreter's exit destroys
    ("Task was destroyed but it is pending!"), which is the exit itself, not a fault."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
        logger.addFilter(_DropPrefixes(("Task was destroyed but it is pending",)))


def drop_known_noise() -> None:
    """Install the filters (once per process; repeated calls add nothing)."""
    for name, prefixes in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
    dht = logging.getLogger("hivemind.dht.dht")
    if not any(isinstance(f, _DropRequestsOfExitedSenders) for f in dht.filters):
        dht.addFilter(_DropRequestsOfExitedSenders())
    cancelled = logging.getLogger("hivemind.utils.asyncio")  # hivemind's await_cancelled reports here
    if not any(isinstance(f, _DropResetLeaderRequests) for f in cancelled.filters):
        cancelled.addFilter(_DropResetLeaderRequests())
    asyncio = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropHivemindTaskReports) for f in asyncio.filters):
        asyncio.addFilter(_DropHivemindTaskReports())
    # hivemind's state averager builds the learning-rate schedule's first value by stepping the
    # scheduler before any optimizer step; torch warns that this skips the first value, which is
    # what hivemind intends (its epochs count from the swarm's, not from this process's steps).
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
