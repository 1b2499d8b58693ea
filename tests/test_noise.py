"""Third-party log lines dropped where they are made (crowdtrain.noise), and only those."""

import asyncio
import logging

from crowdtrain.noise import drop_known_noise


class _Task:
    """Stands for the task in asyncio's report (its repr is all the report shows)."""

    def __init__(self, where: str):
        self.where = where

    def __repr__(self):
        return f"<Task pending name='Task-66' coro=<{self.where}> wait_for=<Future cancelled>>"


def _reported(context: dict, caplog) -> list[str]:
    caplog.clear()
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop.call_exception_handler(context)  # as asyncio reports it: the default handler logs it
    finally:
        loop.close()
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_a_lost_p2p_stream_handler_is_not_reported_and_any_other_lost_task_is(caplog):
    drop_known_noise()
    hivemind_handler = _Task("ControlClient._handler() running at /venv/lib/python3.11/site-packages/hivemind/p2p/"
                             "p2p_daemon_bindings/control.py:154")
    assert _reported({"message": "Task was destroyed but it is pending!", "task": hivemind_handler}, caplog) == []
    ours = _Task("train_step() running at /work/crowdtrain/swarm/peer.py:10")
    assert _reported({"message": "Task was destroyed but it is pending!", "task": ours}, caplog), \
        "a task of crowdtrain's lost that way is a fault: reported"
    cascade = [{"message": "Unhandled exception in client_connected_cb",
                "exception": RuntimeError("cannot reuse already awaited coroutine")},
               {"message": "Task exception was never retrieved",
                "exception": RuntimeError("aclose(): asynchronous generator is already running")}]
    for context in cascade:
        assert _reported(context, caplog) == [], context["message"]
    other = {"message": "Unhandled exception in client_connected_cb", "exception": ValueError("bad frame")}
    assert _reported(other, caplog), "another failure of a connection handler is reported"


def test_a_cancelled_averaging_step_that_finished_anyway_is_not_reported_and_other_lost_results_are(caplog):
    from concurrent.futures import InvalidStateError

    drop_known_noise()
    lost = InvalidStateError("Can't set_result to a future that is CANCELLED (77212656771480946036648357883341218438)")
    step = _Task("DecentralizedAverager._step() done, defined at /venv/lib/python3.11/site-packages/hivemind/"
                 "averaging/averager.py:421")
    assert _reported({"message": "Task exception was never retrieved", "exception": lost, "future": step},
                     caplog) == []
    ours = _Task("DiLoCoOptimizer._outer_round() done, defined at /work/crowdtrain/swarm/diloco.py:600")
    assert _reported({"message": "Task exception was never retrieved", "exception": lost, "future": ours}, caplog), \
        "a result of crowdtrain's own lost that way is a fault: reported"
    failed = {"message": "Task exception was never retrieved", "exception": RuntimeError("all-reduce failed"),
              "future": step}
    assert _reported(failed, caplog), "another failure of hivemind's averaging step is reported"


def test_a_step_whose_own_p2p_daemon_reset_its_connection_on_leaving_is_not_reported_and_others_are(caplog):
    """What a volunteer Ctrl-C'd while looking for a group printed: its p2p daemon closed the
    streams, and hivemind's step and its request to a leader failed with a reset connection."""
    drop_known_noise()
    reset = ConnectionResetError(104, "Connection reset by peer")
    step = _Task("DecentralizedAverager._step() done, defined at /venv/lib/python3.11/site-packages/hivemind/"
                 "averaging/averager.py:421")
    assert _reported({"message": "Task exception was never retrieved", "exception": reset, "future": step},
                     caplog) == []
    ours = _Task("DiLoCoOptimizer._outer_round() done, defined at /work/crowdtrain/swarm/diloco.py:600")
    assert _reported({"message": "Task exception was never retrieved", "exception": reset, "future": ours}, caplog)

    hivemind_asyncio = logging.getLogger("hivemind.utils.asyncio")  # where hivemind's await_cancelled reports
    leader = _Task("Matchmaking._request_join_potential_leaders() done, defined at /venv/lib/python3.11/"
                   "site-packages/hivemind/averaging/matchmaking.py:145")
    other = _Task("Matchmaking._declare_for_download_periodically() done, defined at /venv/lib/python3.11/"
                  "site-packages/hivemind/averaging/matchmaking.py:300")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="hivemind.utils.asyncio"):
        for task, error in [(leader, reset), (leader, ValueError("bad leader")), (other, reset)]:
            try:
                raise error
            except Exception:
                hivemind_asyncio.exception(f"Exception in {task}:")  # as hivemind's await_cancelled does
    reported = [r.getMessage() for r in caplog.records if r.name == "hivemind.utils.asyncio"]
    assert reported == [f"Exception in {leader}:", f"Exception in {other}:"], \
        "only the leader request's reset is dropped: its other failures and other tasks' resets are kept"


