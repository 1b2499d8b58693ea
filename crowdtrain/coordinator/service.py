"""The coordinator's HTTP service: the JSON API, access tokens, shards, checkpoints and the pages.

Reads the run's database (``crowdtrain.coordinator.db``) and the files the auxiliary peer writes
in the run folder (``run.json``, ``status.json``, ``checkpoints/``, ``samples/``); never imports
torch or hivemind. Shards are served with HTTP Range support (parquet readers seek).

Everything a client sends is bounded: request bodies over ``MAX_BODY_BYTES`` get 413, malformed
ones 422 with the field at fault, and ``POST /api/token`` is rate-limited (429) per API key, or
per client address without a valid one, so no client can crash the coordinator or touch stored
data it should not. A token request must be signed by the key it names, and the peer ID is derived
from that key, so nobody can re-assign another volunteer's peer (and its samples) to their name.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from crowdtrain import release
from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.notebooks import generate_notebook, join_notebook
from crowdtrain.data.sample_prompts import load_run_prompts
from crowdtrain.runspec.files import read_run_info, read_status
from crowdtrain.runspec.names import USER_NAME_RULE, valid_user_name
from crowdtrain.runspec.tokens import CoordinatorKey, check_token_request, peer_id_of_key
from crowdtrain.runspec.validation import memorising_problem

CHECKPOINT_FILES = {"config.json", "model.safetensors", "optimizer.safetensors", "text_tokenizer.json",
                    "image_tokenizer.safetensors"}
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


class RateLimiter:
    """At most ``limit`` events per ``window_s`` per bucket (a key or an address; a sliding window)."""

    def __init__(self, limit: int, window_s: float = 60.0):
        self.limit, self.window_s = limit, window_s
        self._events: dict[str, deque] = defaultdict(deque)
        self._lock = threading.Lock()

    def allow(self, client: str) -> bool:
        now = time.monotonic()
        with self._lock:
            events = self._events[client]
            while events and events[0] < now - self.window_s:
                events.popleft()
            if len(events) >= self.limit:
                return False
            events.append(now)
            if len(self._events) > 10_000:  # forget idle clients so the table stays small
                for key in [k for k, v in self._events.items() if not v]:
                    del self._events[key]
            return True


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


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


def time_to_the_end(*, epoch: int, total: int, epochs_per_second: float | None, samples_per_second: float,
                    target_batch_size: int | None) -> float | None:
    """Seconds until the swarm reaches ``total`` at its recent pace: the auxiliary peer's measure of
    global epochs per second over the last few minutes (``crowdtrain.runspec.schedule.EpochRate``);
    before two epochs have passed, the swarm's samples/s against the target batch. Not the pace
    over a fixed long window: early in a run that window held the minutes before the first volunteer
    arrived and the slow first epochs, and the estimate was 5x too long."""
    if not total:
        return None
    pace = epochs_per_second
    if not pace and target_batch_size:
        pace = samples_per_second / target_batch_size
    return max(total - epoch, 0) / pace if pace and pace > 0 else None


def run_status(run_dir: Path, store: Store) -> dict:
    """The run at a glance, for the API and the pages."""
    info, info_problem = read_run_info(run_dir)
    status, status_problem = read_status(run_dir)
    swarm = info.swarm if info is not None else {}
    schedule = info.schedule if info is not None and isinstance(info.schedule, dict) else None
    live = [p for p in status.peers if isinstance(p, dict)]  # the auxiliary peer lists the live ones only
    epoch = status.epoch
    if schedule is not None:  # total_epochs is None while a time budget is being sized
        total = int(schedule.get("total_epochs") or 0)
        finished_at = schedule.get("finished_at")
    else:  # an auxiliary peer from before schedules
        total, finished_at = int(status.total_epochs or swarm.get("total_epochs") or 0), status.finished_at
    eta_s = None  # unknown while nobody trains: the run is paused, not ending at the old pace
    if live and finished_at is None:
        samples_per_second = sum(float(p.get("samples_per_second") or 0.0) for p in live)
        eta_s = time_to_the_end(epoch=epoch, total=total, epochs_per_second=status.epochs_per_second,
                                samples_per_second=samples_per_second,
                                target_batch_size=swarm.get("target_batch_size") or status.target_batch_size)
        if not total and schedule is not None and schedule.get("time_budget_s") and schedule.get("started"):
            eta_s = max(0.0, schedule["started"] + schedule["time_budget_s"] - time.time())  # the budget's end
    live = _public_peers(status)
    losses = [p["loss"] for p in live]
    task = info.task if info is not None else {}
    problems = [p for p in (info_problem, status_problem, _memorising(store), turned_away(store.counters())) if p]
    failing = rounds_failing(status.rounds) if live else None
    if failing:
        problems.append(failing)
    return {"run_id": info.run_id if info is not None else None, "started": info is not None, "epoch": epoch,
            "total_epochs": total, "target_batch_size": swarm.get("target_batch_size"),
            "active_peers": len(live), "samples_per_second": float(status.samples_per_second),
            "loss": sum(losses) / len(losses) if losses else None, "eta_s": eta_s,
            "epochs_per_second": status.epochs_per_second,
            "finished": finished_at is not None, "finished_at": finished_at, "schedule": schedule or {},
            "last_checkpoint_epoch": status.last_checkpoint_epoch, "updated": status.updated,
            "peers": live, "model": task.get("model", {}), "data": task.get("data"),
            "rounds": status.rounds if isinstance(status.rounds, dict) else {}, "problems": problems}


# A volunteer's address (IP and port) is theirs to give: the public status says who trains, not where.
# Identity keys and their proofs (700 of a record's 1,100 bytes) are for the DHT's checks: no
# reader of the status needs them, and 200 dashboards download the list every 5 s.
_PRIVATE_FIELDS = frozenset({"maddrs", "identity", "identity_proof"})
_last_public: list = [None, []]  # [the RunStatus it was made from, the list]; read_status reuses objects


def _public_peers(status) -> list[dict]:
    if _last_public[0] is not status:
        _last_public[:] = [status, [{k: v for k, v in p.items() if k not in _PRIVATE_FIELDS}
                                    for p in status.peers if isinstance(p, dict)]]
    return _last_public[1]


def rounds_failing(rounds: dict) -> str | None:
    """A problem line when many of the swarm's recent rounds averaged with nobody although other
    peers were training (hivemind's "Averaging step failed: could not find a group"); None while
    rounds form. ``rounds``: ``status.json``'s ``rounds`` (crowdtrain.swarm.metrics.RoundHealth)."""
    try:
        total, apart = int(rounds.get("rounds", 0)), int(rounds.get("apart", 0))
        minutes = float(rounds.get("window_s", 300)) / 60
        users = [str(u)[:64] for u in rounds.get("users", [])][:10]
    except (AttributeError, TypeError, ValueError):
        return None
    if total < 4 or apart < max(2, total / 4):
        return None
    return (f"averaging rounds are failing: in the last {minutes:.0f} minutes, {apart} of the {total} rounds peers took "
            f"averaged with nobody although other peers were training (peers of {', '.join(users) or 'unknown users'}"
            "). Each such round costs its peers an averaging timeout and leaves them on different models. "
            "Check that volunteers can reach each other (the DHT port open; peers behind NAT join with "
            "--client-mode, and at least one peer must accept connections), that no machine runs more volunteers "
            "than it has cores (give each `crowdtrain join --threads 1`), and on slow or distant links raise "
            "--swarm matchmaking_time_s (and averaging_timeout_s) when starting the coordinator.")


def other_protocol_refusal(theirs, version, install: str) -> str:
    """What a volunteer of another protocol is told: what runs here and the line that installs it."""
    who = (f"this crowdtrain ({str(version)[:60]}, protocol {theirs})" if theirs is not None
           else "this crowdtrain (from before protocol numbers)")
    return (f"{who} cannot train with this run, which runs crowdtrain {release.full_version()} (protocol "
            f"{release.PROTOCOL}). Install the coordinator's crowdtrain, then join again:\n\n    {install}\n")


def turned_away(counters: dict) -> str | None:
    """A problem line when volunteers were turned away for running another crowdtrain."""
    joins, tokens = counters.get("joins_refused_protocol", 0), counters.get("tokens_refused_protocol", 0)
    if not joins and not tokens:
        return None
    return (f"{joins} join attempt(s) and {tokens} token request(s) came from a crowdtrain of another protocol than "
            f"this coordinator's (protocol {release.PROTOCOL}) and were refused; each was told the install line "
            "on the join page. If volunteers keep arriving with an old version, post that line where they found "
            "the run.")


def _memorising(store: Store) -> str | None:
    """The memorising warning (``crowdtrain.runspec.validation``), from every checkpoint's losses."""
    return memorising_problem(store.checkpoints(include_pruned=True))


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
    from crowdtrain.coordinator.pages import NAV, mark_gaps, create_router as pages_router
    from crowdtrain.memcalc.web import create_router as memcalc_router

    run_dir = Path(run_dir)
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else run_dir / "checkpoints"
    auth = auth or AuthSettings(key_path=run_dir / "coordinator_key.pem")
    signing_key = CoordinatorKey.load_or_create(auth.key_path)
    # The crowdtrain this process runs, as the wheel volunteers install (crowdtrain.release).
    wheel = release.build_wheel(run_dir / "install")
    install = release.install_line(public_url, wheel)
    version_info = {"version": release.full_version(), "protocol": release.PROTOCOL, "build": release.build_id(),
                    "install": install, "wheel": f"{public_url.rstrip('/')}/install/{wheel.filename}",
                    "wheel_sha256": wheel.sha256}
    limiter = RateLimiter(auth.requests_per_minute)
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
                                   checkpoint_dir=checkpoint_dir, install=install))

    @app.get("/api/version", summary="The crowdtrain this coordinator runs: version, protocol, and the line that "
                                     "installs it (its wheel, served here)")
    def api_version() -> dict:
        return version_info

    def notebook(build, filename: str) -> Response:
        run_id = (_read_json(run_dir / "run.json") or {}).get("run_id")
        kwargs = {"auth_mode": auth.mode} if build is join_notebook else {}
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
        info = _read_json(run_dir / "run.json")
        if info is None:
            raise HTTPException(503, "the run is starting: its first peer is not up yet; retry in a few seconds")
        return info

    @app.get("/api/join", summary="Everything a volunteer needs to join, as data (on an allowlist run, the "
                                  "swarm's addresses only with `Authorization: Bearer KEY`)")
    def api_join(request: Request, authorization: str | None = Header(None), protocol: int | None = None,
                 version: str | None = None) -> dict | list:
        """``protocol``, ``version``: the volunteer's crowdtrain (``crowdtrain join`` sends them first);
        another protocol gets 409 with the line that installs this coordinator's."""
        if protocol is not None and protocol != release.PROTOCOL:
            store.bump("joins_refused_protocol")
            return JSONResponse({"detail": other_protocol_refusal(protocol, version, install), "install": install,
                                 "crowdtrain": version_info}, status_code=409)
        info = join_info()
        if not isinstance(info, dict):
            return info  # a broken run.json: volunteers refuse it, with the reason
        info = dict(info)
        info["crowdtrain"] = {k: version_info[k] for k in ("version", "protocol", "install")}
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
        return info

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
        if not 1 <= limit <= 100_000:
            raise HTTPException(422, "limit must be between 1 and 100000")
        # The point the caller already has (the last one up to `since`) decides whether the first
        # new one follows a downtime; the charts draw gaps as gaps.
        before = store.swarm_point_before(since) if since > 0 else None
        return mark_gaps(store.swarm_history(since=since, limit=limit), before=before)

    @app.get("/api/metrics", summary="Metrics records of the peers, oldest first")
    def api_metrics(limit: int = 1000, peer_id: str | None = None) -> list[dict]:
        if not 1 <= limit <= 100_000:
            raise HTTPException(422, "limit must be between 1 and 100000")
        return store.metrics(limit=limit, peer_id=peer_id)

    @app.get("/api/leaderboard", summary="Per user: samples that went into global steps, steps, compute time, last seen")
    def api_leaderboard() -> list[dict]:
        return store.leaderboard()

    @app.get("/api/peers", summary="Peers seen, newest first (active ones reported within the last minute)")
    def api_peers(active: bool = False) -> list[dict]:
        return store.peers(active_only=active)

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
        if not 1 <= limit <= 10_000:
            raise HTTPException(422, "limit must be between 1 and 10000")
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
        @app.get("/shards/{relative:path}", summary="Data shards (HTTP Range supported)")
        def shard(relative: str):
            return FileResponse(_inside(shards_root, relative))

    if text_tokenizer is not None:
        tokenizer_path = Path(text_tokenizer)

        @app.get("/assets/text_tokenizer.json", summary="The run's text tokenizer")
        def tokenizer():
            return FileResponse(tokenizer_path)

    return app
