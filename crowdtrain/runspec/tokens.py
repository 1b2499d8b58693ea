"""Access tokens: the coordinator's signature on "this user's peer holds this key until then".

A token binds a user name to a peer's RSA public key (the key of its libp2p identity, so also to
its peer ID) and an expiry time, signed by the coordinator's RSA key (PSS, SHA-256: the same
scheme as hivemind's ``RSAPublicKey.verify``, so peers check tokens with hivemind's own code and
the web service never imports hivemind or torch). Peers present tokens on every DHT request
(hivemind's ``TokenAuthorizerBase`` protocol) and publish them in the DHT so that averagers can
refuse matchmaking, all-reduce and state-download requests from peers without one. Tokens are
short-lived: a revoked user's peers cannot refresh theirs and drop out within one lifetime.

A token request is itself signed by the peer's key (:func:`token_request`): public keys are
public (every peer publishes its token in the DHT), so without this proof anyone could ask for a
token for a running volunteer's key under another name and re-assign that peer, and the samples
it contributes, to themselves. The peer ID is derived from the key (:func:`peer_id_of_key`),
never taken from the request.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from pathlib import Path
from typing import Callable

import base58
from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from crowdtrain.release import PROTOCOL

_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_HASH = hashes.SHA256()
# A signed token request older (or further in the future) than this is refused, so a request
# overheard on plain HTTP stops working soon. Raise it if volunteers' clocks are far off and they
# see "the token request's timestamp is ... from the coordinator's clock".
TOKEN_REQUEST_MAX_AGE_S = 300.0


def token_payload(username: str, public_key: bytes, expiration_time: str) -> bytes:
    """The bytes the coordinator signs; fields are newline-free by construction."""
    return b"crowdtrain-token-v1\n" + username.encode() + b"\n" + public_key + b"\n" + expiration_time.encode()


class CoordinatorKey:
    """The coordinator's signing key, kept in the run folder (mode 0600) so tokens survive restarts."""

    def __init__(self, private_key: rsa.RSAPrivateKey):
        self._key = private_key

    @classmethod
    def load_or_create(cls, path: str | Path) -> "CoordinatorKey":
        path = Path(path)
        if path.is_file():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except ValueError as e:
                raise ValueError(f"{path} is not a PEM private key ({e}); restore it from a backup or delete it "
                                 "to make a new one (all issued tokens then become invalid)") from e
            if not isinstance(key, rsa.RSAPrivateKey):
                raise ValueError(f"{path} holds a non-RSA key; delete it to make a new one")
            return cls(key)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        os.replace(tmp, path)
        return cls(key)

    @property
    def public_key(self) -> bytes:
        """OpenSSH encoding, the format hivemind's ``RSAPublicKey.from_bytes`` reads."""
        return self._key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def sign(self, payload: bytes) -> bytes:
        """RSA-PSS (SHA-256) over ``payload``; callers prefix it with what it means (tokens,
        ``crowdtrain.runspec.trust.answer_payload``), so one signature never stands for another."""
        return self._key.sign(payload, _PADDING, _HASH)

    def issue(self, username: str, peer_public_key: bytes, *, lifetime_s: float) -> dict:
        """A token as JSON-able data; ``signature`` is base64 like hivemind's ``RSAPrivateKey.sign``."""
        if b"\n" in peer_public_key or "\n" in username:
            raise ValueError("user names and public keys must not contain newlines")
        load_public_key(peer_public_key)  # refuse garbage before signing it
        expiration_time = f"{time.time() + lifetime_s:.3f}"
        signature = base64.b64encode(self._key.sign(token_payload(username, peer_public_key, expiration_time),
                                                    _PADDING, _HASH))
        return {"username": username, "public_key": peer_public_key.decode(), "expiration_time": expiration_time,
                "signature": signature.decode()}


def load_public_key(data: bytes) -> rsa.RSAPublicKey:
    try:
        key = serialization.load_ssh_public_key(data)
    except (ValueError, exceptions.UnsupportedAlgorithm) as e:
        raise ValueError(f"not an OpenSSH RSA public key: {e}") from e
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("peer keys must be RSA (hivemind identities are RSA keys)")
    return key


