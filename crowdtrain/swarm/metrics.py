"""Per-peer training metrics as signed, schema-validated DHT records.

Each peer stores one record under ``{run_id}_metrics`` with its RSA public key as the subkey;
hivemind's ``RSASignatureValidator`` makes every DHT node refuse a change to that subkey not
signed by the owner's private key, and ``SchemaValidator`` refuses records whose fields or types
do not match ``PeerMetrics``. So a peer can only write its own metrics, and only well-formed ones.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from typing import Dict, List

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class PeerMetrics(pydantic.BaseModel):
    peer_id: pydantic.StrictStr
    epoch: pydantic.conint(ge=0, strict=True)  # the global epoch this peer is at
    samples: pydantic.conint(ge=0, strict=True)  # samples this peer contributed since it joined
    samples_per_second: pydantic.confloat(ge=0.0, strict=True)
    loss: pydantic.confloat(strict=True)  # mean local loss since the last record
    steps: pydantic.conint(ge=0, strict=True)
    time: pydantic.confloat(ge=0.0, strict=True)
    client_mode: pydantic.StrictBool
    last_round_peers: pydantic.conint(ge=0, strict=True)  # group size of its last gradient round
    swarm_peers: pydantic.conint(ge=0, strict=True)  # peers reporting progress at that round
    fingerprint: pydantic.StrictStr
    user: pydantic.StrictStr = "anonymous"
    # Where this peer accepts connections (empty in client mode): a restarted coordinator
    # bootstraps its DHT from these instead of starting alone.
    maddrs: List[pydantic.StrictStr] = []


class AccessTokenRecord(pydantic.BaseModel):
    """A peer's access token as published for averagers (see ``crowdtrain.swarm.auth``)."""
    username: pydantic.StrictStr
    public_key: pydantic.StrictStr
    expiration_time: pydantic.StrictStr
    signature: pydantic.StrictStr


class RoundRecord(pydantic.BaseModel):
    """A peer finished a gradient round in a group (see ``SwarmOptimizer``): a peer still looking
    for that round's group was left out, and need not wait out the averaging timeout."""
    epoch: pydantic.conint(ge=0, strict=True)  # the epoch whose round it was
    group_size: pydantic.conint(ge=2, strict=True)


class RunSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, PeerMetrics]
    auth: Dict[BytesWithPublicKey, AccessTokenRecord]
    rounds: Dict[BytesWithPublicKey, RoundRecord]


class CountingSchemaValidator(SchemaValidator):
    """A SchemaValidator that counts the records it refuses (shared across the DHT's fork)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused = mp.Value("q", 0)

    def validate(self, record) -> bool:
        ok = super().validate(record)
        if not ok:
            with self.refused.get_lock():
                self.refused.value += 1
        return ok


def make_validators(run_id: str) -> tuple[list, RSASignatureValidator]:
    """Record validators every peer of a run installs in its DHT, and this peer's signer.

    The first is a :class:`CountingSchemaValidator`: ``validators[0].refused.value`` is how many
    malformed records this peer's DHT has refused so far."""
    signer = RSASignatureValidator()
    return [CountingSchemaValidator(RunSchema, prefix=run_id), signer], signer


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def publish(dht: hivemind.DHT, run_id: str, signer: RSASignatureValidator, metrics: PeerMetrics,
            *, expiration_s: float = 60.0) -> None:
    """Store this peer's record (in the background; a failed store is retried by the next one)."""
    dht.store(key=metrics_key(run_id), subkey=signer.local_public_key, value=metrics.dict(),
              expiration_time=get_dht_time() + expiration_s, return_future=True)


def fetch(dht: hivemind.DHT, run_id: str, *, timeout_s: float = 10.0) -> list[PeerMetrics]:
    """All live peers' latest records; malformed ones (already refused by validators) are skipped."""
    try:
        found = dht.get(metrics_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # a slow or partitioned DHT: report nothing this time
        logger.debug("could not read metrics: %r", e)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, entry in found.value.items():
        try:
            records.append(PeerMetrics.parse_obj(entry.value))
        except pydantic.ValidationError as e:
            logger.warning("dropped a malformed metrics record: %s", e)
    return records



def rounds_key(run_id: str) -> str:
    return f"{run_id}_rounds"


def publish_round(dht: hivemind.DHT, run_id: str, signer: RSASignatureValidator, *, epoch: int, group_size: int,
                  expiration_s: float = 120.0):
    """Announce (in the background) that this peer finished epoch ``epoch``'s gradient round; the
    store's future (a peer about to leave waits for it, or the record leaves with it)."""
    record = RoundRecord(epoch=epoch, group_size=group_size)
    return dht.store(key=rounds_key(run_id), subkey=signer.local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + expiration_s, return_future=True)


def largest_finished_group(dht: hivemind.DHT, run_id: str, epoch: int, *, timeout_s: float = 2.0,
                           or_later: bool = False) -> int:
    """The largest group any peer reports having finished epoch ``epoch``'s round in (``or_later``:
    that round or a later one; a peer's record holds only its latest round); 0 if none."""
    try:
        found = dht.get(rounds_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # a slow DHT: no evidence this time
        logger.debug("could not read finished rounds: %r", e)
        return 0
    if found is None or not isinstance(found.value, dict):
        return 0
    sizes = [0]
    for entry in found.value.values():
        try:
            record = RoundRecord.parse_obj(entry.value)
        except pydantic.ValidationError:
            continue
        if record.epoch == epoch or (or_later and record.epoch > epoch):
            sizes.append(record.group_size)
    return max(sizes)
