"""The files the auxiliary peer writes in the run folder for the web side, and their schemas.

The coordinator runs two processes that share nothing but the run folder and the database: the
web service (no torch, no hivemind) and its auxiliary peer (``crowdtrain.auxpeer``, a swarm
peer). The peer writes, the web side and the tools (testbed, benchmarks) read:

- ``run.json`` (:class:`RunInfo`): what ``GET /api/join`` serves, written once the peer's DHT is
  up; a volunteer checks it whole (``crowdtrain.swarm.join_info``);
- ``status.json`` (:class:`RunStatus`): the swarm now, rewritten every refresh;
- ``schedule.json`` (``crowdtrain.runspec.schedule.RunSchedule``): the schedule now, written by the
  coordinator at each start and updated by the peer (a time budget sized, the run finished);
- ``metrics.jsonl``: every peer's signed metrics record as collected, one JSON object a line
  (``crowdtrain.swarm.metrics.PeerMetrics``), appended;
- ``known_peers.json``: peer ID -> multiaddrs of the peers seen lately, read by the next start
  of the auxiliary peer to rejoin the swarm through them.

Every file is written whole and renamed into place (:func:`write_json_atomic`), so a reader
never sees half of one; ``metrics.jsonl`` is appended, and a crash can leave its last line torn,
which :func:`read_metrics` skips. Readers go through the functions here: a file that is missing
(the run is starting) or does not match its schema (a disk error, a hand edit) reads as
"nothing yet" plus a ``problem`` naming the file and field, never an exception in a page.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

from crowdtrain.runspec.typed import typed_config

RUN_INFO = "run.json"
STATUS = "status.json"
METRICS = "metrics.jsonl"
KNOWN_PEERS = "known_peers.json"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: a reader in another
    process sees the old content or the new, never an empty or half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file renamed into place."""
    write_text_atomic(path, json.dumps(data))