def verify_token(token: dict, coordinator_public_key: bytes, *, now: float | None = None) -> bool:
    """True if the coordinator signed this token and it has not expired."""
    try:
        payload = token_payload(token["username"], token["public_key"].encode(), token["expiration_time"])
        load_public_key(coordinator_public_key).verify(base64.b64decode(token["signature"]), payload, _PADDING, _HASH)
        return float(token["expiration_time"]) > (time.time() if now is None else now)
    except (KeyError, TypeError, ValueError, exceptions.InvalidSignature):
        return False


# ---- proof of possession: who may ask for a token for a key -------------------------------------
def token_request_payload(public_key: bytes, user: str, timestamp: str) -> bytes:
    """The bytes a peer signs to ask for a token (fields are newline-free, checked on both sides)."""
    return b"crowdtrain-token-request-v1\n" + public_key + b"\n" + user.encode() + b"\n" + timestamp.encode()


def token_request(public_key: bytes, user: str, sign: Callable[[bytes], bytes], *, now: float | None = None) -> dict:
    """The body of ``POST /api/token``. ``sign`` is the peer's key's signing function returning
    base64 (hivemind's ``RSAPrivateKey.sign``; RSA-PSS with SHA-256, as this module verifies)."""
    if b"\n" in public_key or "\n" in user:
        raise ValueError("user names and public keys must not contain newlines")
    timestamp = f"{time.time() if now is None else now:.3f}"
    signature = sign(token_request_payload(public_key, user, timestamp))
    return {"public_key": public_key.decode(), "peer_id": peer_id_of_key(public_key), "user": user,
            "timestamp": timestamp, "signature": signature.decode(), "protocol": PROTOCOL}


def check_token_request(public_key: bytes, user: str, timestamp: str, signature: str, *,
                        now: float | None = None, max_age_s: float = TOKEN_REQUEST_MAX_AGE_S) -> None:
    """Raise ``ValueError`` (saying what is wrong) unless the holder of ``public_key`` signed this
    request recently."""
    if b"\n" in public_key or "\n" in user or "\n" in timestamp:
        raise ValueError("user names, public keys and timestamps must not contain newlines")
    key = load_public_key(public_key)
    try:
        age = (time.time() if now is None else now) - float(timestamp)
    except ValueError as e:
        raise ValueError(f"timestamp must be seconds since the epoch, got {timestamp[:40]!r}") from e
    if not abs(age) <= max_age_s:  # also refuses NaN
        raise ValueError(f"the token request's timestamp is {age:.0f} s from the coordinator's clock (at most "
                         f"{max_age_s:.0f} s allowed): set the volunteer's clock (NTP) and retry")
    try:
        key.verify(base64.b64decode(signature, validate=True), token_request_payload(public_key, user, timestamp),
                   _PADDING, _HASH)
    except (ValueError, exceptions.InvalidSignature) as e:
        raise ValueError("the token request's signature does not match its public key: only the holder of "
                         "a key may ask for a token for it") from e


def peer_id_of_key(public_key: bytes) -> str:
    """The libp2p peer ID (base58) of an RSA public key in OpenSSH encoding.

    libp2p's rule for keys this large: the sha2-256 multihash of the key's protobuf
    (``Type = RSA (0)``, ``Data = DER SubjectPublicKeyInfo``). Written out here so the web side
    needs no hivemind; ``tests/test_auth.py`` checks it against hivemind's ``PeerID.from_identity``.
    """
    der = load_public_key(public_key).public_bytes(serialization.Encoding.DER,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    length, varint = len(der), b""
    while True:  # protobuf varint of the Data field's length
        byte, length = length & 0x7F, length >> 7
        varint += bytes([byte | (0x80 if length else 0)])
        if not length:
            break
    encoded = b"\x08\x00" + b"\x12" + varint + der  # field 1 (Type) = 0, field 2 (Data) = der
    return base58.b58encode(b"\x12\x20" + hashlib.sha256(encoded).digest()).decode()  # multihash: sha2-256, 32 bytes
