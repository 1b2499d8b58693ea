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

import asyncio
import logging
import math
import multiprocessing as mp
import random
import re
import threading
import time
from typing import AsyncIterator

import torch
from hivemind.compression import CompressionInfo, TensorRole, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.optim.state_averager import TrainingStateAverager, dump_optimizer_state

from crowdtrain.swarm.hivemind_seam.records import state_offers_key

logger = logging.getLogger(__name__)

# The line a downloader logs after each state it receives (hivemind's wording); tests and
# benchmarks read who served which newcomer from it.
DOWNLOADED_FROM = re.compile(r"Finished downloading state in ([0-9.]+)s from (\S+)")


def set_state_epoch(averager, epoch: int) -> None:
    """Label a state keeper's state (one that never steps: the coordinator's auxiliary peer) as
    epoch ``epoch``, and move its learning-rate scheduler there, as hivemind does after a download."""
    averager.local_epoch = epoch
    if isinstance(averager, TrainingStateAverager):  # DiLoCo's state keeper has a constant outer rate
        averager._update_scheduler()


class StateUploadLimit:
    """A hivemind averager that sends at most ``max_state_uploads`` states at a time. Asked for
    one more, it answers with an empty stream, which hivemind's downloader takes as "this peer does
    not share its state" and tries the next peer on its list: a storm of newcomers spreads over the
    donors instead of queueing on one uplink. Every peer with the state ranks equally, ties broken
    at random; on a slow link a download lasts minutes, so a donor chosen by two newcomers halves
    both downloads unless the second moves on.

    ``upload_delay_s`` (fault injection for tests: ``join --inject-fault slow-upload=S``) holds each
    upload that long before sending, as a slow uplink would.

    ``distrusted`` (the peers this peer's reducers found sending outliers, shared with them; by
    default the robust averager's own ``suspects``): donors asked last. Robust aggregation
    bounds what a malicious peer's gradients can do, but a downloaded state replaces the model
    whole, so the state of a peer caught sending crafted parts is taken only when no other peer
    offers one, even an older one."""

    def __init__(self, *args, max_state_uploads: int = 2, upload_delay_s: float = 0.0, distrusted=None, **kwargs):
        self.max_state_uploads, self.upload_delay_s = max_state_uploads, upload_delay_s
        self.distrusted = distrusted
        self._uploads = 0  # counted in the averager's process, whose event loop serves the requests
        # Shared with the host process (made before the averager's process starts).
        self.uploads_sent, self.uploads_turned_away = mp.Value("q", 0), mp.Value("q", 0)
        self.states_loaded = mp.Value("q", 0)  # downloads that returned a state (busy donors: none)
        super().__init__(*args, **kwargs)

    # Annotated: hivemind registers RPC handlers by their request and response types.
    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self._uploads >= self.max_state_uploads:
            with self.uploads_turned_away.get_lock():
                self.uploads_turned_away.value += 1
            return
        self._uploads += 1
        try:
            if self.upload_delay_s > 0:
                await asyncio.sleep(self.upload_delay_s)
            sent = False
            async for message in super().rpc_download_state(request, context):
                sent = True
                yield message
            if sent:
                with self.uploads_sent.get_lock():
                    self.uploads_sent.value += 1
        finally:
            self._uploads -= 1

    def download_state(self, *, timeout: float | None = None, min_epoch: int = 0):
        """What hivemind's ``DecentralizedAverager.load_state_from_peers`` does (``(metadata,
        tensors)`` or None), asking only donors that offer a state of ``min_epoch`` or newer: a
        peer that needs this epoch's state would only throw an older one away after downloading
        it. (A subclass's ``load_state_from_peers``, such as TrainingStateAverager's, which loads
        what it gets into the model, is not involved.)"""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_from_peers", [], dict(timeout=timeout, future=future,
                                                                   min_epoch=int(min_epoch))))
        return future.result(timeout=timeout)

    async def _load_state_from_peers(self, future, timeout: float | None = None, min_epoch: int = 0):
        """hivemind 1.1.12's ``DecentralizedAverager._load_state_from_peers`` (the downloader, in
        the averager's process), with two changes. If a donor of the newest epoch turned us away
        (busy, see above), answer "nothing loaded" instead of going down the list to an older
        state, such as the coordinator's last checkpoint. The caller asks again a moment later,
        when a donor has a free slot. Older states are still taken when the newest epoch's donors
        failed (left, unreachable) rather than being busy, but never one offered below
        ``min_epoch``. Canary: tests/test_state_uploads.py, which fails if a busy donor's empty
        answer stops meaning "next donor" or the fallback returns."""
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            key_manager = self._matchmaking.group_key_manager
            found, _ = self.dht.get(state_offers_key(key_manager.prefix), latest=True) or ({}, None)
            priority = {PeerID(peer_id): (float(info.value), random.random())  # ties broken at random
                        for peer_id, info in (found.items() if isinstance(found, dict) else ())
                        if isinstance(info, ValueWithExpiration) and isinstance(info.value, (float, int))
                        and math.isfinite(info.value)}
            suspects = self.distrusted if self.distrusted is not None else getattr(self, "suspects", None)
            distrusted = suspects.snapshot() if suspects is not None else frozenset()
            ranked = [peer for peer in sorted(priority, key=lambda p: (p.to_bytes() in distrusted,
                                                                       tuple(-x for x in priority[p])))
                      if peer != self.peer_id]
            if not ranked:
                logger.info("no peer offers its state")
                return
            older = [peer for peer in ranked if math.floor(priority[peer][0]) < min_epoch]
            ranked = [peer for peer in ranked if peer not in older]
            if not ranked:
                logger.debug("no peer offers a state of epoch %d or newer (%d offer older ones)", min_epoch,
                             len(older))
                return
            newest = math.floor(priority[ranked[0]][0])
            busy = 0
            for peer in ranked:
                suspect = peer.to_bytes() in distrusted
                if busy and (math.floor(priority[peer][0]) < newest or suspect):
                    logger.info("%d donor(s) of the newest state (epoch %d) are busy; asking again shortly "
                                "rather than taking an older state", busy, newest)
                    return
                t0 = time.monotonic()
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata, parts, tensors = None, [], []
                    async for message in aiter_with_timeout(stream, timeout=timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # the start of the next tensor
                            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                    if not metadata:
                        busy += math.floor(priority[peer][0]) >= newest
                        logger.debug("peer %s did not send its state (busy or not sharing)", peer)
                        continue
                    logger.info("Finished downloading state in %.3fs from %s", time.monotonic() - t0, peer)
                    if suspect:
                        logger.warning("the state came from peer %s, whose parts were outliers in its last round "
                                       "with this peer: no other peer offered one", peer)
                    with self.states_loaded.get_lock():
                        self.states_loaded.value += 1
                    future.set_result((metadata, tensors))
                    return
                except Exception as e:  # it left, or its link failed: the next one
                    logger.debug("could not download the state from %s: %r", peer, e)
        finally:
            if not future.done():
                future.set_result(None)

    def upload_stats(self) -> dict:
        return {"sent": int(self.uploads_sent.value), "turned_away": int(self.uploads_turned_away.value)}


class ConsistentStateAverager(StateUploadLimit, TrainingStateAverager):
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
