"""Authentication of every peer, on the DHT *and* in averaging.

The paper's run authenticated DHT requests only; anyone who knew a peer's address could still
join its averaging groups and send it gradient parts. Here both are closed:

* **Identity.** A peer's libp2p identity is an RSA key (hivemind's own format); the same key signs
  its DHT requests. The coordinator's access token binds that public key (hence the peer ID, a
  hash of it) to a user name until an expiry time (see ``crowdtrain.runspec.tokens``).
* **DHT.** :class:`SwarmAuthorizer` plugs into hivemind's ``TokenAuthorizerBase``: every DHT
  request and response carries the sender's token and a signature over the message by its key;
  a peer without a valid token gets no answers, so it cannot even bootstrap.
* **Averaging.** Each peer publishes its token in the DHT under ``{run_id}_auth``. The averagers'
  RPC handlers (matchmaking, all-reduce parts, state download) are wrapped by
  :class:`AccessGuard`, which looks up the caller's peer ID (authenticated by libp2p's secure
  channel) among the valid tokens and refuses everyone else with ``PermissionError``.
* **Revocation.** Tokens are short-lived and refreshed by :class:`TokenKeeper`; a revoked user
  cannot refresh, and its peers are refused everywhere once the token expires.

**When the token service is down** (the coordinator restarting or unreachable), nobody can get
a new token, and the rule stays the safe one: a token is honoured until its expiry time and not
a second longer, by the DHT (:meth:`SwarmAuthorizer.is_token_valid`) and by the averagers
(:class:`AccessGuard`); nothing extends a token or admits a peer without one, so an outage
never lets in a revoked or unknown peer. To make outages harmless anyway, peers renew early and
keep trying: a token is renewed once a quarter of its lifetime has passed (:func:`refresh_margin_s`),
and a failed renewal is retried with back-off (5 s, doubling, at most
:func:`refresh_retry_max_s`, a twentieth of the lifetime) while the current token stays in use.
So every peer still holds a valid token when an outage begins, for at least 3/4 of the lifetime,
and gets a fresh one within one back-off step of the coordinator's return:
**a coordinator outage of up to 0.7 x token_lifetime_s (7 minutes at the default 600 s) goes
unnoticed by the swarm.** In a longer one, tokens expire one by one; peers refuse those whose
token ran out (each keeps training on its own, data permitting, and is admitted again, its
state re-synced, as soon as the coordinator is back and its renewal succeeds).

Tuning: ``token_lifetime_s`` (coordinator, ``--token-lifetime-s``) is both how long a revoked
user's peers keep access and, times 0.7, the longest outage of the coordinator the swarm rides
out intact: to survive maintenance of D minutes, set it to about D / 0.7 minutes. Renewals cost
one signed HTTP request per peer per quarter lifetime. An averager that does not know a caller
looks its token up in the DHT, and once more a moment later before it refuses (a lookup on a busy
machine can miss a record). If peers still log "refused: no valid access token" right after
joining, the DHT has not yet spread their token record: it is retried on the next matchmaking
attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon import P2P
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from crowdtrain.runspec.tokens import CoordinatorKey, token_payload, token_request, verify_token
from crowdtrain.swarm.hivemind_seam.p2p import current_token, rsa_key_from_der, with_wrapped_handlers

logger = logging.getLogger(__name__)


TOKEN_FIELDS = ("username", "public_key", "expiration_time", "signature")


def auth_key(run_id: str) -> str:
    return f"{run_id}_auth"


def refresh_margin_s(lifetime_s: float) -> float:
    """Renew a token once it has less than this left: after a quarter of its lifetime (see the
    module docstring for why: the longer a token has left when an outage begins, the longer
    the swarm rides it out)."""
    return 0.75 * lifetime_s


def refresh_retry_max_s(lifetime_s: float) -> float:
    """The longest wait between two tries to renew a token while the coordinator does not answer."""
    return max(1.0, lifetime_s / 20)


# ---- identities ------------------------------------------------------------------------------
def load_identity(path: str | Path) -> RSAPrivateKey:
    """The peer's libp2p identity (created on first use) as hivemind's RSA key, to sign with."""
    path = Path(path)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    data = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    if data.key_type != crypto_pb2.RSA:
        raise ValueError(f"{path} is not an RSA identity; delete it and a new one is made")
    return rsa_key_from_der(data.data)


def peer_id_of(public_key: bytes) -> PeerID:
    """The libp2p peer ID of an RSA public key in OpenSSH encoding (as carried in tokens)."""
    key = serialization.load_ssh_public_key(public_key)
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


# ---- where tokens come from -------------------------------------------------------------------
class AccessDenied(RuntimeError):
    """The coordinator refused this peer a token (unknown or revoked key, allowlist run)."""


class TokenRequestRejected(AccessDenied):
    """The coordinator could not accept the token request itself (4xx other than 401/403, 408 and
    429: a malformed or unexpected request). Asking again sends the same request: final."""


class HttpTokenSource:
    """Asks the coordinator for a token: ``POST /api/token``, signed by this peer's key (the proof
    that it holds the key), with the API key in allowlist runs."""

    def __init__(self, token_url: str, *, private_key: RSAPrivateKey, api_key: str | None, user: str,
                 timeout_s: float = 15.0):
        self.token_url, self.private_key = token_url, private_key
        self.api_key, self.user, self.timeout_s = api_key, user, timeout_s
        if api_key:
            from crowdtrain.runspec.trust import check_key_transport

            check_key_transport(token_url)

    def __call__(self) -> dict:
        body = json.dumps(token_request(self.private_key.get_public_key().to_bytes(), self.user,
                                        self.private_key.sign)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.token_url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            try:
                detail = json.loads(detail)["detail"]
            except (ValueError, KeyError, TypeError):
                pass
            if e.code in (401, 403):
                raise AccessDenied(f"the coordinator refused an access token ({e.code}): {detail}") from e
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise TokenRequestRejected(f"the coordinator rejected the token request ({e.code}): {detail}") from e
            raise ConnectionError(f"token request failed ({e.code}): {detail}") from e  # 408, 429, 5xx: retry


class LocalTokenSource:
    """The coordinator's own peers sign their tokens with the coordinator key directly."""

    def __init__(self, key_path: str | Path, *, public_key: bytes, user: str, lifetime_s: float):
        self.key_path, self.public_key, self.user, self.lifetime_s = str(key_path), public_key, user, lifetime_s

    def __call__(self) -> dict:
        return CoordinatorKey.load_or_create(self.key_path).issue(self.user, self.public_key,
                                                                  lifetime_s=self.lifetime_s)


