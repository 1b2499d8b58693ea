"""Robust aggregation inside hivemind's butterfly all-reduce: no single aggregator is trusted.

In a butterfly all-reduce every peer reduces one slice of the vector: each groupmate sends it
that slice (its "part"), the peer combines the parts and sends the result back. Here each
peer combines the parts it receives with the run's ``aggregation`` rule instead of a plain
weighted sum, so an attacker that sends crafted tensors is filtered by every honest reducer,
for gradients (sync mode) and pseudo-gradients (DiLoCo mode) alike:

- ``mean``: the weighted mean (weights = samples), hivemind's behaviour;
- ``centered_clip``: Karimireddy, He & Jaggi 2020, "Learning from History for Byzantine Robust
  Optimization": start from the coordinate-wise median and repeat ``clip_iterations`` times
  ``v += sum_i w_i * (x_i - v) * min(1, tau / |x_i - v|) / sum_i w_i``. One sender moves the
  result by at most about ``tau * its weight share`` per iteration, whatever it sends.

Whatever the rule, a part with a NaN or inf is dropped outright (with its weight).

Suspects (:class:`SuspectPeers`): a sender most of whose parts a reducer dropped, or (with
``centered_clip``) judged outliers, in a round is suspect to that peer until a round in which
its parts look normal. Meanwhile the peer's reducer leaves the suspect's parts out (it still
judges them), and its progress tracker does not count the suspect's samples toward the target
batch, so honest peers process the whole target each round.

Tuning by symptom:
- The loss falls more slowly than with ``mean`` and no attacker: honest parts are being
  clipped; raise ``clip_radius`` (it is a multiple of the median distance of the parts from
  their coordinate-wise median, so 1.0 leaves about half the honest parts unclipped).
- An attacker still drags the loss up: lower ``clip_radius`` or raise ``clip_iterations``.
- An honest peer is logged as suspect ("sent parts that were non-finite or far outside the
  others'"), so rounds take longer: raise ``outlier_distance``. An attacker never logged as
  suspect keeps its samples counted: lower it (not below about 2).

Limits: a reducer filters what it receives; a malicious *reducer* can still return a wrong
result for the slice it reduces (BTARD, Gorbunov et al. 2021, adds checks for that), and the
weight a sender claims (its sample count) is taken at its word.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import multiprocessing as mp
import time
from typing import AsyncIterator, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, amap_in_executor, as_aiter, azip
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from crowdtrain.swarm.config import SwarmConfig

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the rules


def _middle(sorted_values: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 of values sorted along dim 0 (mean of the two middle ones when even)."""
    n = sorted_values.shape[0]
    return (sorted_values[(n - 1) // 2] + sorted_values[n // 2]) / 2


def coordinate_median(parts: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``parts`` [n, d] (mean of the two middle values when n is even).

    A group has few senders: an odd-even transposition network of elementwise min/max (n passes)
    is about 10x faster than ``torch.sort`` along a short dim 0 for n <= 16.
    """
    n = parts.shape[0]
    if n > 16:
        return _middle(parts.sort(dim=0).values)
    rows = list(parts.unbind(0))
    for step in range(n):
        for i in range(step % 2, n - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return (rows[(n - 1) // 2] + rows[n // 2]) / 2


def centered_clip(parts: torch.Tensor, weights: torch.Tensor, *, radius: float, iterations: int,
                  init: torch.Tensor | None = None) -> torch.Tensor:
    """Centered clipping of ``parts`` [n, d] with ``weights`` [n]; returns the estimate [d].

    Starts from ``init`` (default: the coordinate-wise median). Each iteration moves the
    estimate by the weighted mean of the differences, each difference clipped to L2 norm
    ``radius``. With a radius larger than every distance one iteration gives the weighted mean.
    """
    if parts.dim() != 2 or weights.shape != parts.shape[:1]:
        raise ValueError(f"parts must be [n, d] and weights [n], got {tuple(parts.shape)} and {tuple(weights.shape)}")
    if radius <= 0 or iterations < 1:
        raise ValueError(f"radius must be > 0 and iterations >= 1, got {radius} and {iterations}")
    weights = weights.to(parts.dtype)
    total = weights.sum()
    estimate = coordinate_median(parts) if init is None else init.to(parts.dtype)
    for _ in range(iterations):
        diff = parts - estimate  # [n, d]
        norms = diff.norm(dim=1)
        scale = torch.where(norms > radius, radius / norms.clamp_min(1e-30), torch.ones_like(norms))
        estimate = estimate + (weights * scale) @ diff / total
    return estimate


class Aggregator:
    """Combines the parts of one slice sent by a group's members. Parts are finite and have weight > 0."""

    name = "base"

    def aggregate(self, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
        raise NotImplementedError

    def judge(self, parts: Sequence[torch.Tensor]) -> list[bool]:
        """For every part, whether it is an outlier (this rule judges none)."""
        return [False] * len(parts)

    def aggregate_and_judge(self, parts: Sequence[torch.Tensor], weights: Sequence[float]
                            ) -> tuple[torch.Tensor, list[bool]]:
        """:meth:`aggregate` and :meth:`judge` of the same parts (a rule may share work between them)."""
        return self.aggregate(parts, weights), self.judge(parts)


class MeanAggregator(Aggregator):
    name = "mean"

    def aggregate(self, parts, weights):
        total = torch.zeros_like(parts[0], dtype=torch.float32)
        for part, weight in zip(parts, weights):
            total.add_(part.float(), alpha=weight)
        return total.div_(sum(weights))


class CenteredClipAggregator(Aggregator):
    """Centered clip with a radius relative to the parts' spread (scale-free: gradients and
    pseudo-gradients differ by orders of magnitude): ``tau = clip_radius * median_i |x_i - median|``.

    A part is judged an outlier (see :class:`SuspectPeers`) if it lies farther than
    ``outlier_distance`` median distances from the median, or points away from it (negative dot
    product). In bench_robust's runs on ``tiny`` (slices of about 10^4 values), an honest part was
    more than 4 median distances away in at most 3% of slices (0% in DiLoCo mode, with peers of
    batch 8, 16 and 32 too), and pointed away in at most 9% (sync mode's noisy gradients; 0.3% in
    DiLoCo mode). Crafted parts: scaled, noise and bias ones were far in every slice, sign-flipped
    ones pointed away in 93%."""

    name = "centered_clip"

    def __init__(self, *, clip_radius: float = 1.0, clip_iterations: int = 3, outlier_distance: float = 4.0,
                 max_weight_ratio: float = 4.0):
        self.clip_radius, self.clip_iterations = clip_radius, clip_iterations
        self.outlier_distance, self.max_weight_ratio = outlier_distance, max_weight_ratio

    def aggregate(self, parts, weights):
        return self.aggregate_and_judge(parts, weights)[0]

    def judge(self, parts):
        if len(parts) == 1:
            return [False]
        return self._judge(*self._spread(parts))

    def aggregate_and_judge(self, parts, weights):
        if len(parts) == 1:
            return parts[0].float(), [False]
        stack, start, distances, spread = self._spread(parts)
        outliers = self._judge(stack, start, distances, spread)
        # A median distance of 0 means most parts equal the median: keep it (tiny radius).
        tau = max(self.clip_radius * spread, 1e-30)
        result = centered_clip(stack, self.capped(weights, outliers), radius=tau, iterations=self.clip_iterations,
                               init=start)
        return result.reshape(parts[0].shape), outliers

    def capped(self, weights: Sequence[float], outliers: Sequence[bool]) -> torch.Tensor:
        """The weights (each sender's claimed sample count) the clipping uses: at most
        ``max_weight_ratio`` times their median, and an outlier's at most the median. Clipping bounds
        how far a part pulls the estimate at each step, its weight's share how much of that step it
        gets: a claim of 1000x would otherwise carry the estimate ``clip_iterations`` radii its way."""
        weights = torch.tensor(weights, dtype=torch.float32)
        median = float(_middle(weights.sort().values))
        limits = torch.tensor([median if outlier else self.max_weight_ratio * median for outlier in outliers])
        return torch.minimum(weights, limits)

    @staticmethod
    def _spread(parts):
        """The parts stacked [n, d], their coordinate-wise median, distances from it, median distance."""
        stack = torch.stack([p.float().reshape(-1) for p in parts])
        start = coordinate_median(stack)
        distances = (stack - start).norm(dim=1)
        return stack, start, distances, float(_middle(distances.sort().values))

    def _judge(self, stack, start, distances, spread) -> list[bool]:
        far = distances > self.outlier_distance * spread if spread > 0 else torch.zeros(len(stack), dtype=torch.bool)
        return (far | (stack @ start < 0)).tolist()


AGGREGATORS = {MeanAggregator.name: MeanAggregator, CenteredClipAggregator.name: CenteredClipAggregator}


def make_aggregator(config: SwarmConfig) -> Aggregator:
    if config.aggregation == "centered_clip":
        return CenteredClipAggregator(clip_radius=config.clip_radius, clip_iterations=config.clip_iterations,
                                      outlier_distance=config.outlier_distance,
                                      max_weight_ratio=config.max_weight_ratio)
    return AGGREGATORS[config.aggregation]()


# ----------------------------------------------------------------------------- counters


class WireStats:
    """Counters shared with the averager's background process (hivemind averagers are processes)."""

    # elements_missing: elements of our result that a failed reducer never sent (we kept our own).
    # group_lookups: reads of the group's matchmaking key from the DHT (see ``throttle_group_lookups``).
    # parts_outlying: finite parts judged outliers (``Aggregator.aggregate_and_judge``).
    # suspects_found: senders judged suspect, summed over rounds (see ``SuspectPeers``).
    # parts_of_suspects_left_out: finite parts of suspects not aggregated.
    # weight_averaged: per round, the senders' weights (samples) in the first part this peer
    # reduced, summed over rounds: what the rounds averaged, seen from the aggregation side.
    FIELDS = ("bytes_sent", "aggregate_s", "parts_dropped", "parts_reduced", "rounds", "elements_missing",
              "group_lookups", "parts_outlying", "suspects_found", "parts_of_suspects_left_out",
              "weight_averaged")

    def __init__(self):
        self._values = mp.Array(ctypes.c_double, len(self.FIELDS))

    def add(self, **amounts: float) -> None:
        with self._values.get_lock():
            for name, amount in amounts.items():
                self._values[self.FIELDS.index(name)] += amount

    def snapshot(self) -> dict:
        with self._values.get_lock():
            values = list(self._values)
        out = dict(zip(self.FIELDS, values))
        for name in self.FIELDS:
            if name != "aggregate_s":  # seconds; every other field counts
                out[name] = int(out[name])
        return out


class SuspectPeers:
    """Peers whose parts this peer's reducer threw out in their latest round, shared between the
    averager's process (which judges) and the trainer's (whose progress tracker reads it).

    A sender is suspect after a round in which most of the parts it sent us were non-finite or
    outliers (:meth:`Aggregator.aggregate_and_judge`), and stops being so after a round in which
    most were not. A suspect's samples do not count toward the swarm's target batch
    (:class:`SuspectAwareProgressTracker`): an attacker that reports honest progress while
    sending crafted tensors would otherwise make every round stop short of the target by its
    share, and the honest peers train on that much less data (in bench_robust's DiLoCo runs,
    a quarter). The reducer also leaves a suspect's parts out (clipping bounds a crafted part's
    pull but does not remove it; a constant bias still added up over rounds), unless suspects
    are half the senders or more. A false suspicion costs one round of that peer's contribution
    to the slice, and a round that waits for more samples from the others.
    """

    # Peers (more suspects at once are not recorded); bytes per peer ID (libp2p IDs are 34-38 bytes).
    CAPACITY, SLOT = 256, 64

    def __init__(self):
        self._slots = mp.Array(ctypes.c_char, self.CAPACITY * self.SLOT)  # length byte + ID, zero length: free

    def _entries(self) -> list[bytes]:
        raw = self._slots.raw
        return [raw[i + 1:i + 1 + raw[i]] for i in range(0, len(raw), self.SLOT)]

    def snapshot(self) -> frozenset[bytes]:
        with self._slots.get_lock():
            return frozenset(e for e in self._entries() if e)

    def update(self, verdicts: dict[bytes, bool]) -> None:
        """Mark each peer of ``verdicts`` suspect (True) or not (False)."""
        with self._slots.get_lock():
            entries = self._entries()
            for peer, suspect in verdicts.items():
                if len(peer) >= self.SLOT:
                    raise ValueError(f"a peer ID of {len(peer)} bytes does not fit a {self.SLOT}-byte slot")
                if suspect and peer not in entries and b"" in entries:
                    entries[entries.index(b"")] = peer
                elif not suspect and peer in entries:
                    entries[entries.index(peer)] = b""
            self._slots.raw = b"".join(bytes([len(e)]) + e.ljust(self.SLOT - 1, b"\0") for e in entries)


class SuspectAwareProgressTracker(ProgressTracker):
    """hivemind's progress tracker, not counting the samples (nor the speed) of peers in
    ``suspects``; they still count as peers, and their epochs as epochs."""

    def __init__(self, *args, suspects: SuspectPeers, **kwargs):
        self.suspects = suspects  # before the tracker's thread starts
        super().__init__(*args, **kwargs)

    def refresh(self) -> None:
        """Read the swarm's progress now instead of at the next scheduled fetch (which, while no
        other peer was seen, is a refresh period away). Raises what the DHT raises."""
        found = self.dht.get(self.training_progress_key, latest=True)
        with self.lock_global_progress:
            self.global_progress = self._parse_swarm_progress_data(
                found.value if isinstance(found, ValueWithExpiration) else None)

    def _parse_swarm_progress_data(self, metadata):
        suspects = self.suspects.snapshot()
        if suspects and isinstance(metadata, dict):
            metadata = {key: self._discount(entry, suspects) for key, entry in metadata.items()}
        return super()._parse_swarm_progress_data(metadata)

    @staticmethod
    def _discount(entry, suspects: frozenset[bytes]):
        record = getattr(entry, "value", None)
        if not isinstance(record, dict) or record.get("peer_id") not in suspects:
            return entry
        return ValueWithExpiration({**record, "samples_accumulated": 0, "samples_per_second": 0.0},
                                   entry.expiration_time)


# ----------------------------------------------------------------------------- hivemind plumbing


def finite_part(part: torch.Tensor) -> bool:
    """True if ``part`` holds no NaN or inf. A NaN or inf makes the sum NaN or inf, so a finite sum
    settles it in one vectorized pass (30x faster than an elementwise check, which took an eighth
    of an averager's CPU); a sum that overflows falls back to the elementwise check."""
    return bool(torch.isfinite(part.sum())) or bool(torch.isfinite(part).all())


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
    of the current slice and hands them to an :class:`Aggregator` once every live sender sent it."""

    def __init__(self, part_shapes, num_senders: int, *, aggregator: Aggregator, stats: WireStats,
                 suspect_senders: frozenset[int] = frozenset()):
        self.aggregator, self.stats = aggregator, stats
        self.suspect_senders = suspect_senders  # indices of senders suspect since an earlier round
        self._senders: dict[int, int] = {}
        self.parts_judged = [0] * num_senders  # per sender, this round
        self.parts_rejected = [0] * num_senders  # non-finite or outliers
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
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            result = self._reduce(self.accumulator, self.part_shapes[self.current_part_index])
            self.current_part_future.set_result(result)
            self.reset_accumulators()

    def _reduce(self, collected: _PartCollector, shape) -> torch.Tensor:
        t0 = time.perf_counter()
        finite = [finite_part(p) for p in collected.parts]
        usable = [i for i, (w, ok) in enumerate(zip(collected.weights, finite)) if ok and w > 0]
        # Suspects' parts are judged (so a suspicion can end) but left out, while the others are a majority.
        trusted = [i for i in usable if collected.sender_indices[i] not in self.suspect_senders]
        kept = trusted if 2 * len(trusted) > len(usable) else usable
        outlying = set()
        if usable:
            parts, weights = [collected.parts[i] for i in kept], [collected.weights[i] for i in kept]
            if len(kept) < len(usable):  # the result from the trusted parts, the judgement of all
                result = self.aggregator.aggregate(parts, weights)
                judged = self.aggregator.judge([collected.parts[i] for i in usable])
            else:
                result, judged = self.aggregator.aggregate_and_judge(parts, weights)
            outlying = {i for i, outlier in zip(usable, judged) if outlier}
        else:  # nobody sent a usable part (only NaN, or only zero weights): change nothing we can trust
            result = torch.zeros(shape)
        for i, sender in enumerate(collected.sender_indices):
            if sender >= 0 and (collected.weights[i] > 0 or not finite[i]):  # zero weight: an aux peer
                self.parts_judged[sender] += 1
                self.parts_rejected[sender] += not finite[i] or i in outlying
        first = self.current_part_index == 0
        self.stats.add(aggregate_s=time.perf_counter() - t0, parts_dropped=finite.count(False), parts_reduced=1,
                       parts_outlying=len(outlying), parts_of_suspects_left_out=len(usable) - len(kept),
                       weight_averaged=sum(collected.weights[i] for i in kept) if first and usable else 0.0)
        return result


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

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id or not self.results_as_values:
            return await super()._communicate_with_peer(peer_id)
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

    # See ``rpc_aggregate_part``. Off for DiLoCo's averager: with it, 2 of 2 CI runs of the DiLoCo
    # test failed (once two peers of one round held different bits, neither flagged diverged);
    # not yet understood.
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
        self.wire_stats.add(rounds=1, elements_missing=runner.tensor_part_container.failed_size)


@functools.lru_cache(maxsize=None)
def robust_averager_class(base: type) -> type:
    """``base`` with :class:`RobustAveragerMixin`. The class keeps ``base``'s name on purpose:
    hivemind names RPC handlers after the class, so a renamed class could not exchange state
    with peers running the plain one (e.g. the coordinator's auxiliary peer)."""
    return type(base.__name__, (RobustAveragerMixin, base), {"__module__": __name__,
                                                              "__qualname__": base.__qualname__})


class RobustOptimizerMixin:
    """For hivemind.Optimizer subclasses: gradient and state averagers aggregate robustly.

    Gradients get the run's aggregation rule with results as values (every peer applies the same
    bits); parameter averaging gets the same rule on differences. ``attack`` applies to what this
    peer sends for gradients only.
    """

    def __init__(self, *args, aggregator: Aggregator | None = None, attack=None, **kwargs):
        self._aggregator = aggregator or MeanAggregator()
        self._attack = attack
        self._averager_opts = dict(kwargs.get("averager_opts") or {})
        # Judged in gradient rounds only (the state averager gets none): parameters of a peer that
        # missed a round differ honestly.
        self.suspects = SuspectPeers()
        super().__init__(*args, **kwargs)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return SuspectAwareProgressTracker(
            dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, suspects=self.suspects, start=True, **kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        from hivemind.optim.grad_averager import GradientAverager

        # hivemind gives ``averager_opts`` to the state averager only: without them the gradient
        # averager kept hivemind's 3 s request_timeout, not below a 3 s matchmaking time (which
        # hivemind warns can deadlock matchmaking), and ignored ``min_group_size`` (centered_clip's
        # groups of three).
        for name in ("request_timeout", "min_group_size"):
            if name in self._averager_opts:
                kwargs.setdefault(name, self._averager_opts[name])
        factory = factory if factory is not None else GradientAverager
        if isinstance(factory, type):
            # Nobody downloads a gradient averager's state (SwarmOptimizer.load_state_from_peers),
            # so it does not declare itself a donor in the DHT (hivemind's default, every round).
            factory = functools.partial(robust_averager_class(factory), aggregator=self._aggregator,
                                        attack=self._attack, results_as_values=True, suspects=self.suspects,
                                        allow_state_sharing=False)
        return super()._make_gradient_averager(factory, **kwargs)

    def _make_state_averager(self, **kwargs):
        # hivemind.Optimizer._make_state_averager, with the robust class, serving consistent states.
        from crowdtrain.swarm.auth import guarded
        from crowdtrain.swarm.state import ConsistentStateAverager

        return robust_averager_class(guarded(ConsistentStateAverager, getattr(self, "access_guard", None)))(
            aggregator=self._aggregator, state_wait_s=0.5,
            dht=self.dht, prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time, allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout, offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer, status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout, client_mode=self.client_mode, auxiliary=self.auxiliary,
            start=True, **getattr(self, "_state_uploads", {}), **kwargs)

    def averaging_stats(self) -> dict:
        """Bytes this peer sent in averaging rounds (compressed, as serialized) and reducer time."""
        parts = {"gradients": self.grad_averager, "state": self.state_averager}
        stats = {name: averager.wire_stats.snapshot() for name, averager in parts.items()
                 if averager is not None and hasattr(averager, "wire_stats")}
        stats["bytes_sent"] = sum(s["bytes_sent"] for s in stats.values())
        return stats
