"""The coordinator's HTTP service: the JSON API, access tokens, shards, checkpoints and the pages.

Reads the run's database (``crowdtrain.coordinator.db``) and the files the auxiliary peer writes
in the run folder (``run.json``, ``status.json``, ``checkpoints/``, ``samples/``); never imports
torch or hivemind. The run at a glance (``/api/status``) is ``crowdtrain.coordinator.status``'s,
which the pages (``crowdtrain.coordinator.pages``, mounted here) show too. Shards are served with
HTTP Range support (parquet readers seek).

Everything a client sends is bounded: request bodies over ``MAX_BODY_BYTES`` get 413, malformed
ones 422 with the field at fault, and ``POST /api/token`` is rate-limited (429) per API key, or
per client address without a valid one, so no client can crash the coordinator or touch stored
data it should not. A token request must be signed by the key it names, and the peer ID is derived
from that key, so nobody can re-assign another volunteer's peer (and its samples) to their name.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from crowdtrain import release
from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.manifest import CACHE_FILE, FileHashes, checkpoint_files, fixed_files
from crowdtrain.coordinator.notebooks import generate_notebook, join_notebook
from crowdtrain.coordinator.pages import NAV, mark_gaps, create_router as pages_router
from crowdtrain.coordinator.status import CHECKPOINT_FILES, run_status
from crowdtrain.data.sample_prompts import load_run_prompts
from crowdtrain.runspec.names import USER_NAME_RULE, valid_user_name
from crowdtrain.runspec.tokens import CoordinatorKey, check_token_request, peer_id_of_key
from crowdtrain.runspec.trust import NONCE_HEADER, fingerprint, sign_answer

MAX_BODY_BYTES = 64 * 1024


@dataclass
class AuthSettings:
    mode: str = "open"  # open | allowlist
    key_path: str | Path = "coordinator_key.pem"
    token_lifetime_s: float = 600.0
    requests_per_minute: int = 120


class TokenRequest(BaseModel):
    """Built by ``crowdtrain.runspec.tokens.token_request``: signed by the key it asks a token for."""
    public_key: str = Field(..., max_length=4096, description="the peer's RSA public key, OpenSSH encoding")
    peer_id: str = Field("", max_length=128, description="the peer's libp2p ID; optional, as it follows from "
                                                         "public_key (a different one is refused)")
    user: str = Field("anonymous", max_length=64, description="display name in open runs (ignored with a key)")
    timestamp: str = Field("", max_length=32, description="seconds since the epoch when the request was signed")
    signature: str = Field("", max_length=2048, description="base64 RSA-PSS (SHA-256) signature by public_key's "
                                                            "private key over the fields above")
    protocol: int | None = Field(None, description="the peer's crowdtrain protocol (crowdtrain.release.PROTOCOL); "
                                                   "another one than the coordinator's, or none, is refused (409)")


# The files of a shard folder volunteers fetch: the shards and the JSON beside them (shards.json,
# the demo data sets' recipe files), at its top level.
SERVED_SHARD_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.(parquet|json)")


class RateLimiter:
    """At most ``limit`` events per ``window_s`` per bucket (a key or an address; a sliding window).

    The table is keyed by what a stranger chooses (an address, a key), so it is bounded twice:
    buckets whose every event has left the window are forgotten (swept at most four times a
    window, from the least recently used end, so a call costs the same at any size), and past
    ``max_buckets`` the least recently used bucket is forgotten even so. An attacker with more
    addresses than that can reset the oldest ones' windows, but not grow the coordinator's memory
    or slow its other requests (``benchmarks/bench_rate_limiter.py``)."""

    def __init__(self, limit: int, window_s: float = 60.0, *, max_buckets: int = 50_000,
                 clock=time.monotonic):
        self.limit, self.window_s, self.max_buckets, self.clock = limit, window_s, max_buckets, clock
        self._events: OrderedDict[str, deque] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._next_sweep = clock() + window_s / 4

    def __len__(self) -> int:
        return len(self._events)

    def allow(self, client: str) -> bool:
        now = self.clock()
        with self._lock:
            if now >= self._next_sweep:
                self._sweep(now)
            events = self._events.get(client)
            if events is None:
                events = self._events[client] = deque()
                while len(self._events) > self.max_buckets:
                    self._events.popitem(last=False)
            else:
                self._events.move_to_end(client)
            while events and events[0] < now - self.window_s:
                events.popleft()
            if len(events) >= self.limit:
                return False
            events.append(now)
            return True

    def _sweep(self, now: float) -> None:
        """Forget the buckets with no event left in the window (they sit at the front)."""
        self._next_sweep = now + self.window_s / 4
        while self._events:
            client, events = next(iter(self._events.items()))
            if events and events[-1] >= now - self.window_s:
                break
            del self._events[client]


def _check_limit(limit: int, most: int) -> None:
    """A list endpoint's ``limit``, 1 to ``most`` (every list a stranger can fill has a cap)."""
    if not 1 <= limit <= most:
        raise HTTPException(422, f"limit must be between 1 and {most}")


