"""Access tokens, peer identities, and the guard in front of the averagers (no processes)."""

import asyncio
import json
import time

import pytest
from hivemind.p2p import PeerID

from crowdtrain.runspec.tokens import CoordinatorKey, peer_id_of_key, verify_token
from crowdtrain.swarm.auth import (AccessGuard, SwarmAuthorizer, _GuardedHandlers, from_proto, load_identity,
                                   peer_id_of, to_proto)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    coordinator = CoordinatorKey.load_or_create(d / "coordinator.pem")
    peer = load_identity(d / "peer.key")
    other = load_identity(d / "other.key")
    return d, coordinator, peer, other


def test_a_token_binds_user_key_and_expiry_and_any_change_breaks_it(keys):
    d, coordinator, peer, _ = keys
    public = peer.get_public_key().to_bytes()
    token = coordinator.issue("alice", public, lifetime_s=60)
    assert verify_token(token, coordinator.public_key)
    assert from_proto(to_proto(token)) == {k: token[k] for k in ("username", "public_key", "expiration_time",
                                                                 "signature")}
    for field, value in [("username", "mallory"), ("expiration_time", f"{time.time() + 9999:.3f}"),
                         ("public_key", keys[3].get_public_key().to_bytes().decode())]:
        assert not verify_token({**token, field: value}, coordinator.public_key), field
    assert not verify_token(token, CoordinatorKey.load_or_create(d / "impostor.pem").public_key)
    assert not verify_token(coordinator.issue("alice", public, lifetime_s=-1), coordinator.public_key), "expired"
    assert not verify_token({"username": "alice"}, coordinator.public_key), "malformed"
    with pytest.raises(ValueError, match="OpenSSH RSA public key"):
        coordinator.issue("alice", b"not a key", lifetime_s=60)


def test_the_coordinator_key_persists_and_a_corrupt_one_is_named(keys, tmp_path):
    d, coordinator, _, _ = keys
    assert CoordinatorKey.load_or_create(d / "coordinator.pem").public_key == coordinator.public_key
    (tmp_path / "bad.pem").write_text("garbage")
    with pytest.raises(ValueError, match="bad.pem is not a PEM private key"):
        CoordinatorKey.load_or_create(tmp_path / "bad.pem")


def test_the_peer_id_follows_from_the_public_key_in_the_token(keys):
    d, _, peer, other = keys
    assert peer_id_of(peer.get_public_key().to_bytes()) == PeerID.from_identity((d / "peer.key").read_bytes())
    # The web side's own derivation (it imports no hivemind) gives hivemind's answer.
    for name, key in (("peer", peer), ("other", other)):
        expected = PeerID.from_identity((d / f"{name}.key").read_bytes())
        assert peer_id_of_key(key.get_public_key().to_bytes()) == str(expected)
    assert peer_id_of(other.get_public_key().to_bytes()) != peer_id_of(peer.get_public_key().to_bytes())
    assert load_identity(d / "peer.key").get_public_key().to_bytes() == peer.get_public_key().to_bytes()


def test_the_dht_authorizer_accepts_only_coordinator_signed_live_tokens(keys):
    d, coordinator, peer, _ = keys
    public = peer.get_public_key().to_bytes()
    authorizer = SwarmAuthorizer(peer, coordinator.public_key, lambda: coordinator.issue("a", public, lifetime_s=60),
                                 refresh_margin_s=20)
    good = to_proto(coordinator.issue("alice", public, lifetime_s=60))
    assert authorizer.is_token_valid(good) and not authorizer.does_token_need_refreshing(good)
    assert authorizer.does_token_need_refreshing(to_proto(coordinator.issue("alice", public, lifetime_s=10)))
    forged = to_proto(CoordinatorKey.load_or_create(d / "forger.pem").issue("alice", public, lifetime_s=60))
    assert not authorizer.is_token_valid(forged)
    assert asyncio.run(authorizer.get_token()).username == "a"


