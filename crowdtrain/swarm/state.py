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

The state served is a copy taken under the optimizer's lock. hivemind serves the live tensors and
compresses each one only when the stream reaches it, so a download that lasts minutes over a home
link got a mix of every epoch it spanned (and a tensor read while the optimizer wrote it), all
under the first epoch's number.
"""

from __future__ import annotations

import logging
import threading

import torch
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state

logger = logging.getLogger(__name__)


class ConsistentStateAverager(TrainingStateAverager):
    """hivemind's TrainingStateAverager whose served state always matches its epoch number."""

    def __init__(self, *args, state_wait_s: float = 0.5, **kwargs):
        self.state_wait_s = state_wait_s
        self._update_done = threading.Event()  # the delayed update (step and its rounds) has ended
        self._update_done.set()
        self._step_applied = threading.Event()  # the delayed update's optimizer step has run
        self._step_applied.set()
        self._epoch_before_update = 0
        super().__init__(*args, **kwargs)
        self.optimizer.register_step_post_hook(lambda *_: self._step_applied.set())

    def step(self, *args, optimizer_step: bool = False, delay_optimizer_step: bool = False,
             increment_epoch: bool = False, **kwargs):
        if optimizer_step and delay_optimizer_step:
            # Cleared before the epoch is incremented: from here until the background step has
            # run, our parameters are the previous epoch's.
            self._epoch_before_update = self.local_epoch
            self._step_applied.clear()
            self._update_done.clear()
        try:
            return super().step(*args, optimizer_step=optimizer_step, delay_optimizer_step=delay_optimizer_step,
                                increment_epoch=increment_epoch, **kwargs)
        except BaseException:
            self._step_applied.set()
            self._update_done.set()
            raise

    def _do(self, wait_for_trigger, optimizer_step, *args, **kwargs):
        try:
            return super()._do(wait_for_trigger, optimizer_step, *args, **kwargs)
        finally:
            if optimizer_step:  # also when it failed: what we hold is then what we serve
                self._step_applied.set()
                self._update_done.set()

    def update_in_flight(self) -> bool:
        return not self._update_done.is_set()

    def get_current_state(self):
        """Runs in this (host) process when a peer downloads our state: a copy, labelled with the
        epoch its parameters belong to."""
        self._update_done.wait(self.state_wait_s)  # give an update in flight a moment to end
        # The optimizer's lock: no step half-way through what we copy; the tensors' lock: no
        # state download or averaging round writing them.
        with torch.no_grad(), self.lock_optimizer, self.lock_averaged_tensors:
            params = [_cpu_copy(p) for group in self.optimizer.param_groups for p in group["params"]]
            extras = [_cpu_copy(t) for t in self.extra_tensors]
            optimizer_metadata, optimizer_tensors = dump_optimizer_state(self.optimizer)
            optimizer_tensors = [_cpu_copy(t) for t in optimizer_tensors]
            local_epoch = self.local_epoch
            epoch = local_epoch if self._step_applied.is_set() else self._epoch_before_update
        if epoch != local_epoch:
            logger.info("serving the state while our update for epoch %d is still running: labelled epoch %d",
                        local_epoch, epoch)
        infos = ([CompressionInfo.from_tensor(p, key=key, role=TensorRole.PARAMETER)
                  for p, key in zip(params, self.parameter_names)]
                 + [CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extras)]
                 + [CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
                    for i, t in enumerate(optimizer_tensors)])
        metadata = dict(epoch=epoch, group_bits=self.get_group_bits(), optimizer_metadata=optimizer_metadata)
        return metadata, params + extras + optimizer_tensors, infos


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


# hivemind names RPC handlers after the class ("TrainingStateAverager.rpc_download_state"): keep
# the name, or peers running the plain class (hivemind itself, an older crowdtrain) could not reach us.
ConsistentStateAverager.__name__ = ConsistentStateAverager.__qualname__ = TrainingStateAverager.__name__