def _finite(data):
    """``data`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(data, float):
        return data if data == data and abs(data) != float("inf") else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    return data


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class JsonFile:
    """A JSON file read again only when it changed (its inode, size or mtime): ``/api/join``
    serves ``run.json`` to every volunteer's schedule poll (1,000 volunteers: ~67 reads a second),
    and the run's processes replace it (write, then rename) only when the run changes."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple | None = None
        self._value = None
        self._lock = threading.Lock()

    def read(self):
        """The parsed file, or None while it is missing or not JSON."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if stamp != self._seen:
                self._value, self._seen = _read_json(self.path), stamp
            return self._value


def _inside(root: Path, relative: str) -> Path:
    """``root / relative`` if it stays inside root and is a file; else 404 (no path traversal).
    A NUL byte is 400: no file name holds one, and the OS calls refuse it with an exception."""
    if "\0" in relative:
        raise HTTPException(400, "bad file path: it contains a NUL byte (%00)")
    root = root.resolve()
    try:
        path = (root / relative).resolve()
        found = root in path.parents and path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, ...
        found = False
    if not found:
        raise HTTPException(404, f"no such file: {relative[:200]}")
    return path


def other_protocol_refusal(theirs, version, install: str) -> str:
    """What a volunteer of another protocol is told: what runs here and the line that installs it."""
    who = (f"this crowdtrain ({str(version)[:60]}, protocol {theirs})" if theirs is not None
           else "this crowdtrain (from before protocol numbers)")
    return (f"{who} cannot train with this run, which runs crowdtrain {release.full_version()} (protocol "
            f"{release.PROTOCOL}). Install the coordinator's crowdtrain, then join again:\n\n    {install}\n")


def _memcalc_run(run_dir: Path) -> dict | None:
    """The memory calculator's starting point on this run: its model preset and optimizer settings
    (from ``coordinator.json``); None before a coordinator wrote one."""
    from crowdtrain.memcalc.architectures import OUR_PRESETS

    try:
        spec = json.loads((run_dir / "coordinator.json").read_text())
        model, swarm = spec["task"]["model"], spec["swarm"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    preset = spec.get("preset")
    if preset not in OUR_PRESETS:
        return None
    sync = swarm.get("mode", "sync") == "sync"
    lamb = sync or swarm.get("inner_optimizer") == "lamb8bit"
    defaults = {"model": f"crowdtrain-{preset}", "optimizer": "8bit" if lamb else "fp32",
                "offload": bool(sync and swarm.get("offload_optimizer", True)),
                "reversible": bool(model.get("reversible")), "checkpointing": bool(model.get("checkpointing")),
                "shared_groups": None}  # blank: the preset's own sharing
    optimizer = ("8-bit LAMB" + (", offloaded to the CPU" if defaults["offload"] else "")) if lamb else "AdamW"
    return {"defaults": defaults,
            "note": f"Opened on this run: the {preset} preset's model, {optimizer} "
                    f"({'sync' if sync else 'DiLoCo'} mode). Change any setting to size another machine."}


def create_app(run_dir: str | Path, *, store: Store, shards_dir: str | Path | None = None,
               text_tokenizer: str | Path | None = None, auth: AuthSettings | None = None,
               public_url: str = "http://127.0.0.1:8000", checkpoint_dir: str | Path | None = None) -> FastAPI:
    from crowdtrain.coordinator.api_docs import add_api_docs
    from crowdtrain.memcalc.web import create_router as memcalc_router

    run_dir = Path(run_dir)
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else run_dir / "checkpoints"
    auth = auth or AuthSettings(key_path=run_dir / "coordinator_key.pem")
    signing_key = CoordinatorKey.load_or_create(auth.key_path)
    # The crowdtrain this process runs, as the wheel volunteers install (crowdtrain.release).
    wheel = release.build_wheel(run_dir / "install")
    install = release.install_line(public_url, wheel)
    key_fingerprint = fingerprint(signing_key.public_key)
    version_info = {"version": release.full_version(), "protocol": release.PROTOCOL, "build": release.build_id(),
                    "install": install, "wheel": f"{public_url.rstrip('/')}/install/{wheel.filename}",
                    "wheel_sha256": wheel.sha256, "fingerprint": key_fingerprint}
    # What the signed answers vouch for (crowdtrain.coordinator.manifest, crowdtrain.runspec.trust).
    hashes = FileHashes(run_dir / CACHE_FILE)
    run_files = fixed_files(hashes, wheel_name=wheel.filename, wheel_sha256=wheel.sha256,
                            shards_dir=Path(shards_dir) if shards_dir is not None else None,
                            served_shard=SERVED_SHARD_FILE,
                            text_tokenizer=Path(text_tokenizer) if text_tokenizer is not None else None)

    def signed(data, request: Request, status_code: int = 200) -> Response:
        """``data`` as JSON, with the coordinator's signature of the exact bytes and the request's
        nonce (volunteers act on it; crowdtrain.runspec.trust)."""
        try:
            body = json.dumps(data, allow_nan=False).encode()
        except ValueError:  # NaN or infinity in a broken run.json: null, which volunteers refuse by name
            body = json.dumps(_finite(data)).encode()
        return Response(body, status_code=status_code, media_type="application/json",
                        headers=sign_answer(signing_key, body, request.headers.get(NONCE_HEADER)))
    limiter = RateLimiter(auth.requests_per_minute)
    run_json = JsonFile(run_dir / "run.json")
    # /docs from files this process serves (crowdtrain.coordinator.api_docs): FastAPI's own loads
    # them from a CDN, a blank page offline. No ReDoc, which would too.
    app = FastAPI(title="crowdtrain coordinator", docs_url=None, redoc_url=None,
                  description="Join information, access tokens, live status, metrics, leaderboard, shards, "
                              "checkpoints and samples of one collaborative run.")
    add_api_docs(app)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"request body too large (limit {MAX_BODY_BYTES} bytes)"}, status_code=413)
        if length is None and request.method in ("POST", "PUT", "PATCH"):
            body = b""
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    return JSONResponse({"detail": f"request body too large (limit {MAX_BODY_BYTES} bytes)"},
                                        status_code=413)
            request._body = body  # starlette reads the cached body downstream
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        # FastAPI's own answer echoes every bad value back; one that JSON cannot encode (a lone
        # surrogate, "\ud800", in a user name) then turned the 422 into a 500. Name the field and
        # the problem, not the value.
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    # The memory calculator page, for volunteers sizing a GPU, with the way back to the run's pages.
    app.include_router(memcalc_router("/memcalc", nav=NAV, site=True, run=_memcalc_run(run_dir)))
    app.include_router(pages_router(run_dir=run_dir, store=store, public_url=public_url, auth_mode=auth.mode,
                                   checkpoint_dir=checkpoint_dir, install=install, pin=key_fingerprint))

    @app.get("/api/version", summary="The crowdtrain this coordinator runs: version, protocol, and the line that "
                                     "installs it (its wheel, served here), and the fingerprint of the key "
                                     "that signs the run's answers")
    def api_version(request: Request) -> Response:
        return signed(version_info, request)

    @app.get("/api/manifest", summary="sha256 of every file served here (wheel, shards, tokenizer, checkpoints), "
                                      "signed like /api/join (X-Crowdtrain-Signature)")
    def api_manifest(request: Request) -> Response:
        live = [c["name"] for c in store.checkpoints() if not c.get("pruned") and isinstance(c.get("name"), str)]
        return signed({"fingerprint": key_fingerprint,
                       "files": {**run_files, **checkpoint_files(hashes, checkpoint_dir, live, CHECKPOINT_FILES)}},
                      request)

    def notebook(build, filename: str) -> Response:
        run_id = (run_json.read() or {}).get("run_id")
        kwargs = {"auth_mode": auth.mode} if build is join_notebook else {}
        kwargs["pin"] = key_fingerprint
        body = json.dumps(build(public_url, run_id=run_id if isinstance(run_id, str) else None, **kwargs), indent=1)
        return Response(body, media_type="application/x-ipynb+json",
                        headers={"Content-Disposition": f'attachment; filename="{filename}"'})

    @app.get("/join.ipynb", summary="A notebook that installs this coordinator's crowdtrain and joins the run "
                                    "(Colab, Kaggle, Jupyter)")
    def join_ipynb():
        return notebook(join_notebook, "join.ipynb")

    @app.get("/generate.ipynb", summary="A notebook that draws the run's prompts from its latest checkpoint")
    def generate_ipynb():
        return notebook(generate_notebook, "generate.ipynb")

    @app.get("/api/prompts", summary="The prompts the run draws sample images for: [{prompt, tag}]")
    def api_prompts() -> list[dict]:
        return [{"prompt": p.get("prompt"), "tag": p.get("tag")} for p in load_run_prompts(run_dir) or []
                if isinstance(p, dict) and isinstance(p.get("prompt"), str)]

    @app.head("/install/{filename}", include_in_schema=False)
    @app.get("/install/{filename}", summary="This coordinator's crowdtrain as a wheel (see /api/version)")
    def install_wheel(filename: str):
        if filename != wheel.filename:
            raise HTTPException(404, f"this coordinator serves {wheel.filename} only; install it with: {install}")
        return FileResponse(wheel.path, media_type="application/zip")

    def join_info() -> dict:
        info = run_json.read()
        if info is None:
            raise HTTPException(503, "the run is starting: its first peer is not up yet; retry in a few seconds")
        return info

    @app.get("/api/join", summary="Everything a volunteer needs to join, as data (on an allowlist run, the "
                                  "swarm's addresses only with `Authorization: Bearer KEY`)")
    def api_join(request: Request, authorization: str | None = Header(None), protocol: int | None = None,
                 version: str | None = None) -> Response:
        """``protocol``, ``version``: the volunteer's crowdtrain (``crowdtrain join`` sends them first);
        another protocol gets 409 with the line that installs this coordinator's."""
        if protocol is not None and protocol != release.PROTOCOL:
            store.bump("joins_refused_protocol")
            return signed({"detail": other_protocol_refusal(protocol, version, install), "install": install,
                           "crowdtrain": version_info}, request, status_code=409)
        info = join_info()
        if not isinstance(info, dict):
            return signed(info, request)  # a broken run.json: volunteers refuse it, with the reason
        info = dict(info)
        info["crowdtrain"] = {k: version_info[k] for k in ("version", "protocol", "install")}
        info["files"] = run_files
        # Files are fetched by URL: the coordinator's own paths are nobody else's business.
        if isinstance(info.get("text_tokenizer"), dict):
            info["text_tokenizer"] = {k: v for k, v in info["text_tokenizer"].items() if k != "path"}
        if auth.mode == "allowlist":
            scheme, _, api_key = (authorization or "").partition(" ")
            if scheme.lower() != "bearer" or not api_key or store.user_for_key(api_key) is None:
                info["initial_peers"] = []  # an invited volunteer asks with their key
                if api_key:
                    # The answer tells a valid key from a wrong one: guesses spend the address's
                    # budget of token requests, as they would at /api/token.
                    client = request.client.host if request.client else "unknown"
                    if not limiter.allow(f"address:{client}"):
                        store.bump("token_requests_rate_limited")
                        raise HTTPException(429, f"too many requests with unknown API keys from {client}; "
                                                 "wait a minute and retry")
        return signed(info, request)

    @app.post("/api/token", summary="An access token for this peer's key (send `Authorization: Bearer KEY` "
                                    "in allowlist runs)")
    def api_token(body: TokenRequest, request: Request, authorization: str | None = Header(None)) -> dict:
        client = request.client.host if request.client else "unknown"
        api_key = None
        if authorization:
            scheme, _, api_key = authorization.partition(" ")
            if scheme.lower() != "bearer" or not api_key:
                raise HTTPException(401, "send the API key as `Authorization: Bearer KEY`")
        user = store.user_for_key(api_key) if api_key else None
        # A valid key has its own budget, so volunteers behind one address (a lab's NAT) do not
        # spend each other's, and a refused or guessing client cannot lock them out. Everything
        # else (no key, a wrong or revoked one) shares its address's budget.
        bucket = f"user:{user}" if user is not None else f"address:{client}"
        if not limiter.allow(bucket):
            store.bump("token_requests_rate_limited")
            who = f"user {user!r}" if user is not None else client
            raise HTTPException(429, f"too many token requests from {who}; wait a minute and retry")
        if api_key:
            if user is None:
                store.bump("token_requests_refused")
                raise HTTPException(403, "this API key is unknown or was revoked; ask the organizer for a new one "
                                         "(`crowdtrain users add NAME`)")
        elif auth.mode == "allowlist":
            store.bump("token_requests_refused")
            raise HTTPException(401, "this run admits invited users only: pass your API key with "
                                     "`crowdtrain join URL --key KEY` (the organizer makes one with "
                                     "`crowdtrain users add NAME`)")
        else:
            user = body.user
            if not valid_user_name(user) or user == "coordinator":
                raise HTTPException(422, f"--user must be {USER_NAME_RULE}, got {user!r}")
            if store.is_revoked(user):
                raise HTTPException(403, f"user {user!r} was revoked by the organizer")
        public_key = body.public_key.encode()
        try:
            peer_id = peer_id_of_key(public_key)
        except ValueError as e:
            raise HTTPException(422, f"public_key: {e}") from e
        if body.peer_id and body.peer_id != peer_id:
            store.bump("token_requests_refused")
            raise HTTPException(422, f"peer_id {body.peer_id[:60]!r} is not the peer ID of public_key ({peer_id})")
        # Only the key's holder may bind it (and its peer's samples) to a user name.
        if not body.signature:
            store.bump("token_requests_refused")
            raise HTTPException(403, "unsigned token request: this coordinator wants it signed by the peer's key; "
                                     "upgrade crowdtrain")
        try:
            check_token_request(public_key, body.user, body.timestamp, body.signature)
        except ValueError as e:
            store.bump("token_requests_refused")
            raise HTTPException(403, str(e)) from e
        if body.protocol != release.PROTOCOL:
            # Without a token a peer of another protocol cannot enter the swarm: every peer refuses
            # its DHT requests, averaging and state downloads (crowdtrain.swarm.auth), and the
            # coordinator its metrics records.
            store.bump("tokens_refused_protocol")
            raise HTTPException(409, other_protocol_refusal(body.protocol, None, install))
        try:
            token = signing_key.issue(user, public_key, lifetime_s=auth.token_lifetime_s)
        except ValueError as e:
            raise HTTPException(422, f"public_key: {e}") from e
        if not api_key:
            store.ensure_open_user(user)
        store.peer_joined(peer_id, user, body.public_key)
        store.bump("tokens_issued")
        return {**token, "lifetime_s": auth.token_lifetime_s}

    @app.get("/api/status", summary="Epoch, schedule, active peers, swarm throughput, loss, time to the end")
    def api_status() -> dict:
        status = run_status(run_dir, store)
        status["run_id"] = join_info()["run_id"]
        return status

    @app.get("/api/history", summary="The swarm over time: training loss, active peers, samples/s, epoch; "
                                     "at checkpoints also valid_loss, {split: loss} on the held-out splits")
    def api_history(since: float = 0.0, limit: int = 5000) -> list[dict]:
        """Points oldest first, every few seconds: ``loss`` is the mean of the active peers' training
        losses. A point taken at a checkpoint carries ``valid_loss``, the model's mean loss on fixed
        rows of each split of the run's data but train (e.g. ``{"valid": 2.26, "heldout": 3.23}``);
        it is null on the others. ``gap`` points (all values null) mark downtime."""
        _check_limit(limit, 100_000)
        # The point the caller already has (the last one up to `since`) decides whether the first
        # new one follows a downtime; the charts draw gaps as gaps.
        before = store.swarm_point_before(since) if since > 0 else None
        return mark_gaps(store.swarm_history(since=since, limit=limit), before=before)

    @app.get("/api/metrics", summary="Metrics records of the peers, oldest first")
    def api_metrics(limit: int = 1000, peer_id: str | None = None) -> list[dict]:
        _check_limit(limit, 100_000)
        return store.metrics(limit=limit, peer_id=peer_id)

    # Users and peers are named by strangers (an open run's --user, a fresh identity per process):
    # their lists are capped, the most relevant first.
    @app.get("/api/leaderboard", summary="Per user: samples that went into global steps, steps, compute time, "
                                         "last seen; the top `limit` (at most 10000)")
    def api_leaderboard(limit: int = 1000) -> list[dict]:
        _check_limit(limit, 10_000)
        return store.leaderboard()[:limit]

    @app.get("/api/peers", summary="Peers seen, newest first (active ones reported within the last minute); "
                                   "the newest `limit` (at most 10000)")
    def api_peers(active: bool = False, limit: int = 1000) -> list[dict]:
        _check_limit(limit, 10_000)
        return store.peers(active_only=active, limit=limit)

    @app.get("/api/checkpoints", summary="Saved checkpoints, oldest first, with training and validation loss; "
                                         "best: the lowest validation loss")
    def api_checkpoints() -> list[dict]:
        """``loss``: the mean training loss of the active peers when it was taken; ``valid_loss`` /
        ``valid_rows``: {split: mean loss} and {split: rows} on the held-out splits (null when not
        measured); ``best``: the one with the lowest ``valid`` loss, kept besides the newest
        ``--keep-checkpoints``."""
        return store.checkpoints()

    @app.get("/api/samples", summary="Images generated from checkpoints for fixed prompts, newest first")
    def api_samples(limit: int = 200) -> list[dict]:
        _check_limit(limit, 10_000)
        return [{**s, "url": f"/files/{s['path']}"} for s in store.samples(limit=limit)]

    @app.get("/api/counters", summary="Refused and rate-limited requests, dropped records, tokens issued")
    def api_counters() -> dict:
        return store.counters()

    # HEAD as its own route (one operation per method in the OpenAPI schema: a shared one gets
    # the same operation id twice).
    @app.head("/checkpoints/{name}/{filename}", include_in_schema=False)
    @app.get("/checkpoints/{name}/{filename}", summary="Download one file of a checkpoint")
    def checkpoint_file(name: str, filename: str):
        if filename not in CHECKPOINT_FILES:
            raise HTTPException(404, f"checkpoints hold only {sorted(CHECKPOINT_FILES)}")
        return FileResponse(_inside(checkpoint_dir, f"{name}/{filename}"),
                            filename=f"{name}-{filename}" if filename != "config.json" else None)

    @app.get("/files/samples/{relative:path}", summary="Sample images")
    def sample_file(relative: str):
        return FileResponse(_inside(run_dir / "samples", relative))

    if shards_dir is not None:
        shards_root = Path(shards_dir)

        # HEAD too: streaming readers ask a shard's size before reading byte ranges.
        @app.head("/shards/{relative:path}", include_in_schema=False)
        @app.get("/shards/{relative:path}", summary="Data shards and their manifest (HTTP Range supported)")
        def shard(relative: str):
            # What volunteers read and nothing else: the folder also holds the organizer's fit
            # report (a grid of their original pictures) and the list of skipped files.
            path = _inside(shards_root, relative)
            if not SERVED_SHARD_FILE.fullmatch(relative):
                raise HTTPException(404, f"no such file: {relative[:200]} (the shard folder serves its "
                                         "*.parquet shards and *.json manifests only)")
            return FileResponse(path)

    if text_tokenizer is not None:
        tokenizer_path = Path(text_tokenizer)

        @app.get("/assets/text_tokenizer.json", summary="The run's text tokenizer")
        def tokenizer():
            return FileResponse(tokenizer_path)

    return app
