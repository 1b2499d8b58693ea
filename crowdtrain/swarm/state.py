"""The training state a peer serves to others: never last epoch's parameters under this epoch's number.

With the paper's delayed update, hivemind's ``Optimizer`` increments a peer's epoch at once and
runs the gradient round and the optimizer step in the background, for seconds. A download in that
window got the parameters from *before* the step labelled with the *new* epoch, so the peer that
took it (a newcomer, a peer left out of a round, the coordinator's checkpointer) ended one update
behind everyone else for good: state averaging realigns it only every ``average_state_every``
epochs, and never if it leaves first. Here a peer asked for its state while such an update is in
flight answers once the update is done (which includes a state-averaging round it belongs to), or
after ``state_wait_s`` with its parameters labelled honestly as the previous epoch.

Keep ``state_wait_s`` short (the optimizer uses 0.5 s): a downloader gives each peer a few
seconds for its first message and then moves on down the list, and with a 30 s wait a newcomer
skipped the live peers and took the coordinator's checkpoint, epochs old.
"""

from __future__ import annotations

import logging
import threading

from hivemind.optim.state_averager import TrainingStateAverager

logger = logging.getLogger(__name__)


class ConsistentStateAverager(TrainingStateAverager):
    """hivemind's TrainingStateAverager whose served state always matches its epoch number."""

    def __init__(self, *args, state_wait_s: float = 0.5, **kwargs):
        self.state_wait_s = state_wait_s
        self._update_done = threading.Event()
        self._update_done.set()
        super().__init__(*args, **kwargs)

    def step(self, *args, optimizer_step: bool = False, delay_optimizer_step: bool = False,
             increment_epoch: bool = False, **kwargs):
        if optimizer_step and delay_optimizer_step:
            # Cleared before the epoch is incremented: from here until the background update ends,
            # our parameters are the previous epoch's.
            self._update_done.clear()
        try:
            return super().step(*args, optimizer_step=optimizer_step, delay_optimizer_step=delay_optimizer_step,
                                increment_epoch=increment_epoch, **kwargs)
        except BaseException:
            self._update_done.set()
            raise

    def _do(self, *args, **kwargs):
        try:
            return super()._do(*args, **kwargs)
        finally:
            self._update_done.set()

    def update_in_flight(self) -> bool:
        return not self._update_done.is_set()

    def get_current_state(self):
        """Runs in this (host) process when a peer downloads our state."""
        if not self._update_done.wait(self.state_wait_s):
            metadata, tensors, infos = super().get_current_state()
            logger.info("serving the state while our update for epoch %d is still running: labelled epoch %d",
                        metadata["epoch"], metadata["epoch"] - 1)
            return {**metadata, "epoch": max(0, metadata["epoch"] - 1)}, tensors, infos
        return super().get_current_state()


# hivemind names RPC handlers after the class ("TrainingStateAverager.rpc_download_state"): keep
# the name, or peers running the plain class (the coordinator's auxiliary peer) could not reach us.
ConsistentStateAverager.__name__ = ConsistentStateAverager.__qualname__ = TrainingStateAverager.__name__
