"""The coordinator's storage: users and keys, peers, metrics, contributions, checkpoints, samples.

SQLAlchemy, so any database URL works (``--db postgresql://...``); by default a SQLite file in
the run folder, which needs no set-up. Two processes write it: the web service (users, tokens
issued, join attempts) and the auxiliary peer (metrics, contributions, checkpoints, samples);
SQLite runs in WAL mode with a busy timeout so they do not trip over each other. Everything a
page shows is read from here, so a coordinator restart loses nothing.

Contributions are the samples that went into global steps: a peer's weight in each round it
finished in a group (or its step when alone in the swarm), as its ledger counts them
(``crowdtrain.swarm.metrics.Ledger``), credited once each to the user its token was issued to.
Samples of a round the swarm finished without that peer are not credited: they trained nothing.
The counts are the peer's own claim, signed with its identity; a claim of more than twice the
target batch per step is cut to that.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import secrets
import time
from pathlib import Path

from sqlalchemy import (BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint, case, create_engine,
                        event, func, insert, inspect, select, update)
from sqlalchemy import text as sql
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from crowdtrain.runspec.names import USER_NAME_RULE, valid_user_name
from crowdtrain.runspec.validation import clean_losses

ACTIVE_WINDOW_S = 60.0  # a peer that reported within this window counts as active
# Rows are read as untrusted too (a database may hold values from before records were checked):
# a time further ahead than this reads as unknown, a non-finite number as missing.
MAX_CLOCK_SKEW_S = 300.0


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    key_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)  # sha256 of the API key
    created: Mapped[float] = mapped_column(Float)
    revoked: Mapped[float | None] = mapped_column(Float, nullable=True)


_METRICS_FIELDS = ("time", "epoch", "loss", "samples", "samples_per_second", "steps", "client_mode",
                   "last_round_peers", "swarm_peers")  # a record's fields stored as they are


class Peer(Base):
    __tablename__ = "peers"
    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    user: Mapped[str] = mapped_column(String(64), index=True)
    public_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    samples_per_second: Mapped[float] = mapped_column(Float, default=0.0)
    client_mode: Mapped[bool] = mapped_column(Boolean, default=False)
    last_round_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_round_peers: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The peer's ledger as last credited (crowdtrain.swarm.metrics.Ledger): its session and the
    # cumulative samples and steps of that session already in ``contributions``.
    ledger_session: Mapped[str | None] = mapped_column(String(32), nullable=True)
    ledger_samples: Mapped[int] = mapped_column(Integer, default=0)
    ledger_steps: Mapped[int] = mapped_column(Integer, default=0)


class MetricsReport(Base):
    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    peer_id: Mapped[str] = mapped_column(String(128), index=True)
    user: Mapped[str] = mapped_column(String(64))
    time: Mapped[float] = mapped_column(Float, index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    samples_per_second: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    client_mode: Mapped[bool] = mapped_column(Boolean)
    last_round_peers: Mapped[int] = mapped_column(Integer)
    swarm_peers: Mapped[int] = mapped_column(Integer)
    __table_args__ = (UniqueConstraint("peer_id", "time"),)


class SwarmPoint(Base):
    """One sample of the swarm as a whole, taken by the auxiliary peer every few seconds."""
    __tablename__ = "swarm_points"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    time: Mapped[float] = mapped_column(Float, index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)  # mean over active peers
    active_peers: Mapped[int] = mapped_column(Integer)
    samples_per_second: Mapped[float] = mapped_column(Float)
    # At a checkpoint only: JSON {split: mean loss} on the run's held-out splits (None elsewhere).
    valid_loss: Mapped[str | None] = mapped_column(Text, nullable=True)


class Contribution(Base):
    """A peer's samples that went into global steps, credited at its epoch ``epoch`` (the steps
    were the ones before it)."""
    __tablename__ = "contributions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    peer_id: Mapped[str] = mapped_column(String(128), index=True)
    user: Mapped[str] = mapped_column(String(64), index=True)
    epoch: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer, default=0)  # global steps those samples went into
    compute_s: Mapped[float] = mapped_column(Float)  # samples / the peer's reported rate
    time: Mapped[float] = mapped_column(Float)
    # (user, epoch): the most steps of a user's peers in an epoch, read at every credit.
    __table_args__ = (UniqueConstraint("peer_id", "epoch"), Index("ix_contributions_user_epoch", "user", "epoch"))


class UserTotal(Base):
    """Per user, the sums the leaderboard shows, kept by ``record_credit`` in the transaction that
    writes the contribution. Summing ``contributions`` on every page view read every row of the
    run (100,000 after 3 hours of 1,000 volunteers: 120 ms a view, growing with the run)."""
    __tablename__ = "user_totals"
    user: Mapped[str] = mapped_column(String(64), primary_key=True)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    compute_s: Mapped[float] = mapped_column(Float, default=0.0)
    # The global steps the user's samples went into: per epoch, the most steps of any of its
    # peers' rows (two of their peers in one step count once), summed.
    epochs: Mapped[int] = mapped_column(BigInteger, default=0)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    time: Mapped[float] = mapped_column(Float)
    files: Mapped[str] = mapped_column(Text, default="[]")  # JSON list of file names
    pruned: Mapped[bool] = mapped_column(Boolean, default=False)  # removed from disk (only the last K are kept)
    # JSON {split: mean loss} and {split: rows} on the run's held-out splits (crowdtrain.runspec.validation);
    # None: not measured (no split but train, or a checkpoint from before).
    valid_loss: Mapped[str | None] = mapped_column(Text, nullable=True)
    valid_rows: Mapped[str | None] = mapped_column(Text, nullable=True)
    best: Mapped[bool] = mapped_column(Boolean, default=False)  # the lowest valid loss: kept besides the last K


class Sample(Base):
    __tablename__ = "samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint: Mapped[str] = mapped_column(String(64), ForeignKey("checkpoints.name"))
    epoch: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)  # relative to the run folder
    held_out: Mapped[bool] = mapped_column(Boolean, default=False)  # tag == "held-out" (the API's field)
    time: Mapped[float] = mapped_column(Float)
    # The prompt's label (crowdtrain.data.sample_prompts), e.g. seen / held-out; None: no label.
    tag: Mapped[str | None] = mapped_column(String(64), nullable=True)
    reference: Mapped[bool] = mapped_column(Boolean, default=False)  # the image's first tile is the real one


class Counter(Base):
    """Named counters: join attempts refused, metrics records dropped by the schema, ..."""
    __tablename__ = "counters"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(Integer, default=0)


def _retry_on_conflict(write, attempts: int = 3):
    """Run a read-modify-write; if another writer inserted the same row first, redo it (it then updates)."""
    for attempt in range(attempts):
        try:
            return write()
        except IntegrityError:
            if attempt == attempts - 1:
                raise


def _conflict_retrying(method):
    """For insert-if-missing writers that two processes (web, auxiliary peer) may race on."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        return _retry_on_conflict(lambda: method(*args, **kwargs))
    return wrapper