def test_a_failing_refresh_keeps_the_live_token_and_backs_off_instead_of_flooding_the_coordinator(keys):
    from crowdtrain.swarm.auth import AccessDenied

    _, coordinator, peer, _ = keys
    public = peer.get_public_key().to_bytes()
    answers = [coordinator.issue("a", public, lifetime_s=12)]  # then every refresh fails

    def source():
        if answers:
            return answers.pop()
        raise ConnectionError("token request failed (429): too many token requests")

    authorizer = SwarmAuthorizer(peer, coordinator.public_key, source, refresh_margin_s=20)

    async def sign_many(n):
        for _ in range(n):  # hivemind refreshes before every signed message inside the margin
            await authorizer.refresh_token_if_needed()
        return authorizer._local_access_token

    token = asyncio.run(sign_many(200))
    assert token.username == "a" and authorizer.is_token_valid(token), "the live token is kept"
    assert authorizer.requests == 2, "one good answer, one failure, then silence during the backoff"
    authorizer._next_try = 0.0  # the backoff has passed: one more try, which doubles it
    asyncio.run(sign_many(50))
    assert authorizer.requests == 3 and authorizer._next_try - time.monotonic() > 1.5

    def revoked():
        raise AccessDenied("the coordinator refused an access token (403): revoked")

    denied = SwarmAuthorizer(peer, coordinator.public_key, revoked, refresh_margin_s=20)
    for _ in range(20):
        with pytest.raises(AccessDenied, match="revoked"):
            asyncio.run(denied.get_token())
    assert denied.requests == 1, "a refusal is final: the coordinator is not asked again"


class _FakeDHT:
    def __init__(self, tokens):
        self.tokens, self.lookups = tokens, 0

    async def get(self, key, latest, return_future):
        self.lookups += 1

        class Entry:
            def __init__(self, value):
                self.value = value

        return Entry({i: Entry(t) for i, t in enumerate(self.tokens)})


def test_the_averaging_guard_admits_token_holders_and_refuses_the_rest(keys):
    d, coordinator, peer, other = keys
    pid, stranger = peer_id_of(peer.get_public_key().to_bytes()), peer_id_of(other.get_public_key().to_bytes())
    forged = CoordinatorKey.load_or_create(d / "forger.pem").issue("x", other.get_public_key().to_bytes(),
                                                                  lifetime_s=60)
    dht = _FakeDHT([coordinator.issue("alice", peer.get_public_key().to_bytes(), lifetime_s=60), forged])
    guard = AccessGuard(run_id="r", coordinator_public_key=coordinator.public_key, lookup_interval_s=0.0)

    class Averager:  # stands in for a hivemind averager: a unary and a streaming handler
        def __init__(self):
            self.dht = dht

        async def rpc_join(self, request, context):
            return f"joined {request}"

        async def rpc_parts(self, request, context):
            for i in range(3):
                yield i

    class Handler:
        def __init__(self, name, stream_output):
            self.method_name, self.stream_output = name, stream_output

    class Context:
        def __init__(self, remote_id):
            self.remote_id = remote_id

    wrapped = _GuardedHandlers(Averager(), guard, [Handler("rpc_join", False), Handler("rpc_parts", True)])

    async def scenario():
        assert await wrapped.rpc_join("r1", Context(pid)) == "joined r1"
        assert [x async for x in wrapped.rpc_parts(None, Context(pid))] == [0, 1, 2]
        with pytest.raises(PermissionError, match="no valid access token"):
            await wrapped.rpc_join("r2", Context(stranger))
        with pytest.raises(PermissionError):
            [x async for x in wrapped.rpc_parts(None, Context(stranger))]

    asyncio.run(scenario())
    assert guard.refused == 2
    lookups = dht.lookups
    asyncio.run(wrapped.rpc_join("r3", Context(pid)))
    assert dht.lookups == lookups, "admitted peers are cached until their token expires"

    # Rate-limited lookups: a flood of strangers costs at most one DHT lookup per interval.
    slow_guard = AccessGuard(run_id="r", coordinator_public_key=coordinator.public_key, lookup_interval_s=3600)
    dht.lookups = 0

    async def flood():
        for _ in range(20):
            with pytest.raises(PermissionError):
                await slow_guard.check(dht, stranger)

    asyncio.run(flood())
    assert dht.lookups == 1


def test_a_token_the_first_lookup_missed_is_found_by_a_second_one(keys):
    """A lookup that misses a groupmate's token (a failed or partial DHT answer on a busy machine)
    costs it a moment, not its part of the round: the guard looks once more when its rate limit
    allows, and refuses only if that misses too."""
    _, coordinator, peer, other = keys
    pid, stranger = peer_id_of(peer.get_public_key().to_bytes()), peer_id_of(other.get_public_key().to_bytes())
    token = coordinator.issue("alice", peer.get_public_key().to_bytes(), lifetime_s=60)

    class Flaky(_FakeDHT):
        async def get(self, key, latest, return_future):
            answer = await super().get(key, latest, return_future)
            return None if self.lookups == 1 else answer  # the first lookup fails

    dht = Flaky([token])
    guard = AccessGuard(run_id="r", coordinator_public_key=coordinator.public_key, lookup_interval_s=0.3)
    started = time.monotonic()
    asyncio.run(guard.check(dht, pid))
    assert dht.lookups == 2 and 0.3 <= time.monotonic() - started < 2.0
    with pytest.raises(PermissionError):
        asyncio.run(guard.check(dht, stranger))
    assert dht.lookups == 3 and guard.refused == 1  # one more lookup, once the interval allowed it