def to_proto(token: dict) -> AccessToken:
    return AccessToken(username=token["username"], public_key=token["public_key"].encode(),
                       expiration_time=token["expiration_time"], signature=token["signature"].encode())


def from_proto(token: AccessToken) -> dict:
    return {"username": token.username, "public_key": token.public_key.decode(errors="replace"),
            "expiration_time": token.expiration_time, "signature": token.signature.decode(errors="replace")}


# ---- the DHT side ------------------------------------------------------------------------------
class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol with the coordinator as the authority. Runs in the DHT process.

    hivemind asks for a new token before *every* signed DHT message once the current one is within
    ``refresh_margin_s`` of expiring. A refresh that fails (coordinator restarting, rate limit, key
    revoked) would then become one HTTP request per DHT message. Instead the still-valid token is
    kept and the coordinator is asked again only after a backoff (1 s, doubling, at most
    ``retry_max_s``, default a quarter of the margin); a refusal (revoked key) is final for this
    process. Peers pass :func:`refresh_margin_s` and :func:`refresh_retry_max_s` of the run's lifetime.
    """

    def __init__(self, local_private_key: RSAPrivateKey, coordinator_public_key: bytes,
                 token_source: Callable[[], dict], *, refresh_margin_s: float = 30.0,
                 retry_max_s: float | None = None):
        super().__init__(local_private_key)
        self.coordinator_public_key = coordinator_public_key
        self.token_source = token_source
        self.refresh_margin_s = refresh_margin_s
        self.retry_max_s = max(1.0, refresh_margin_s / 4) if retry_max_s is None else retry_max_s
        self._coordinator = RSAPublicKey.from_bytes(coordinator_public_key)
        self._next_try, self._failures, self._denied = 0.0, 0, None
        self.requests = 0  # calls of token_source, for tests and diagnostics

    async def get_token(self) -> AccessToken:
        current = current_token(self)
        still_valid = current is not None and self.is_token_valid(current)
        if self._denied is not None or time.monotonic() < self._next_try:
            if still_valid:
                return current
            raise self._denied or ConnectionError("no valid access token; the last refresh failed, retrying soon")
        self.requests += 1
        try:
            token = await asyncio.get_running_loop().run_in_executor(None, self.token_source)
        except AccessDenied as e:
            self._denied = e
        except Exception as e:
            self._failures += 1
            backoff = min(2.0 ** (self._failures - 1), self.retry_max_s)
            self._next_try = time.monotonic() + backoff
            logger.debug("token refresh failed (%s); next try in %.1fs", e, backoff)
            if not still_valid:
                raise
        else:
            self._failures, self._next_try = 0, 0.0
            return to_proto(token)
        if still_valid:
            return current
        raise self._denied

    def is_token_valid(self, access_token: AccessToken) -> bool:
        payload = token_payload(access_token.username, access_token.public_key, access_token.expiration_time)
        if not self._coordinator.verify(payload, access_token.signature):
            return False
        try:
            return float(access_token.expiration_time) > get_dht_time()
        except ValueError:
            return False

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return float(access_token.expiration_time) - get_dht_time() < self.refresh_margin_s


class TokenKeeper:
    """Keeps this peer's token fresh and published in the DHT, so averagers will talk to it.

    Renews after a quarter of the lifetime; a failed renewal (coordinator down) is retried after
    5 s, doubling up to :func:`refresh_retry_max_s`, while the published token stays valid (see
    the module docstring for what that buys). ``on_denied`` is called (once) when the coordinator
    refuses a renewal: the user was revoked.
    """

    def __init__(self, dht, run_id: str, signer, token_source: Callable[[], dict], *, lifetime_s: float,
                 on_denied: Callable[[str], None] | None = None):
        self.dht, self.run_id, self.signer, self.token_source = dht, run_id, signer, token_source
        self.lifetime_s, self.on_denied = lifetime_s, on_denied
        self.token: dict | None = None
        self.failures = 0  # renewals failed in a row
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="token-keeper", daemon=True)

    def start(self, token: dict | None = None) -> "TokenKeeper":
        self.token = token or self.token_source()
        # Wait for the first record: averagers elsewhere look it up when this peer first calls them.
        if not self.publish().result(timeout=30):
            logger.warning("could not publish the access token in the DHT yet; retrying with the next refresh")
        self._thread.start()
        return self

    def publish(self):
        record = {k: self.token[k] for k in TOKEN_FIELDS}  # exactly the schema's fields, or validators refuse it
        return self.dht.store(auth_key(self.run_id), subkey=self.signer.local_public_key, value=record,
                              expiration_time=float(self.token["expiration_time"]), return_future=True)

    def _loop(self) -> None:
        wait = self.renew_interval_s
        while wait is not None and not self._stop.wait(wait):
            wait = self.renew()

    @property
    def renew_interval_s(self) -> float:
        return max(1.0, self.lifetime_s - refresh_margin_s(self.lifetime_s))

    def renew(self) -> float | None:
        """Ask for a new token and publish it; the seconds until the next try (None: revoked, stop)."""
        try:
            token = self.token_source()
        except AccessDenied as e:
            logger.error("%s", e)
            if self.on_denied is not None:
                self.on_denied(str(e))
            return None
        except Exception as e:  # coordinator unreachable for now: the current token is still valid
            self.failures += 1
            wait = min(5.0 * 2 ** (self.failures - 1), refresh_retry_max_s(self.lifetime_s))
            left = float(self.token["expiration_time"]) - time.time()
            logger.warning("could not renew the access token (%s); retrying in %.0f s. The current one is valid for "
                           "%.0f s more%s", e, wait, max(0.0, left),
                           "" if left > 0 else ": until a renewal succeeds, the other peers will refuse this one")
            return wait
        self.token, self.failures = token, 0
        self.publish()
        return self.renew_interval_s

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop renewing, and wait (bounded) for a renewal in flight: the DHT is shut down next,
        and a store still running then holds up its shutdown."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


# ---- the averaging side ------------------------------------------------------------------------
class AccessGuard:
    """Decides whether a remote peer may talk to this peer's averagers. Runs in averager processes.

    Allowed peers are cached until their token expires; an unknown caller triggers a DHT lookup
    of the published tokens, at most one every ``lookup_interval_s`` (so a flood of strangers
    costs at most that), and is refused if two lookups (the second once the interval allows it)
    do not find it.
    """

    SECOND_LOOK_S = 2.0  # the longest an unknown caller waits for a second lookup

    def __init__(self, *, run_id: str, coordinator_public_key: bytes, lookup_interval_s: float = 1.0):
        self.run_id, self.coordinator_public_key = run_id, coordinator_public_key
        self.lookup_interval_s = lookup_interval_s
        self._allowed: dict[PeerID, tuple[float, str]] = {}
        self._last_lookup = -float("inf")
        self._lock: asyncio.Lock | None = None
        # Shared memory: the checks run in averager processes forked after this object is made.
        self._refused = mp.Value("q", 0)

    @property
    def refused(self) -> int:
        """Requests refused so far, by all averagers using this guard."""
        return self._refused.value

    def _is_allowed(self, peer_id: PeerID) -> bool:
        entry = self._allowed.get(peer_id)
        return entry is not None and entry[0] > time.time()

    def learn(self, tokens: list[dict]) -> None:
        for token in tokens:
            if verify_token(token, self.coordinator_public_key):
                try:
                    self._allowed[peer_id_of(token["public_key"].encode())] = (float(token["expiration_time"]),
                                                                              token["username"])
                except ValueError:
                    continue

    async def check(self, dht, peer_id: PeerID) -> None:
        if self._is_allowed(peer_id):
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        # A second look, once the rate limit allows it (within SECOND_LOOK_S): a lookup can miss a
        # token a groupmate published long ago (a busy machine's DHT request that failed, or came
        # back from nodes without it; seen 23 s after two peers joined), and a refusal costs the
        # caller its part of a round. A stranger is refused a moment later, with no extra lookups.
        for look in range(2):
            async with self._lock:
                wait = self.lookup_interval_s - (time.monotonic() - self._last_lookup)
                if not self._is_allowed(peer_id) and wait <= 0:
                    self._last_lookup, wait = time.monotonic(), self.lookup_interval_s
                    found = await dht.get(auth_key(self.run_id), latest=True, return_future=True)
                    if found is not None and isinstance(found.value, dict):
                        self.learn([entry.value for entry in found.value.values() if isinstance(entry.value, dict)])
            if self._is_allowed(peer_id) or look == 1 or wait > self.SECOND_LOOK_S:
                break
            await asyncio.sleep(wait)
        if not self._is_allowed(peer_id):
            with self._refused.get_lock():
                self._refused.value += 1
            raise PermissionError(f"refused: peer {peer_id} has no valid access token for run {self.run_id!r} "
                                  "(join with `crowdtrain join URL --key KEY`)")


class _GuardedHandlers:
    """Stands in for an averager when its RPC handlers are registered: checks, then delegates."""

    def __init__(self, averager, guard: AccessGuard, handlers):
        for handler in handlers:
            setattr(self, handler.method_name,
                    self._wrap(getattr(averager, handler.method_name), handler.stream_output, guard, averager))

    @staticmethod
    def _wrap(method, stream_output: bool, guard: AccessGuard, averager):
        if stream_output:
            async def guarded_stream(request, context):
                await guard.check(averager.dht, context.remote_id)
                async for item in method(request, context):
                    yield item
            return guarded_stream

        async def guarded(request, context):
            await guard.check(averager.dht, context.remote_id)
            return await method(request, context)
        return guarded


def guarded(averager_cls: type, guard: AccessGuard | None) -> type:
    """A subclass of a hivemind averager whose RPC handlers refuse peers without a valid token."""
    if guard is None:
        return averager_cls

    return with_wrapped_handlers(averager_cls, lambda averager, handlers: _GuardedHandlers(averager, guard, handlers),
                                 access_guard=guard)


def identity_path_for(cache_dir: str | Path, run_id: str, user: str) -> Path:
    """A fresh identity file for this process (two peers on one machine must not share one)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{run_id}-{user}")
    return Path(cache_dir).expanduser() / "identities" / f"{safe}-{os.getpid()}.key"
