"""hivemind's all-reduce with crowdtrain's aggregation, byte counting and timing fixes.

Everything here subclasses or replaces a hivemind internal; each override is registered in
``crowdtrain.swarm.hivemind_seam.SEAMS`` with the upstream code it replaces and its canary test.
The aggregation itself (which parts count, the rule that combines them, who is suspect) is
:func:`crowdtrain.swarm.robust.combine_slice`, pure torch: the reducer below only collects one
slice's parts from the wire and hands them to it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, amap_in_executor, as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from crowdtrain.swarm.robust import Aggregator, MeanAggregator, SuspectPeers, WireStats, combine_slice

logger = logging.getLogger(__name__)


class _PartCollector:
    """Stands in for TensorPartReducer's running sum: keeps every sender's part until all arrived."""

    def __init__(self, senders: dict[int, int]):
        self._senders = senders  # id(part) -> sender index, filled by the reducer just before add_
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.sender_indices: list[int] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> "_PartCollector":
        self.parts.append(part)
        self.weights.append(float(alpha))
        self.sender_indices.append(self._senders.pop(id(part), -1))
        return self


class RobustTensorPartReducer(TensorPartReducer):
    """hivemind's reducer (same waiting, same handling of failed senders), but it keeps the parts
    of the current slice and hands them to :func:`crowdtrain.swarm.robust.combine_slice` once every
    live sender sent it."""

    def __init__(self, part_shapes, num_senders: int, *, aggregator: Aggregator, stats: WireStats,
                 suspect_senders: frozenset[int] = frozenset()):
        self.aggregator, self.stats = aggregator, stats
        self.suspect_senders = suspect_senders  # indices of senders suspect since an earlier round
        self._senders: dict[int, int] = {}
        self.parts_judged = [0] * num_senders  # per sender, this round
        self.parts_rejected = [0] * num_senders  # non-finite or outliers
        # The senders' weights (samples) in the first part this peer reduced: what the round
        # averaged, seen from the aggregation side (counted by the runner if the round succeeds).
        self.weight_seen = 0.0
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _PartCollector(self._senders)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        self._senders[id(tensor_part)] = sender_index  # for _PartCollector.add_, which hivemind calls
        try:
            return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)
        finally:
            self._senders.pop(id(tensor_part), None)

    def suspects(self) -> list[bool]:
        """Per sender: did most of the parts it sent us this round get rejected?"""
        return [judged > 0 and 2 * rejected > judged for judged, rejected in zip(self.parts_judged,
                                                                                 self.parts_rejected)]

    def check_current_part_finished(self):
        # TensorPartReducer.check_current_part_finished, with the parts handed to the
        # aggregation seam instead of a running sum.
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            t0 = time.perf_counter()
            collected = self.accumulator
            combined = combine_slice(collected.parts, collected.weights, collected.sender_indices,
                                     aggregator=self.aggregator, suspect_senders=self.suspect_senders,
                                     shape=self.part_shapes[self.current_part_index])
            for sender, judged, rejected in zip(collected.sender_indices, combined.judged, combined.rejected):
                if judged:
                    self.parts_judged[sender] += 1
                    self.parts_rejected[sender] += rejected
            if self.current_part_index == 0:
                self.weight_seen = combined.weight_kept
            self.stats.add(aggregate_s=time.perf_counter() - t0, parts_dropped=combined.dropped, parts_reduced=1,
                           parts_outlying=combined.outlying, parts_of_suspects_left_out=combined.suspects_left_out)
            self.current_part_future.set_result(combined.result)
            self.reset_accumulators()


class RobustAllReduceRunner(AllReduceRunner):
    """AllReduceRunner with a robust reducer, byte counting, and optionally results as values.

    ``results_as_values``: a reducer sends back its result (compressed once) instead of hivemind's
    difference from each sender's part, and uses that same compressed result itself, so every
    peer of the group ends with bit-identical tensors (DiLoCo relies on this). Parameter
    averaging keeps differences: they are small and survive 8-bit compression better.
    """

    def __init__(self, *, aggregator: Aggregator, stats: WireStats, results_as_values: bool,
                 fallback_tensors=None, suspects: frozenset[bytes] = frozenset(), **kwargs):
        super().__init__(**kwargs)
        self.stats, self.results_as_values = stats, results_as_values
        self.tensor_part_reducer.finished.set()  # the stock reducer is replaced unused (and must not warn)
        self.tensor_part_reducer = RobustTensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
            aggregator=aggregator, stats=stats,
            suspect_senders=frozenset(i for i, peer in enumerate(self.sender_peer_ids)
                                      if peer.to_bytes() in suspects and peer != self.peer_id))
        # results_as_values: per (part index, compression), the reply every sender gets, encoded
        # once, and how many senders have yet to take it
        self._result_messages: dict[tuple[int, int], tuple[asyncio.Future, int]] = {}
        self.failed_reducers: set = set()  # groupmates whose slice of the average never reached us
        if results_as_values:
            self.tensor_part_container.return_deltas = False  # a failed reducer: keep our own part
            if fallback_tensors is not None:
                self._keep_fallback_on_failure(fallback_tensors, kwargs)

    def _keep_fallback_on_failure(self, fallback_tensors, kwargs) -> None:
        """Where a reducer fails, keep ``fallback_tensors``' slice instead of what we sent (an
        attacker keeps its honest copy). Same shapes and settings, so the same partition."""
        container = self.tensor_part_container
        honest = TensorPartContainer(fallback_tensors, self.peer_fractions,
                                     **{k: kwargs[k] for k in ("compression", "part_size_bytes", "tensor_infos")
                                        if k in kwargs})

        def register_failed_reducer(peer_index: int):
            for part_index in range(container._outputs_registered_by_peer[peer_index],
                                    container.num_parts_by_peer[peer_index]):
                part = honest._input_parts_by_peer[peer_index][part_index][0]
                container.register_processed_part(peer_index, part_index, part)
                container.failed_size += part.numel()

        container.register_failed_reducer = register_failed_reducer

    def sender_verdicts(self) -> dict[bytes, bool]:
        """Per groupmate that sent us parts this round: is it suspect (see :class:`SuspectPeers`)?"""
        reducer = self.tensor_part_reducer
        return {peer.to_bytes(): suspect for peer, suspect, judged in
                zip(self.sender_peer_ids, reducer.suspects(), reducer.parts_judged)
                if judged and peer != self.peer_id}

    def absent_peers(self) -> list:
        """Groupmates absent from this round: they sent our reducer none of their parts and never
        returned their own slice. Their slice is then missing from every member's average, so no
        member holds the whole average and none will report one (a groupmate cut off from us
        alone looks the same; then the others' better state is not waited for, see
        ``crowdtrain.swarm.optimizer``). Empty when this peer reduces no slice (client mode): it
        cannot tell."""
        reducer = self.tensor_part_reducer
        if self.peer_id not in self.sender_peer_ids or reducer.num_parts == 0:
            return []
        return [peer for peer in self.failed_reducers if peer in self.sender_peer_ids
                and reducer.num_parts_received[self.sender_peer_ids.index(peer)] == 0]

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id or not self.results_as_values:
            try:
                return await super()._communicate_with_peer(peer_id)
            except BaseException:
                self.failed_reducers.add(peer_id)
                raise
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        container = self.tensor_part_container
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            result = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                    weight=self.weight)
            # The very message the others get, so every peer holds the same bits.
            info = container._input_parts_by_peer[peer_index][part_index][1]
            message = await self._result_message(part_index, result, _compression_type(container.compression, info))
            container.register_processed_part(peer_index, part_index, deserialize_torch_tensor(message))

    def _result_message(self, part_index: int, result: torch.Tensor, compression: int) -> asyncio.Future:
        """``result`` encoded once for all its takers (hivemind encodes a reply per sender: with
        results as values they would be N copies of the same bytes). Forgotten once every sender
        has taken it."""
        key = (part_index, compression)
        message, due = self._result_messages.pop(key, (None, len(self.sender_peer_ids)))
        if message is None:
            message = asyncio.get_event_loop().run_in_executor(None, serialize_torch_tensor, result, compression)
        if due > 1:
            self._result_messages[key] = (message, due - 1)
        return asyncio.shield(message)  # a taker whose stream is cancelled must not cancel the others'

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            self.stats.add(bytes_sent=message.ByteSize())
            yield message

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        # hivemind's version, returning the result itself when results_as_values, and counting bytes.
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream, max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    result = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                            weight=weight)
                    part_index += 1
                except BannedException:
                    break  # the sender was banned in the meantime: nothing more to aggregate
                if self.results_as_values:
                    serialized = await self._result_message(part_index - 1, result, part_compression)
                else:
                    serialized = await loop.run_in_executor(None, serialize_torch_tensor, result - tensor_part,
                                                            part_compression)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self.stats.add(bytes_sent=message.ByteSize())
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


def _compression_type(compression, info) -> int:
    """The wire compression type ``compression`` gives a tensor described by ``info``."""
    while isinstance(compression, AdaptiveCompressionBase):
        compression = compression.choose_compression(info)
    return compression.compression_type


def throttle_group_lookups(key_manager, *, min_interval: float, stats: WireStats | None = None) -> None:
    """Space out ``key_manager``'s DHT reads of the group key by at least ``min_interval`` seconds.

    While an averager looks for a group and no better leader is known, hivemind's matchmaking
    re-reads the key as soon as the last read returns (``PotentialLeaders.pop_next_leader``): about
    50 reads a second per averager, each a DHT lookup that every other peer answers. With a grad
    and a state averager per peer that took most of a 2-core machine, and groupmates starved of
    CPU missed the all-reduce (partial rounds). Followers reach a leader by calling it, not through
    these reads; they only find a better leader, which a few reads a second do as well."""
    fetch = key_manager.get_averagers
    last = [float("-inf")]

    async def get_averagers(group_key, only_active):
        wait = last[0] + min_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        last[0] = time.monotonic()
        if stats is not None:
            stats.add(group_lookups=1)
        return await fetch(group_key, only_active)

    key_manager.get_averagers = get_averagers


class RobustAveragerMixin:
    """Put before a hivemind averager class in the bases (see :func:`robust_averager_class`).

    ``attack`` (tests and benchmarks only) replaces what this peer sends by crafted tensors;
    the peer still ends with the group's result, like an attacker that wants to stay unnoticed.
    """

    def __init__(self, *args, aggregator: Aggregator | None = None, attack=None, results_as_values: bool = False,
                 suspects: SuspectPeers | None = None, **kwargs):
        # Set before hivemind starts the averager's process (it forks and inherits these).
        self._aggregator = aggregator or MeanAggregator()
        self._attack = attack
        self._results_as_values = results_as_values
        self.wire_stats = WireStats()
        self.suspects = suspects  # None: judge nobody (parameter averaging)
        super().__init__(*args, **kwargs)

    def _record_verdicts(self, verdicts: dict[bytes, bool]) -> None:
        if self.suspects is None:
            return
        before = self.suspects.snapshot()
        self.suspects.update(verdicts)
        for peer, suspect in verdicts.items():
            if suspect != (peer in before):
                logger.warning(
                    "peer %s %s", PeerID(peer),
                    "sent parts that were non-finite or far outside the others' in most of its slices: its "
                    "parts are left out and its samples no longer count toward the swarm's target batch" if suspect
                    else "sent normal parts again: they count again, and so do its samples")
        self.wire_stats.add(suspects_found=sum(verdicts.values()))

    # See ``rpc_aggregate_part``. Off for DiLoCo's averager: with it the DiLoCo test failed, two
    # peers of one round holding different bits with neither flagged diverged (cause unknown).
    wait_for_unstarted_groups = True

    # hivemind makes the matchmaking in the averager's process (``_run_internal``): throttle it there.
    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking) -> None:
        interval = min(1.0, max(0.1, matchmaking.min_matchmaking_time / 10))
        throttle_group_lookups(matchmaking.group_key_manager, min_interval=interval, stats=self.wire_stats)
        self.__dict__["_matchmaking"] = matchmaking

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's part for a group we are in but have not started yet: wait for it to start.

        Groups form ahead of time (hivemind pre-schedules matchmaking); a member registers the group
        only once its own trigger comes (its share of the batch is done), while triggered members
        already send their parts. hivemind waits for an event meant to mark that registration, but
        the end of the previous round sets it again after the new round cleared it, so the early
        parts were refused at once (BAD_GROUP_ID) and the whole group got a partial average (seen
        many times a run in the churn test's debug logs). Wait as long as a groupmate waits for a
        reducer's answer."""
        request = await anext(stream)
        wait = (self.next_chunk_timeout or self.request_timeout) if self.wait_for_unstarted_groups else 0.0
        deadline = time.monotonic() + wait
        while request.group_id not in self._running_groups and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        # DecentralizedAverager._run_allreduce_inplace_ with the robust runner.
        group_id = group_info.group_id if group_id is None else group_id
        sent = list(tensors) if self._attack is None else [self._attack.craft(t.detach().clone()) for t in tensors]
        if self._attack is not None and "weight" in kwargs:
            kwargs["weight"] = kwargs["weight"] * self._attack.weight_factor
        runner = RobustAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=sent, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, aggregator=self._aggregator, stats=self.wire_stats,
            results_as_values=self._results_as_values,
            suspects=self.suspects.snapshot() if self.suspects is not None else frozenset(),
            fallback_tensors=[t.detach().clone() for t in tensors] if self._attack is not None else None, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)

        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, original, update in azip(as_aiter(*tensors), as_aiter(*sent), runner):
                    if self._results_as_values:
                        tensor.copy_(update)
                    else:
                        if original is not tensor:
                            tensor.copy_(original)
                        tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                # Once per round: hivemind sets it per tensor, and each set re-declares this
                # averager as a state donor in the DHT (a store to several DHT peers, about 50 a round).
                self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            # Also after a failed round: what the reducer judged holds.
            self._record_verdicts(runner.sender_verdicts())
        # Counted here, once the round succeeded, rather than by the reducer: a reducer that finished
        # after its round failed for us would add its weight to our next round's.
        self.wire_stats.add(rounds=1, elements_missing=runner.tensor_part_container.failed_size,
                            weight_averaged=runner.tensor_part_reducer.weight_seen,
                            rounds_missing_a_slice=1 if runner.absent_peers() else 0)


@functools.lru_cache(maxsize=None)
def robust_averager_class(base: type) -> type:
    """``base`` with :class:`RobustAveragerMixin`. The class keeps ``base``'s name on purpose:
    hivemind names RPC handlers after the class, so a renamed class could not exchange state
    with peers running the plain one (e.g. the coordinator's auxiliary peer)."""
    return type(base.__name__, (RobustAveragerMixin, base), {"__module__": __name__,
                                                              "__qualname__": base.__qualname__})