def _chunks(values: list, size: int = 500):
    """``IN (...)`` lists of at most ``size``: SQLite allows 32,766 parameters a statement, and a
    shorter list keeps each statement's plan cacheable."""
    for i in range(0, len(values), size):
        yield values[i:i + size]


def default_url(run_dir: str | Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'coordinator.sqlite'}"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _json_or_none(value: dict | None) -> str | None:
    return json.dumps(value) if value else None


def _losses(text: str | None) -> dict[str, float] | None:
    """A stored {split: loss}, read as untrusted: non-finite or non-numeric entries are dropped."""
    try:
        return clean_losses(json.loads(text)) if text else None
    except ValueError:
        return None


def _rows(text: str | None) -> dict[str, int] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}


def _plausible_time(ts: float | None, now: float) -> float | None:
    """A peer-reported time, or None if it is missing (0), non-finite or in the future."""
    return ts if ts is not None and math.isfinite(ts) and 0 < ts <= now + MAX_CLOCK_SKEW_S else None


def engine_url(url: str) -> str:
    """``postgresql://`` (or ``postgres://``) with the driver installed: SQLAlchemy's default
    for the scheme is psycopg2, and crowdtrain installs psycopg 3."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    return url


class Store:
    """All reads and writes of the coordinator's database, as plain dicts (no ORM objects leak)."""

    def __init__(self, url: str):
        url = engine_url(url)
        self.url = url
        connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
        self.engine = create_engine(url, connect_args=connect_args)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _sqlite_pragmas(connection, _record):
                cursor = connection.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.close()
        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        self.session = sessionmaker(self.engine, expire_on_commit=False)
        self._sum_older_contributions()

    def _add_missing_columns(self) -> None:
        """Columns added since a database was created (create_all makes missing tables only):
        a restarted coordinator keeps its old database and every row in it."""
        present = {c["name"] for c in inspect(self.engine).get_columns("samples")}
        peers = {c["name"] for c in inspect(self.engine).get_columns("peers")}
        contributions = {c["name"] for c in inspect(self.engine).get_columns("contributions")}
        checkpoints = {c["name"] for c in inspect(self.engine).get_columns("checkpoints")}
        points = {c["name"] for c in inspect(self.engine).get_columns("swarm_points")}
        with self.engine.begin() as conn:
            if "ledger_session" not in peers:
                conn.execute(sql("ALTER TABLE peers ADD COLUMN ledger_session VARCHAR(32)"))
                conn.execute(sql("ALTER TABLE peers ADD COLUMN ledger_samples INTEGER NOT NULL DEFAULT 0"))
                conn.execute(sql("ALTER TABLE peers ADD COLUMN ledger_steps INTEGER NOT NULL DEFAULT 0"))
            if "steps" not in contributions:
                # Older rows were one per peer and epoch.
                conn.execute(sql("ALTER TABLE contributions ADD COLUMN steps INTEGER NOT NULL DEFAULT 1"))
            if "tag" not in present:
                conn.execute(sql("ALTER TABLE samples ADD COLUMN tag VARCHAR(64)"))
                # Rows from before were all the shapes run's seen and held-out prompts.
                conn.execute(sql("UPDATE samples SET tag = CASE WHEN held_out THEN 'held-out' ELSE 'seen' END"))
            if "reference" not in present:
                conn.execute(sql("ALTER TABLE samples ADD COLUMN reference BOOLEAN NOT NULL DEFAULT FALSE"))
            if "valid_loss" not in checkpoints:
                conn.execute(sql("ALTER TABLE checkpoints ADD COLUMN valid_loss TEXT"))
                conn.execute(sql("ALTER TABLE checkpoints ADD COLUMN valid_rows TEXT"))
                conn.execute(sql("ALTER TABLE checkpoints ADD COLUMN best BOOLEAN NOT NULL DEFAULT FALSE"))
            if "valid_loss" not in points:
                conn.execute(sql("ALTER TABLE swarm_points ADD COLUMN valid_loss TEXT"))
        for index in Contribution.__table__.indexes:
            index.create(self.engine, checkfirst=True)

    def _sum_older_contributions(self) -> None:
        """Fill ``user_totals`` from the contributions of a database from before it (empty totals
        next to contributions: ``record_credit`` writes both in one transaction)."""
        with self.session.begin() as s:
            if s.scalar(select(UserTotal.user).limit(1)) is not None or \
                    s.scalar(select(Contribution.id).limit(1)) is None:
                return
            totals = {row.user: UserTotal(user=row.user, samples=int(row.samples or 0),
                                          compute_s=_finite(row.compute_s) or 0.0, epochs=0)
                      for row in s.execute(select(Contribution.user, func.sum(Contribution.samples).label("samples"),
                                                  func.sum(Contribution.compute_s).label("compute_s"))
                                           .group_by(Contribution.user))}
            per_epoch = (select(Contribution.user, func.max(Contribution.steps).label("steps"))
                         .group_by(Contribution.user, Contribution.epoch).subquery())
            for row in s.execute(select(per_epoch.c.user, func.sum(per_epoch.c.steps).label("epochs"))
                                 .group_by(per_epoch.c.user)):
                totals[row.user].epochs = int(row.epochs or 0)
            s.add_all(totals.values())

    def close(self) -> None:
        self.engine.dispose()

    # ---- users -------------------------------------------------------------------------------
    def add_user(self, name: str) -> str:
        """Create a user (or give a revoked one a fresh key); returns the API key, shown once."""
        if not valid_user_name(name):
            raise ValueError(f"user names are {USER_NAME_RULE}, got {name!r}")
        api_key = "ct_" + secrets.token_urlsafe(24)
        with self.session.begin() as s:
            user = s.scalar(select(User).where(User.name == name))
            if user is not None and user.revoked is None and user.key_hash is not None:
                raise ValueError(f"user {name!r} exists; revoke it first (`crowdtrain users revoke {name}`) to "
                                 "issue a new key")
            if user is None:
                user = User(name=name, created=time.time())
                s.add(user)
            user.key_hash, user.revoked = hash_key(api_key), None
        return api_key

    def revoke_user(self, name: str) -> None:
        with self.session.begin() as s:
            user = s.scalar(select(User).where(User.name == name))
            if user is None:
                raise ValueError(f"no user {name!r}; `crowdtrain users list` shows who exists")
            user.revoked = time.time()

    def list_users(self) -> list[dict]:
        with self.session() as s:
            return [{"name": u.name, "created": u.created, "revoked": u.revoked, "has_key": u.key_hash is not None}
                    for u in s.scalars(select(User).order_by(User.name))]

    def user_for_key(self, api_key: str) -> str | None:
        """The active user holding this key, or None (unknown or revoked)."""
        with self.session() as s:
            user = s.scalar(select(User).where(User.key_hash == hash_key(api_key)))
            return user.name if user is not None and user.revoked is None else None

    def is_revoked(self, name: str) -> bool:
        with self.session() as s:
            user = s.scalar(select(User).where(User.name == name))
            return user is not None and user.revoked is not None

    @_conflict_retrying
    def ensure_open_user(self, name: str) -> None:
        """In an open run anyone may pick a name; remember it (without a key) for the leaderboard."""
        with self.session.begin() as s:
            if s.scalar(select(User).where(User.name == name)) is None:
                s.add(User(name=name, created=time.time()))

    # ---- peers, as seen at join time and in metrics ------------------------------------------
    @_conflict_retrying
    def peer_joined(self, peer_id: str, user: str, public_key: str) -> None:
        now = time.time()
        with self.session.begin() as s:
            peer = s.get(Peer, peer_id)
            # last_seen follows metrics only (the peers' clocks): a token refresh is not training.
            if peer is None:
                s.add(Peer(peer_id=peer_id, user=user, public_key=public_key, first_seen=now, last_seen=0.0))
            else:
                peer.user, peer.public_key = user, public_key

    def user_of_peer(self, peer_id: str) -> str | None:
        with self.session() as s:
            peer = s.get(Peer, peer_id)
            return peer.user if peer is not None else None

    def users_of_peers(self, peer_ids: list[str]) -> dict[str, str]:
        """The user each known peer's token was issued to (peers never given one are left out)."""
        with self.session() as s:
            return {p.peer_id: p.user for p in s.scalars(select(Peer).where(Peer.peer_id.in_(set(peer_ids))))}

    @_conflict_retrying
    def record_metrics(self, records: list[dict]) -> int:
        """Store metrics records (PeerMetrics dicts); returns how many were new. The user is the one
        the coordinator authenticated for that peer, not the name the record claims."""
        if not records:
            return 0
        rows = []
        # A batch is one turn of the auxiliary peer (a record from each peer heard in the last 2 s;
        # 400 of them at 1,000 peers): the rows already there and the peers are read in one query
        # each, and everything is written in one flush. A query per record made the session flush
        # before each one, and a turn took longer than the turn.
        ids = {r["peer_id"] for r in records}
        with self.session.begin() as s, s.no_autoflush:
            seen = set()
            for chunk in _chunks(sorted(ids)):
                seen.update(s.execute(select(MetricsReport.peer_id, MetricsReport.time)
                                      .where(MetricsReport.peer_id.in_(chunk))
                                      .where(MetricsReport.time >= min(r["time"] for r in records))))
            peers = {p.peer_id: p for chunk in _chunks(sorted(ids))
                     for p in s.scalars(select(Peer).where(Peer.peer_id.in_(chunk)))}
            for r in records:
                if (r["peer_id"], r["time"]) in seen:
                    continue
                seen.add((r["peer_id"], r["time"]))
                peer = peers.get(r["peer_id"])
                if peer is None:
                    peer = peers[r["peer_id"]] = Peer(peer_id=r["peer_id"], user=r.get("user", "anonymous"),
                                                      first_seen=r["time"], last_seen=0.0)
                    s.add(peer)
                rows.append({"peer_id": r["peer_id"], "user": peer.user, **{k: r[k] for k in _METRICS_FIELDS}})
                if r["time"] >= peer.last_seen:
                    peer.last_seen, peer.epoch, peer.loss = r["time"], r["epoch"], r["loss"]
                    peer.samples_per_second, peer.client_mode = r["samples_per_second"], r["client_mode"]
                    if r["last_round_peers"] > 0:
                        peer.last_round_epoch, peer.last_round_peers = r["epoch"], r["last_round_peers"]
            if rows:
                s.flush()  # new peers first
                s.execute(insert(MetricsReport), rows)  # one executemany (ORM objects were one INSERT each)
        return len(rows)

    def record_swarm_point(self, *, epoch: int, loss: float | None, active_peers: int,
                           samples_per_second: float, at: float | None = None,
                           valid_loss: dict[str, float] | None = None) -> None:
        """``valid_loss``: at a checkpoint, {split: mean loss} on the held-out splits (``/api/history``
        carries it on this point, next to the training loss ``loss``)."""
        with self.session.begin() as s:
            s.add(SwarmPoint(time=at or time.time(), epoch=epoch, loss=loss, active_peers=active_peers,
                             samples_per_second=samples_per_second, valid_loss=_json_or_none(valid_loss)))

    @_conflict_retrying
    def record_credit(self, *, peer_id: str, session: str, samples: int, steps: int, epoch: int,
                      samples_per_second: float, max_samples_per_step: int | None = None) -> dict:
        """Credit what a peer's ledger grew by since the last record of the same session (a new
        session counts from 0), in one transaction with the ledger's new position: a record seen
        twice, or again after a restart, credits nothing. A record behind the last one (out of
        order) credits nothing. ``max_samples_per_step``: more samples per step than this is not an
        honest round's weight; the excess is not credited. Returns {"samples", "steps", "clamped"}."""
        with self.session.begin() as s:
            peer = s.get(Peer, peer_id)
            if peer is None:  # screened records come from peers with a token, so it exists
                return {"samples": 0, "steps": 0, "clamped": 0}
            same = peer.ledger_session == session
            new_samples = samples - (peer.ledger_samples or 0) if same else samples
            new_steps = steps - (peer.ledger_steps or 0) if same else steps
            if new_samples < 0 or new_steps < 0 or (new_samples == 0 and new_steps == 0):
                return {"samples": 0, "steps": 0, "clamped": 0}
            credited, clamped = new_samples, 0
            if max_samples_per_step is not None and new_samples > max_samples_per_step * max(new_steps, 0):
                credited = max_samples_per_step * max(new_steps, 0)
                clamped = new_samples - credited
            peer.ledger_session, peer.ledger_samples, peer.ledger_steps = session, samples, steps
            if credited or new_steps:
                row = s.scalar(select(Contribution).where(Contribution.peer_id == peer_id,
                                                          Contribution.epoch == epoch))
                compute_s = credited / samples_per_second if samples_per_second > 0 else 0.0
                user = peer.user if row is None else row.user
                most_steps = s.scalar(select(func.max(Contribution.steps)).where(Contribution.user == user,
                                                                                 Contribution.epoch == epoch)) or 0
                if row is None:
                    row = Contribution(peer_id=peer_id, user=user, epoch=epoch, samples=credited,
                                       steps=new_steps, compute_s=compute_s, time=time.time())
                    s.add(row)
                else:
                    row.samples += credited
                    row.steps += new_steps
                    row.compute_s += compute_s
                total = s.get(UserTotal, user)
                if total is None:
                    total = UserTotal(user=user, samples=0, compute_s=0.0, epochs=0)
                    s.add(total)
                total.samples += credited
                total.compute_s += compute_s
                total.epochs += max(row.steps - most_steps, 0)
            return {"samples": credited, "steps": new_steps, "clamped": clamped}

    def bump(self, name: str, by: int = 1) -> None:
        def write():
            with self.session.begin() as s:
                if s.execute(update(Counter).where(Counter.name == name)
                             .values(value=Counter.value + by)).rowcount == 0:
                    s.add(Counter(name=name, value=by))
        _retry_on_conflict(write)

    def add_new_counts(self, reported: dict[str, int], counts: dict[str, int]) -> None:
        """Add what each of a process's own counts (from zero at its start) grew by since it last
        reported them (``reported``, updated here): the stored counters keep the run's totals
        across restarts of that process. (Storing the counts themselves reset them at every restart.)"""
        for name, value in counts.items():
            if value > reported.get(name, 0):
                self.bump(name, value - reported.get(name, 0))
                reported[name] = value

    def counters(self) -> dict[str, int]:
        with self.session() as s:
            return {c.name: c.value for c in s.scalars(select(Counter))}

    # ---- checkpoints and samples --------------------------------------------------------------
    @_conflict_retrying
    def record_checkpoint(self, *, name: str, epoch: int, loss: float | None, files: list[str],
                          at: float | None = None, valid_loss: dict[str, float] | None = None,
                          valid_rows: dict[str, int] | None = None) -> None:
        """``loss``: the training loss when it was taken; ``valid_loss``/``valid_rows``: {split: mean
        loss} and {split: rows} on the run's held-out splits (None: not measured)."""
        valid, rows = _json_or_none(valid_loss), _json_or_none(valid_rows)
        with self.session.begin() as s:
            row = s.get(Checkpoint, name)
            if row is None:
                s.add(Checkpoint(name=name, epoch=epoch, loss=loss, time=at or time.time(), files=json.dumps(files),
                                 valid_loss=valid, valid_rows=rows))
            else:
                row.epoch, row.loss, row.files, row.pruned = epoch, loss, json.dumps(files), False
                row.valid_loss, row.valid_rows = valid, rows

    def mark_pruned(self, kept: list[str]) -> None:
        with self.session.begin() as s:
            for row in s.scalars(select(Checkpoint).where(Checkpoint.name.not_in(kept))):
                row.pruned = True

    def mark_best(self, name: str | None) -> None:
        """``name`` is the checkpoint with the lowest validation loss (None: none has one)."""
        with self.session.begin() as s:
            s.execute(update(Checkpoint).where(Checkpoint.best.is_(True), Checkpoint.name != (name or ""))
                      .values(best=False))
            if name is not None:
                s.execute(update(Checkpoint).where(Checkpoint.name == name).values(best=True))

    def record_sample(self, *, checkpoint: str, epoch: int, prompt: str, path: str, tag: str | None = None,
                      reference: bool = False) -> None:
        with self.session.begin() as s:
            s.add(Sample(checkpoint=checkpoint, epoch=epoch, prompt=prompt, path=path, held_out=tag == "held-out",
                         tag=tag, reference=reference, time=time.time()))

    # ---- what the pages show --------------------------------------------------------------------
    def swarm_history(self, *, since: float = 0.0, limit: int = 5000) -> list[dict]:
        # Columns, not ORM objects: the dashboard reads the whole run (43,200 points a day), and
        # building an object per row took five times as long as the query.
        columns = (SwarmPoint.time, SwarmPoint.epoch, SwarmPoint.loss, SwarmPoint.active_peers,
                   SwarmPoint.samples_per_second, SwarmPoint.valid_loss)
        with self.session() as s:
            rows = s.execute(select(*columns).where(SwarmPoint.time > since).order_by(SwarmPoint.time.desc())
                             .limit(limit)).all()
            return [{"time": r.time, "epoch": r.epoch, "loss": _finite(r.loss), "active_peers": r.active_peers,
                     "samples_per_second": _finite(r.samples_per_second) or 0.0,
                     "valid_loss": _losses(r.valid_loss)} for r in reversed(rows)]

    def swarm_point_before(self, time_: float) -> dict | None:
        """The last history point at or before ``time_`` (None if there is none)."""
        with self.session() as s:
            row = s.scalars(select(SwarmPoint).where(SwarmPoint.time <= time_).order_by(SwarmPoint.time.desc())
                            .limit(1)).first()
            return None if row is None else {"time": row.time, "epoch": row.epoch}

    def metrics(self, *, limit: int = 1000, peer_id: str | None = None) -> list[dict]:
        with self.session() as s:
            query = select(MetricsReport)
            if peer_id is not None:
                query = query.where(MetricsReport.peer_id == peer_id)
            rows = s.scalars(query.order_by(MetricsReport.time.desc()).limit(limit)).all()
            return [{"peer_id": r.peer_id, "user": r.user, "time": _finite(r.time), "epoch": r.epoch,
                     "loss": _finite(r.loss), "samples": r.samples,
                     "samples_per_second": _finite(r.samples_per_second) or 0.0, "steps": r.steps,
                     "client_mode": r.client_mode, "last_round_peers": r.last_round_peers,
                     "swarm_peers": r.swarm_peers} for r in reversed(rows)]

    def peers(self, *, active_only: bool = False, now: float | None = None, limit: int | None = None) -> list[dict]:
        now = now or time.time()
        with self.session() as s:
            query = select(Peer).order_by(Peer.last_seen.desc()).limit(limit)
            if active_only:
                query = query.where(Peer.last_seen > now - ACTIVE_WINDOW_S,
                                    Peer.last_seen <= now + MAX_CLOCK_SKEW_S)
            rows = []
            for p in s.scalars(query):
                last_seen = _plausible_time(p.last_seen, now)
                rows.append({"peer_id": p.peer_id, "user": p.user, "first_seen": _plausible_time(p.first_seen, now),
                             "last_seen": last_seen, "epoch": p.epoch,
                             "samples_per_second": _finite(p.samples_per_second) or 0.0, "client_mode": p.client_mode,
                             "last_round_epoch": p.last_round_epoch, "last_round_peers": p.last_round_peers,
                             "loss": _finite(p.loss),
                             "active": last_seen is not None and last_seen > now - ACTIVE_WINDOW_S})
        rows.sort(key=lambda r: r["last_seen"] or 0.0, reverse=True)  # implausible times last
        return rows

    def leaderboard(self, *, now: float | None = None) -> list[dict]:
        """Per user: samples the swarm counted, compute time, last seen, active; most samples first."""
        now = now or time.time()
        with self.session() as s:
            totals = {t.user: {"samples": int(t.samples or 0), "compute_s": _finite(t.compute_s) or 0.0,
                               "epochs": int(t.epochs or 0)}
                      for t in s.execute(select(UserTotal.user, UserTotal.samples, UserTotal.compute_s,
                                                UserTotal.epochs))}
            plausible = case((Peer.last_seen <= now + MAX_CLOCK_SKEW_S, Peer.last_seen), else_=None)
            seen = {row.user: (row.last_seen, row.peers)
                    for row in s.execute(select(Peer.user, func.max(plausible).label("last_seen"),
                                                func.count(Peer.peer_id).label("peers")).group_by(Peer.user))}
            revoked = {u.name for u in s.scalars(select(User).where(User.revoked.is_not(None)))}
        board = []
        for user in sorted(set(totals) | set(seen)):
            last_seen, peers = seen.get(user, (None, 0))
            last_seen = _plausible_time(last_seen, now)  # 0: joined, never reported metrics
            board.append({"user": user, **totals.get(user, {"samples": 0, "compute_s": 0.0, "epochs": 0}),
                          "peers": peers, "last_seen": last_seen, "revoked": user in revoked,
                          "active": last_seen is not None and last_seen > now - ACTIVE_WINDOW_S})
        board.sort(key=lambda r: (-r["samples"], r["user"]))
        return board

    def checkpoints(self, *, include_pruned: bool = False) -> list[dict]:
        with self.session() as s:
            query = select(Checkpoint).order_by(Checkpoint.epoch)
            if not include_pruned:
                query = query.where(Checkpoint.pruned.is_(False))
            return [{"name": c.name, "epoch": c.epoch, "loss": _finite(c.loss), "time": c.time,
                     "files": json.loads(c.files), "pruned": c.pruned, "valid_loss": _losses(c.valid_loss),
                     "valid_rows": _rows(c.valid_rows), "best": bool(c.best)} for c in s.scalars(query)]

    def samples(self, *, limit: int = 200) -> list[dict]:
        with self.session() as s:
            rows = s.scalars(select(Sample).order_by(Sample.epoch.desc(), Sample.id).limit(limit)).all()
            return [{"checkpoint": r.checkpoint, "epoch": r.epoch, "prompt": r.prompt, "path": r.path,
                     "held_out": r.held_out, "tag": r.tag, "reference": bool(r.reference), "time": r.time}
                    for r in rows]
