"""Access tokens: the coordinator's signature on "this user's peer holds this key until then".

A token binds a user name to a peer's RSA public key (the key of its libp2p identity, so also to
its peer ID) and an expiry time, signed by the coordinator's RSA key (PSS, SHA-256: the same
scheme as hivemind's ``RSAPublicKey.verify``, so peers check tokens with hivemind's own code and
the web service never imports hivemind or torch). Peers present tokens on every DHT request
(hivemind's ``TokenAuthorizerBase`` protocol) and publish them in the DHT so that averagers can
refuse matchmaking, all-reduce and state-download requests from peers without one. Tokens are
short-lived: a revoked user's peers cannot refresh theirs and drop out within one lifetime.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
_HASH = hashes.SHA256()


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
