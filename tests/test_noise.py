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