class _Schema:
    @classmethod
    def from_dict(cls, values: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown fields {unknown}")
        return cls(**values)

    def to_dict(self) -> dict:
        """The JSON the file holds; raises ValueError if a field does not have its declared type
        (a writer's bug: readers would take the whole file for broken)."""
        values = dataclasses.asdict(self)
        typed_config(type(self), values, type(self).__name__)
        return values


@dataclass(frozen=True)
class RunInfo(_Schema):
    """``run.json``: the join information. The auxiliary peer writes every field; readers need
    only ``run_id`` (a volunteer checks the whole of it: ``crowdtrain.swarm.join_info``)."""

    run_id: str
    fingerprint: str = ""  # crowdtrain.model.info.architecture_fingerprint of the run's model
    swarm: dict = field(default_factory=dict)  # crowdtrain.runspec.swarm.SwarmConfig.to_dict()
    task: dict = field(default_factory=dict)  # {"model": ModelConfig fields, "data": shard source, ...}
    initial_peers: list = field(default_factory=list)  # the auxiliary peer's multiaddrs
    coordinator_peer_id: str = ""
    auth: dict = field(default_factory=dict)  # {"mode", "coordinator_public_key", "token_url", "token_lifetime_s"}
    text_tokenizer: typing.Optional[dict] = None  # {"url", "sha256", "path" (dropped by /api/join)}
    initial_model: typing.Optional[dict] = None  # {"seed", "digest"} while the run is at epoch 0
    # crowdtrain.runspec.schedule.RunSchedule: the schedule now (volunteers re-read it while they train)
    schedule: typing.Optional[dict] = None


@dataclass(frozen=True)
class RunStatus(_Schema):
    """``status.json``: the swarm as the auxiliary peer saw it at ``updated`` (Unix time)."""

    epoch: int = 0
    peers: list = field(default_factory=list)  # PeerMetrics records of the peers heard from in the last minute
    updated: typing.Optional[float] = None
    last_checkpoint_epoch: typing.Optional[int] = None
    samples_per_second: float = 0.0
    total_epochs: int = 0
    target_batch_size: int = 0
    metrics_records_refused: int = 0  # records that failed signature or schema checks
    metrics_records_dropped: dict = field(default_factory=dict)  # reason -> records dropped after the checks
    # The swarm's rounds over the last minutes (crowdtrain.swarm.metrics.RoundHealth.summary):
    # window_s, rounds, apart (averaged with nobody while others trained), users (whose rounds were)
    rounds: dict = field(default_factory=dict)
    finished_at: typing.Optional[float] = None  # when the swarm reached total_epochs (the run has finished)
    # The swarm's recent pace (crowdtrain.runspec.schedule.EpochRate); None before two epoch changes.
    epochs_per_second: typing.Optional[float] = None


# The last answer per (file, schema), kept with the text it was read from: the web process reads
# status.json for every /api/status and page (40 times a second under 200 dashboards), the
# auxiliary peer rewrites it every 2 s, and parsing its 1,000 peers was most of each request.
# Keyed on the whole text, not its mtime, so a rewrite within the clock's tick is never missed.
_LAST_READ: dict[tuple[Path, type], tuple[str, tuple]] = {}


def _read_typed(path: Path, cls):
    """(the file as ``cls``, None) or (None, a problem that names the file and field); (None, None) if
    absent. The same text gives the same (frozen) object back: treat it as read-only."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path.name}: cannot read it ({e})"
    last = _LAST_READ.get((path, cls))
    if last is not None and last[0] == text:
        return last[1]
    answer = _parse_typed(path, cls, text)
    if len(_LAST_READ) > 64:  # many run folders in one process (tests): keep the table small
        _LAST_READ.clear()
    _LAST_READ[(path, cls)] = (text, answer)
    return answer


def _parse_typed(path: Path, cls, text: str):
    try:
        return typed_config(cls, json.loads(text), path.name), None
    except json.JSONDecodeError as e:
        return None, f"{path.name} is not valid JSON ({e}); the auxiliary peer rewrites it at its next refresh"
    except (TypeError, ValueError) as e:
        return None, f"{path.name} does not match its schema: {e}"[:400]


def read_run_info(run_dir: Path) -> tuple[RunInfo | None, str | None]:
    """``run.json`` as :class:`RunInfo`, and a problem if it exists but does not match."""
    return _read_typed(Path(run_dir) / RUN_INFO, RunInfo)


def read_status(run_dir: Path) -> tuple[RunStatus, str | None]:
    """``status.json`` as :class:`RunStatus` (the empty status while there is none), and a problem
    if it exists but does not match (also the empty status then)."""
    status, problem = _read_typed(Path(run_dir) / STATUS, RunStatus)
    return status or RunStatus(), problem


def read_known_peers(run_dir: Path) -> tuple[dict[str, list[str]], str | None]:
    """``known_peers.json`` (peer ID -> multiaddrs); entries of the wrong shape are left out and
    named in the problem, an unreadable file reads as no peers (the peer then starts alone)."""
    path = Path(run_dir) / KNOWN_PEERS
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, f"{KNOWN_PEERS} is unreadable ({e}); starting without the peers seen last time"
    if not isinstance(data, dict):
        return {}, f"{KNOWN_PEERS} must be an object of peer ID -> list of multiaddrs; starting without it"
    good = {k: v for k, v in data.items()
            if isinstance(k, str) and isinstance(v, list) and all(isinstance(m, str) for m in v)}
    bad = sorted(set(data) - set(good))
    return good, (f"{KNOWN_PEERS}: left out {len(bad)} entries that are not peer ID -> list of multiaddrs"
                  if bad else None)


def append_metrics(run_dir: Path, records: list[dict]) -> None:
    with open(Path(run_dir) / METRICS, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """Every record of a ``metrics.jsonl`` and how many lines were skipped (torn by a crash, or not
    a JSON object)."""
    records, skipped = [], 0
    if not Path(path).is_file():
        return records, skipped
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return records, skipped