def test_a_token_keeper_retries_a_failed_renewal_with_backoff_and_keeps_its_token_meanwhile(keys):
    """The coordinator down: the keeper keeps the token it has (still valid: peers honour it until
    its expiry) and asks again after 5, 10, 20 ... s (at most a twentieth of the lifetime), not
    after another quarter lifetime; once the coordinator answers it publishes the new token."""
    from crowdtrain.swarm.auth import AccessDenied, TokenKeeper, refresh_margin_s, refresh_retry_max_s

    _, coordinator, peer, _ = keys
    public = peer.get_public_key().to_bytes()
    lifetime = 600.0
    down = {"failures": 3}
    published = []

    def source():
        if down["failures"]:
            down["failures"] -= 1
            raise ConnectionError("[Errno 111] Connection refused")
        return coordinator.issue("a", public, lifetime_s=lifetime)

    class DHT:
        def store(self, key, subkey, value, expiration_time, return_future):
            published.append(value)

    class Signer:
        local_public_key = b"signer"

    keeper = TokenKeeper(DHT(), "run", Signer(), source, lifetime_s=lifetime)
    first = keeper.token = coordinator.issue("a", public, lifetime_s=lifetime)
    assert keeper.renew_interval_s == lifetime - refresh_margin_s(lifetime) == 150.0, "renewed at a quarter"
    assert [keeper.renew() for _ in range(3)] == [5.0, 10.0, 20.0]
    assert keeper.token is first and published == [] and keeper.failures == 3
    keeper.failures = 10
    down["failures"] = 1
    assert keeper.renew() == refresh_retry_max_s(lifetime) == 30.0, "the back-off is capped"
    assert keeper.renew() == 150.0, "back: the next renewal a quarter lifetime later"
    assert keeper.token is not first and keeper.failures == 0
    assert published == [{k: keeper.token[k] for k in ("username", "public_key", "expiration_time", "signature")}]

    def revoked():
        raise AccessDenied("the coordinator refused an access token (403): revoked")

    reasons = []
    denied = TokenKeeper(DHT(), "run", Signer(), revoked, lifetime_s=lifetime, on_denied=reasons.append)
    denied.token = first
    assert denied.renew() is None and reasons and "revoked" in reasons[0], "a refusal stops the keeper"


def test_peers_renew_early_enough_to_ride_out_an_outage_of_most_of_a_token_lifetime(keys):
    """The documented rule: a token renewed on schedule has >= 3/4 of its lifetime left when an
    outage begins, and the authorizer retries at most refresh_retry_max_s apart, so an outage of
    0.7 x lifetime ends before the token it started with expires."""
    from crowdtrain.swarm.auth import refresh_margin_s, refresh_retry_max_s

    _, coordinator, peer, _ = keys
    public = peer.get_public_key().to_bytes()
    lifetime = 600.0
    authorizer = SwarmAuthorizer(peer, coordinator.public_key, lambda: None,
                                 refresh_margin_s=refresh_margin_s(lifetime), retry_max_s=refresh_retry_max_s(lifetime))
    fresh = to_proto(coordinator.issue("a", public, lifetime_s=lifetime))
    quarter_used = to_proto(coordinator.issue("a", public, lifetime_s=0.75 * lifetime - 1))
    assert not authorizer.does_token_need_refreshing(fresh) and authorizer.does_token_need_refreshing(quarter_used)
    assert 0.75 * lifetime - refresh_retry_max_s(lifetime) >= 0.7 * lifetime


@pytest.mark.parametrize("code,final", [(422, True), (400, True), (403, True), (429, False), (503, False)])
def test_a_token_request_the_coordinator_rejects_is_final_and_busy_answers_are_retried(keys, code, final):
    """A 4xx other than 408/429 answers the request itself: sending it again for two minutes (as
    join did for a 422) only delays the error. 429 and 5xx are a busy or restarting coordinator."""
    import http.server
    import threading

    from crowdtrain.swarm.auth import AccessDenied, HttpTokenSource, TokenRequestRejected

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"detail": "public_key: not an RSA key"}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = HttpTokenSource(f"http://127.0.0.1:{server.server_port}/api/token", private_key=keys[2],
                                 api_key=None, user="alice")
        expected = AccessDenied if final else ConnectionError
        with pytest.raises(expected, match=str(code)) as raised:
            source()
        if code in (400, 422):
            assert isinstance(raised.value, TokenRequestRejected) and "not an RSA key" in str(raised.value)
    finally:
        server.shutdown()
