"""Per-peer training metrics as signed, schema-validated DHT records.

Each peer stores one record under ``{run_id}_metrics`` with its signing key (hivemind's
per-process RSA key) as the subkey; hivemind's ``RSASignatureValidator`` makes every DHT node
refuse a change to that subkey not signed by that key, and ``SchemaValidator`` refuses records
whose fields, types or ranges do not match ``PeerMetrics`` (finite numbers, bounded counts, times
and strings). The record also carries the peer's libp2p identity (its public key) and that
identity's signature over the signing key (:func:`endorsement`), which ties the record to
``peer_id``: the peer ID is a hash of the identity.

Every record is input from a stranger: a peer with a token (anyone, in an open run) can store
whatever it likes under its own subkey. So the reader checks what a schema cannot (:func:`screen`):
that the record's ``peer_id`` is its signer's, its time is near the reader's clock, its user is
the one the coordinator issued that peer's token to, and its epoch is not far ahead of the other
peers'. What fails is dropped and counted, by reason.

Tuning: if honest peers' records are dropped for ``time``, their clocks are off by more than
``max_clock_skew_s``: set them with NTP (or raise it); for ``epoch``, a peer ran ahead of the
others by more than ``max_epoch_lead`` epochs, which hivemind's state download should prevent.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Callable, Dict

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain.swarm.auth import peer_id_of

logger = logging.getLogger(__name__)

# Far beyond any honest record, and small enough for every reader: an integer past 2**63 does not
# fit a database column, NaN becomes NULL there, a time past year 9999 breaks date formatting.
MAX_COUNT = 2**53
MAX_LOSS = 1e4  # cross-entropy of a diverged model stays far below
MAX_SAMPLES_PER_SECOND = 1e6
MAX_TIME = 4e9  # the year 2096
Count = pydantic.conint(ge=0, le=MAX_COUNT, strict=True)


class PeerMetrics(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid  # as the DHT's schema check has it

    peer_id: pydantic.constr(strict=True, max_length=128)
    epoch: Count  # the global epoch this peer is at
    samples: Count  # samples this peer contributed since it joined
    samples_per_second: pydantic.confloat(ge=0.0, le=MAX_SAMPLES_PER_SECOND, strict=True, allow_inf_nan=False)
    # Mean local loss since the last record.
    loss: pydantic.confloat(ge=0.0, le=MAX_LOSS, strict=True, allow_inf_nan=False)
    steps: Count
    time: pydantic.confloat(ge=0.0, le=MAX_TIME, strict=True, allow_inf_nan=False)
    client_mode: pydantic.StrictBool
    last_round_peers: Count  # group size of its last gradient round
    swarm_peers: Count  # peers reporting progress at that round
    fingerprint: pydantic.constr(strict=True, max_length=128)
    user: pydantic.constr(strict=True, max_length=64) = "anonymous"
    # Where this peer accepts connections (empty in client mode): a restarted coordinator
    # bootstraps its DHT from these instead of starting alone.
    maddrs: pydantic.conlist(pydantic.constr(strict=True, max_length=256), max_items=16) = []
    # The peer's identity (OpenSSH RSA public key; peer_id is its hash) and its signature over the
    # key that signs this record (see endorsement).
    identity: pydantic.constr(strict=True, max_length=1024) = ""
    identity_proof: pydantic.constr(strict=True, max_length=1024) = ""
    # The peer's Ledger: a random id of this process's run, and since it started, the samples and
    # steps of the global steps its samples went into. Cumulative, so a missed record loses nothing.
    session: pydantic.constr(strict=True, max_length=32) = ""
    credited_samples: Count = 0
    credited_steps: Count = 0


class Ledger:
    """Which of this peer's samples went into a global step: what the leaderboard credits.

    A round credits this peer's weight in it (the samples it accumulated for it; 0 when it tagged
    along) when its gradients were averaged into the group's step: it finished the round in a group
    of two or more, or it was alone in the swarm (a lone peer's step is the swarm's). Not credited:
    a round the others finished without this peer, or one whose result it threw away for the
    group's state. Each peer credits only its own weight, so every sample of a step is credited to
    exactly one peer, once; the leaderboard's total is the sum over steps of what they averaged.

    The counts are cumulative for this process (``session``): the coordinator credits what grew
    since the last record it saw of this session, so a missed record or a coordinator restart
    loses nothing and counts nothing twice, and a restarted peer (a new session) starts from 0."""

    def __init__(self):
        self.session = secrets.token_hex(8)
        self._lock = threading.Lock()
        self.samples = self.steps = 0
        self.entries: list[dict] = []  # per round: epoch, samples (its weight), group size, credited

    def credit(self, *, epoch: int, samples: float, group_size: int, swarm_peers: int,
               discarded: bool = False) -> bool:
        samples = int(samples)
        credited = samples > 0 and not discarded and (group_size >= 2 or swarm_peers <= 1)
        with self._lock:
            if credited:
                self.samples += samples
                self.steps += 1
            self.entries.append({"epoch": epoch, "samples": samples, "group_size": group_size,
                                 "swarm_peers": swarm_peers, "credited": credited})
        return credited

    def record_fields(self) -> dict:
        """The PeerMetrics fields that carry this ledger."""
        with self._lock:
            return {"session": self.session, "credited_samples": self.samples, "credited_steps": self.steps}

    def round_counts(self, now: float) -> "RoundCounts":
        """This session's rounds and those it averaged with nobody although other peers were
        training (a failed round), for :func:`publish_round_counts`."""
        with self._lock:
            apart = sum(e["group_size"] < 2 and e["swarm_peers"] >= 2 for e in self.entries)
            return RoundCounts(session=self.session, time=now, rounds=len(self.entries), rounds_apart=apart)


class RoundHealth:
    """Whether the swarm's rounds are forming, from peers' signed counts of their rounds
    (:class:`RoundCounts`, cumulative per session), over the last
    ``window_s``: the coordinator's view of "Averaging step failed: could not find a group".

    A peer's counts are compared with its own earliest record in the window, so a restarted peer
    (a new session) or a missed record neither hides nor repeats a failure. Only the counts of
    peers whose metrics records passed :func:`screen` are used; a peer can misreport only its own
    rounds."""

    def __init__(self, *, window_s: float = 300.0):
        self.window_s = window_s
        self._seen: dict[tuple[str, str], list[tuple[float, int, int, str]]] = {}  # (peer, session) -> history
        # (peer, epoch) -> (first seen, its last round's group, the swarm then): a peer's rounds
        # in a group of two or more, once per epoch of its metrics records.
        self._groups: dict[tuple[str, int], tuple[float, int, int]] = {}

    def add_groups(self, records: list["PeerMetrics"], *, now: float) -> None:
        """Note each screened metrics record's last round (``last_round_peers`` of
        ``swarm_peers``), once per peer and epoch; rounds averaged with nobody are :meth:`add`'s."""
        for r in records:
            if r.swarm_peers >= 2 and r.last_round_peers >= 2:
                self._groups.setdefault((r.peer_id, r.epoch), (now, r.last_round_peers, r.swarm_peers))
        for key in [k for k, v in self._groups.items() if v[0] < now - self.window_s]:
            del self._groups[key]

    def add(self, counts: dict[str, "RoundCounts"], *, users: dict[str, str], now: float) -> None:
        """``counts``: peer ID to its latest round counts (:func:`round_counts_of`); ``users``:
        peer ID to the user its token was issued to."""
        for peer_id, c in counts.items():
            history = self._seen.setdefault((peer_id, c.session), [])
            if not history or history[-1][0] != c.time:
                history.append((c.time, c.rounds, c.rounds_apart, users.get(peer_id, "anonymous")))
        for key in list(self._seen):
            recent = [h for h in self._seen[key] if h[0] >= now - self.window_s]
            # Keep the last point before the window as its baseline.
            older = [h for h in self._seen[key] if h[0] < now - self.window_s][-1:]
            if recent:
                self._seen[key] = older + recent
            else:
                del self._seen[key]

    def summary(self) -> dict:
        """``{"window_s", "rounds", "apart", "users", ...}``: rounds taken in the window, those
        averaged with nobody, and the users of the peers that had such rounds; of the peers' rounds
        in a group of two or more (:meth:`add_groups`), how many (``grouped``), how many held fewer
        peers than the swarm had (``short``), the median such round's share of the swarm
        (``short_median``) and the largest swarm one was short of (``short_largest_swarm``)."""
        rounds = apart = 0
        users = set()
        for history in self._seen.values():
            first, last = history[0], history[-1]
            # From its first record seen (not from zero: after a coordinator restart, that record
            # holds all the rounds of a peer's session so far, most of them long ago).
            d_rounds, d_apart = max(0, last[1] - first[1]), max(0, last[2] - first[2])
            rounds += d_rounds
            apart += min(d_apart, d_rounds)
            if d_apart:
                users.add(last[3])
        groups = list(self._groups.values())
        short = [(g, n) for _, g, n in groups if g < n]
        return {"window_s": self.window_s, "rounds": rounds, "apart": apart, "users": sorted(users),
                "grouped": len(groups), "short": len(short),
                "short_median": (sorted(g / n for g, n in short)[len(short) // 2] if short else None),
                "short_largest_swarm": max((n for _, n in short), default=0)}


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


class LeavingRecord(pydantic.BaseModel):
    """A peer's process is leaving the run for good (see :func:`publish_leaving`)."""
    time: pydantic.confloat(ge=0.0, le=MAX_TIME, strict=True, allow_inf_nan=False)
    epoch: Count  # the global epoch it leaves at


class RoundCounts(pydantic.BaseModel):
    """A peer's rounds this session (:meth:`Ledger.round_counts`), under the key that signs its
    metrics records."""
    session: pydantic.constr(strict=True, max_length=32)
    time: pydantic.confloat(ge=0.0, le=MAX_TIME, strict=True, allow_inf_nan=False)
    rounds: Count
    rounds_apart: Count


class RunSchema(pydantic.BaseModel):
    metrics: Dict[BytesWithPublicKey, PeerMetrics]
    auth: Dict[BytesWithPublicKey, AccessTokenRecord]
    rounds: Dict[BytesWithPublicKey, RoundRecord]
    # Keys of their own, not fields of PeerMetrics: hivemind's schema check refuses a record that
    # lacks a field (even one with a default) or has one more, so a new field would make peers of
    # two versions refuse each other's metrics. Peers whose schema lacks a key accept records
    # under it (unknown keys are allowed).
    leaving: Dict[BytesWithPublicKey, LeavingRecord]
    round_counts: Dict[BytesWithPublicKey, RoundCounts]


class CountingSchemaValidator(SchemaValidator):
    """A SchemaValidator that counts the records it refuses (shared across the DHT's fork).

    Each stored version of a record is counted once, however often the DHT meets it again (every
    lookup of a key meets every live record under it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused = mp.Value("q", 0)
        self._counted: set = set()  # lives in the DHT's process, where validation runs

    def validate(self, record) -> bool:
        ok = super().validate(record)
        version = (record.key, record.subkey, record.expiration_time)
        if not ok and version not in self._counted:
            if len(self._counted) > 10_000:
                self._counted.clear()
            self._counted.add(version)
            with self.refused.get_lock():
                self.refused.value += 1
        return ok


def make_validators(run_id: str) -> tuple[list, RSASignatureValidator]:
    """Record validators every peer of a run installs in its DHT, and this peer's signer.

    The signer uses hivemind's per-process key, not the identity: a DHT signs with the first
    ``RSASignatureValidator`` it was given (it merges later ones into it), and hivemind's progress
    tracker stores its records under that per-process key. :func:`endorsement` links the two.

    The first is a :class:`CountingSchemaValidator`: ``validators[0].refused.value`` is how many
    malformed records this peer's DHT has refused so far."""
    signer = RSASignatureValidator()
    return [CountingSchemaValidator(RunSchema, prefix=run_id), signer], signer


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def _endorsed(run_id: str, signer_public_key: bytes) -> bytes:
    return b"crowdtrain-metrics-signer-v1\n" + run_id.encode() + b"\n" + signer_public_key


def endorsement(identity: RSAPrivateKey, run_id: str, signer: RSASignatureValidator) -> dict:
    """``identity`` and ``identity_proof`` for this peer's metrics records: its libp2p identity
    vouches for the key that signs them, so a reader can tie a record to ``peer_id``."""
    signer_public_key = re.fullmatch(RSASignatureValidator.PUBLIC_KEY_REGEX, signer.local_public_key).group(1)
    return {"identity": identity.get_public_key().to_bytes().decode(),
            "identity_proof": identity.sign(_endorsed(run_id, signer_public_key)).decode()}


def publish(dht: hivemind.DHT, run_id: str, signer: RSASignatureValidator, metrics: PeerMetrics,
            *, expiration_s: float = 60.0):
    """Store this peer's record (in the background; a failed store is retried by the next one); the
    store's future."""
    return dht.store(key=metrics_key(run_id), subkey=signer.local_public_key, value=metrics.dict(),
                     expiration_time=get_dht_time() + expiration_s, return_future=True)


@dataclass
class StoredRecord:
    """One metrics record as found in the DHT: unvalidated."""
    subkey: object  # b"[owner:<the signer's public key>]" for a well-formed record
    value: object
    expiration_time: float

    @property
    def version(self) -> tuple:
        """Tells stored versions apart (a peer's new record gets a new expiration time), so that a
        bad one seen on every refresh is counted once."""
        return self.subkey if isinstance(self.subkey, bytes) else repr(self.subkey)[:200], self.expiration_time


@dataclass
class Dropped:
    record: StoredRecord
    reason: str  # malformed | not_signer | time | user | epoch
    detail: str


def fetch(dht: hivemind.DHT, run_id: str, *, timeout_s: float = 10.0) -> list[StoredRecord]:
    """All live peers' latest records, unvalidated: pass them through :func:`screen`."""
    try:
        found = dht.get(metrics_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # a slow or partitioned DHT: report nothing this time
        logger.debug("could not read metrics: %r", e)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    return [StoredRecord(subkey, entry.value, entry.expiration_time) for subkey, entry in found.value.items()]


def signer_peer_id(record: PeerMetrics, subkey, run_id: str) -> str | None:
    """The peer ID whose identity vouches for the key that signed a record stored under ``subkey``
    (None if none does): the record's ``peer_id`` must be this."""
    match = re.fullmatch(RSASignatureValidator.PUBLIC_KEY_REGEX, subkey) if isinstance(subkey, bytes) else None
    try:
        identity = record.identity.encode()
        if match and RSAPublicKey.from_bytes(identity).verify(_endorsed(run_id, match.group(1)),
                                                              record.identity_proof.encode()):
            return str(peer_id_of(identity))
    except Exception:  # not an RSA key in OpenSSH encoding: bytes from a stranger
        pass
    return None


def screen(stored: list[StoredRecord], *, run_id: str, now: float, user_of: Callable[[list[str]], dict[str, str]],
           floor_epoch: int = 0, max_clock_skew_s: float = 300.0,
           max_epoch_lead: int = 10) -> tuple[list[PeerMetrics], list[Dropped]]:
    """The records that pass every check, and the dropped ones with their reasons.

    ``user_of``: peer IDs to the user names the coordinator issued their tokens to. An epoch is
    compared with the lower median of the records' epochs (at least ``floor_epoch``), so one peer
    cannot move the reference and a lone peer is its own reference.
    """
    passed, dropped = [], []
    for item in stored:
        try:
            record = PeerMetrics.parse_obj(item.value)
        except (pydantic.ValidationError, TypeError) as e:
            dropped.append(Dropped(item, "malformed", str(e).replace("\n", " ")[:300]))
            continue
        signer = signer_peer_id(record, item.subkey, run_id)
        if record.peer_id != signer:
            dropped.append(Dropped(item, "not_signer", f"record for peer {record.peer_id[:60]!r} signed by "
                                                       f"{signer or 'a key no identity vouches for'}"))
        elif not abs(record.time - now) <= max_clock_skew_s:
            dropped.append(Dropped(item, "time", f"peer {signer}: time {record.time:.0f} is "
                                                 f"{record.time - now:+.0f} s from this clock"))
        else:
            passed.append((item, record))
    users = user_of([record.peer_id for _, record in passed]) if passed else {}
    checked = []
    for item, record in passed:
        if users.get(record.peer_id) != record.user:
            dropped.append(Dropped(item, "user", f"peer {record.peer_id} claims user {record.user[:64]!r}, its "
                                                 f"token was issued to {users.get(record.peer_id)!r}"))
        else:
            checked.append((item, record))
    epochs = sorted(record.epoch for _, record in checked)
    reference = max(floor_epoch, epochs[(len(epochs) - 1) // 2]) if epochs else floor_epoch
    records = []
    for item, record in checked:
        if record.epoch > reference + max_epoch_lead:
            dropped.append(Dropped(item, "epoch", f"peer {record.peer_id}: epoch {record.epoch}, the swarm's is "
                                                  f"{reference}"))
        else:
            records.append(record)
    return records, dropped


def leaving_key(run_id: str) -> str:
    return f"{run_id}_leaving"


def publish_leaving(dht: hivemind.DHT, run_id: str, signer: RSASignatureValidator, *, epoch: int,
                    expiration_s: float = 120.0):
    """Say (in the background) that this peer is leaving for good: its metrics record outlives it in
    the DHT for up to a minute, and readers would count it as training until then. Stored under the
    key that signs its metrics records, so no other peer can say it for this one; the store's future."""
    record = LeavingRecord(time=get_dht_time(), epoch=epoch)
    return dht.store(key=leaving_key(run_id), subkey=signer.local_public_key, value=record.dict(),
                     expiration_time=get_dht_time() + expiration_s, return_future=True)


def fetch_leaving(dht: hivemind.DHT, run_id: str, *, timeout_s: float = 10.0) -> set:
    """The signing keys (subkeys) of the peers that said they are leaving, as stored lately."""
    try:
        found = dht.get(leaving_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # a slow DHT: nobody known to be leaving this time
        logger.debug("could not read leaving peers: %r", e)
        return set()
    if found is None or not isinstance(found.value, dict):
        return set()
    gone = set()
    for subkey, entry in found.value.items():
        try:
            LeavingRecord.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):
            continue
        gone.add(subkey)
    return gone


def leaving_peer_ids(stored: list[StoredRecord], leaving: set, run_id: str) -> set[str]:
    """The peer IDs of the metrics records stored under a key that said it is leaving; only a record
    whose identity vouches for that key counts (:func:`signer_peer_id`), so a peer can say it of
    itself alone, never of another."""
    gone = set()
    for item in stored:
        if item.subkey not in leaving:
            continue
        try:
            record = PeerMetrics.parse_obj(item.value)
        except (pydantic.ValidationError, TypeError):
            continue
        if signer_peer_id(record, item.subkey, run_id) == record.peer_id:
            gone.add(record.peer_id)
    return gone


def round_counts_key(run_id: str) -> str:
    return f"{run_id}_round_counts"


def publish_round_counts(dht: hivemind.DHT, run_id: str, signer: RSASignatureValidator, counts: RoundCounts,
                         *, expiration_s: float = 60.0):
    """Store (in the background) this peer's round counts beside its metrics record, under the same
    signing key; the store's future."""
    return dht.store(key=round_counts_key(run_id), subkey=signer.local_public_key, value=counts.dict(),
                     expiration_time=get_dht_time() + expiration_s, return_future=True)


def fetch_round_counts(dht: hivemind.DHT, run_id: str, *, timeout_s: float = 10.0) -> dict:
    """Signing key (subkey) to the well-formed :class:`RoundCounts` stored under it lately."""
    try:
        found = dht.get(round_counts_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # a slow DHT: no counts this time
        logger.debug("could not read round counts: %r", e)
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    counts = {}
    for subkey, entry in found.value.items():
        try:
            counts[subkey] = RoundCounts.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):
            continue
    return counts


def round_counts_of(stored: list[StoredRecord], counts: dict, records: list[PeerMetrics],
                    run_id: str) -> dict[str, RoundCounts]:
    """Peer ID to its round counts, for the peers whose metrics ``records`` passed :func:`screen`:
    counts stored under the key that signed the peer's metrics record, of the same session. A
    peer's counts are its own word, like its record: they can misstate its own rounds, nobody else's."""
    passed = {r.peer_id: r for r in records}
    found = {}
    for item in stored:
        c = counts.get(item.subkey)
        if c is None:
            continue
        try:
            record = PeerMetrics.parse_obj(item.value)
        except (pydantic.ValidationError, TypeError):
            continue
        ok = passed.get(record.peer_id)
        if (ok is not None and ok.session == c.session and record.session == c.session
                and signer_peer_id(record, item.subkey, run_id) == record.peer_id):
            found[record.peer_id] = c
    return found


def live_records(records: list[PeerMetrics], *, now: float, gone: set = frozenset(),
                 window_s: float = 60.0) -> tuple[list[PeerMetrics], list[PeerMetrics]]:
    """(recent, live): the records stored within ``window_s`` of ``now`` (a record lives a minute in
    the DHT), and those of peers still training, i.e. not ``gone`` (:func:`leaving_peer_ids`): a
    peer that left is gone though its record is still there. The swarm's epoch is the recent
    records' (a peer that left at the last epoch reached it); peers and throughput are the live ones'."""
    recent = [r for r in records if now - r.time < window_s]
    return recent, [r for r in recent if r.peer_id not in gone]


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