def test_a_lost_averaging_step_is_not_reported(caplog):
    drop_known_noise()
    site = "/venv/lib/python3.11/site-packages/hivemind/averaging/"
    for where in (f"DecentralizedAverager._step() running at {site}averager.py:441",
                  f"StepControl.wait_for_cancel() running at {site}control.py:165",
                  f"DecentralizedAverager._step.<locals>.find_peers_or_notify_cancel() running at {site}averager.py:431"):
        assert _reported({"message": "Task was destroyed but it is pending!", "task": _Task(where)}, caplog) == [], where
    ours = _Task("DiLoCoOptimizer._outer_round() running at /work/crowdtrain/swarm/diloco.py:600")
    assert _reported({"message": "Task was destroyed but it is pending!", "task": ours}, caplog)


def _request_from(exits_first: bool):
    """A request sent to this process as a peer's process sends one to its DHT process: pickled
    with its reply pipe, which the receiver fetches from the sender's resource-sharing socket."""
    import multiprocessing as mp

    receiver, sender = mp.Pipe(duplex=False)
    done = mp.get_context("fork").Event()

    def send(sender, done):
        reply, _ = mp.Pipe()
        sender.send(("_get", [], {"future_pipe": reply}))
        if not exits_first:
            done.wait(30)

    process = mp.get_context("fork").Process(target=send, args=(sender, done))
    process.start()
    if exits_first:
        process.join(30)
    try:
        return receiver.recv()
    finally:
        done.set()
        process.join(30)


def test_a_dht_request_whose_sender_has_exited_is_not_reported_and_other_failures_are(caplog):
    drop_known_noise()
    dht_logger = logging.getLogger("hivemind.dht.dht")  # where hivemind's DHT process reports
    assert _request_from(exits_first=False)[0] == "_get", "a sender still there: its request is read"
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="hivemind.dht.dht"):
        try:
            _request_from(exits_first=True)
        except (OSError, ConnectionError) as e:
            dht_logger.exception(e)  # as hivemind's DHT loop reports it
        else:
            raise AssertionError("reading the request of an exited sender should fail")
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionError as e:
            dht_logger.exception(e)
    reported = [r.getMessage() for r in caplog.records if r.name == "hivemind.dht.dht"]
    assert reported == ["[Errno 104] Connection reset by peer"], \
        "only the exited sender's request is dropped; the same error from anything else is kept"


class _ReplyPipeOfAnExitedSender:
    """Unpickles as a request's reply pipe does (through the sender's resource-sharing socket),
    from a sender that exits during the handshake: ``EOFError`` inside multiprocessing's
    resource_sharer, as a leaving peer's averager process causes."""

    def __init__(self, address: str):
        self.address = address

    def __reduce__(self):
        import multiprocessing.connection
        from multiprocessing import resource_sharer

        shared = object.__new__(resource_sharer.DupFd)
        shared._id = (self.address, 0)
        return multiprocessing.connection.rebuild_connection, (shared, True, True)


def test_a_request_whose_sender_exits_mid_handshake_ends_that_request_not_the_dht_process(tmp_path):
    """hivemind's DHT process reads requests in a loop that survives OSError but not EOFError;
    crowdtrain's guard of its request pipe (crowdtrain.swarm.hivemind_seam.p2p) turns the sender's
    exit into the former. Without it the DHT process dies, and every request after it is lost."""
    import pickle
    import socket
    import threading

    import hivemind
    from hivemind.utils import get_dht_time

    from crowdtrain.swarm.hivemind_seam.p2p import _RequestPipe, guard_request_pipe

    address = str(tmp_path / "sender.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()

    def exit_at_once():  # the sender's resource sharer: accepts, and its process is gone
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=exit_at_once, daemon=True).start()
    drop_known_noise()
    # What the DHT process reports for it (as hivemind's loop logs an OSError): nothing.
    class Pipe:
        def recv(self):
            return pickle.loads(pickle.dumps(_ReplyPipeOfAnExitedSender(address)))

    dht_logger, reported = logging.getLogger("hivemind.dht.dht"), []
    handler = logging.Handler()  # on the logger itself: hivemind's loggers do not propagate to caplog's
    handler.emit = reported.append
    dht_logger.addHandler(handler)
    try:
        for request in (Pipe(), None):
            try:
                _RequestPipe(request).recv()  # None: any other failure to read a request
            except (OSError, AttributeError) as e:
                dht_logger.exception(e)
    finally:
        dht_logger.removeHandler(handler)
    assert [type(r.exc_info[1]) for r in reported] == [AttributeError], reported

    dht = guard_request_pipe(hivemind.DHT(start=False))
    dht.run_in_background(await_ready=True)
    try:
        dht._outer_pipe.send(("_get", [], dict(key="k", latest=False, future=_ReplyPipeOfAnExitedSender(address))))
        assert dht.store("k", "v", expiration_time=get_dht_time() + 60, return_future=True).result(timeout=30)
        assert dht.get("k", return_future=True).result(timeout=30).value == "v"
        assert dht.is_alive()
    finally:
        dht.shutdown()
        listener.close()
