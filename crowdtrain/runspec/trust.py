"""What a volunteer trusts: the coordinator's key, pinned or remembered, and answers signed by it.

The coordinator signs the answers a volunteer acts on (``/api/join``, ``/api/manifest``,
``/api/version``) with its RSA key, the one that signs access tokens: the signature of the exact
body bytes travels in ``X-Crowdtrain-Signature``, the key in ``X-Crowdtrain-Key``. A volunteer
believes the key only if

- it matches the fingerprint the organizer published (``crowdtrain join URL --pin SHA256:...``,
  shown on the join page and in the join line), or
- without a pin, it is the key this machine saw the first time it joined that address
  (``known_coordinators.json`` under ``$XDG_CONFIG_HOME/crowdtrain``; trust on first use, as ssh
  does with host keys). A changed key is refused with both fingerprints named; if the organizer
  really made a new key, delete the line the message names.

Loopback addresses (``127.0.0.0/8``, ``::1``, ``localhost``) are not remembered: no network path
lies between the two processes, and a machine's test runs reuse ports with new keys. A pin is
checked there too.

The signed join information then carries the sha256 of every file a volunteer fetches (the
wheel, the shards and their manifest, the tokenizers; ``/api/manifest`` adds the checkpoints), so
a file changed on the way is refused by name (:func:`check_file`). HTTPS keeps the API key and
the install line private and whole; the signatures keep the run whole even through a proxy that
holds a certificate for the address.

Answers are fresh: the volunteer sends a random nonce with each request (``X-Crowdtrain-Nonce``)
and the coordinator signs it with the body, so an answer recorded earlier (an older join
information, or a manifest naming an older wheel with a known hole) cannot be replayed to it.

The fingerprint is ssh's: ``SHA256:`` and the unpadded base64 of the SHA-256 of the key's
OpenSSH blob (``ssh-keygen -lf`` prints the same for the key's ``.pub`` form).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import urllib.parse
from pathlib import Path

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Crowdtrain-Signature"
KEY_HEADER = "X-Crowdtrain-Key"
NONCE_HEADER = "X-Crowdtrain-Nonce"
NONCE = re.compile(r"[0-9a-f]{16,64}")
FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class UntrustedCoordinator(ValueError):
    """The coordinator's key or signature is not the one this volunteer trusts."""


class FileMismatch(ValueError):
    """A fetched file is not the one the coordinator signed for."""


def new_nonce() -> str:
    return secrets.token_hex(16)


def answer_payload(body: bytes, nonce: str | None = None) -> bytes:
    """What the coordinator signs for an answer: the body, and the request's nonce when it sent
    one (a prefix keeps it from meaning anything else, e.g. a token or a token request, which the
    same key signs; the two prefixes keep an answer with a nonce from passing for one without)."""
    if nonce:
        return b"crowdtrain-answer-v2\n" + nonce.encode() + b"\n" + body
    return b"crowdtrain-answer-v1\n" + body


def fingerprint(public_key: bytes | str) -> str:
    """``SHA256:...`` of an OpenSSH public key (``ssh-rsa AAAA... [comment]``)."""
    text = public_key.decode() if isinstance(public_key, bytes) else public_key
    parts = text.split()
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (IndexError, ValueError) as e:
        raise UntrustedCoordinator(f"the coordinator's key is not an OpenSSH public key ({text[:60]!r})") from e
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def check_pin(pin: str) -> str:
    """A pin as the join page prints it; a ValueError naming the expected form otherwise."""
    pin = pin.strip()
    if not FINGERPRINT.fullmatch(pin):
        raise ValueError(f"--pin must be the coordinator's key fingerprint as its join page shows it, SHA256: and "
                         f"43 base64 characters; got {pin[:80]!r}")
    return pin


def sign_answer(key, body: bytes, nonce: str | None = None) -> dict[str, str]:
    """The headers that sign ``body`` (and the request's ``nonce``, if it is one) with ``key``
    (a ``crowdtrain.runspec.tokens.CoordinatorKey``)."""
    nonce = nonce if nonce and NONCE.fullmatch(nonce) else None
    headers = {SIGNATURE_HEADER: base64.b64encode(key.sign(answer_payload(body, nonce))).decode(),
               KEY_HEADER: key.public_key.decode()}
    if nonce:
        headers[NONCE_HEADER] = nonce  # which request it answers (a replay is then told from a change)
    return headers


def verify_answer(public_key: bytes | str, body: bytes, signature: str, nonce: str | None = None) -> bool:
    from crowdtrain.runspec.tokens import load_public_key

    key = public_key.encode() if isinstance(public_key, str) else public_key
    try:
        load_public_key(key).verify(base64.b64decode(signature, validate=True), answer_payload(body, nonce), _PADDING,
                                    hashes.SHA256())
        return True
    except (ValueError, exceptions.InvalidSignature):
        return False


def is_loopback(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key_transport(url: str, what: str = "your API key") -> None:
    """Refuse to send a secret over plain HTTP to anything but this machine: anyone on the path
    would read it (and join an allowlist run as you)."""
    if urllib.parse.urlsplit(url).scheme == "https" or is_loopback(url):
        return
    host = urllib.parse.urlsplit(url).netloc
    raise ValueError(f"refusing to send {what} to {host} over plain http://, where anyone on the network path can "
                     f"read it: join the run's https:// address (the organizer serves one with `crowdtrain "
                     f"coordinator --public-url https://...`, docs/organize-a-run.md)")


def known_coordinators_path() -> Path:
    if os.environ.get("CROWDTRAIN_KNOWN_COORDINATORS"):
        return Path(os.environ["CROWDTRAIN_KNOWN_COORDINATORS"])
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "crowdtrain" / "known_coordinators.json"


def _origin(url: str) -> str:
    """The address a key is remembered for: scheme, host and port (the same run may be reached
    under several paths)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class CoordinatorTrust:
    """Decides whether answers from the coordinator at ``base`` are the run's: see the module
    docstring. ``check(body, headers)`` returns normally for an answer signed by the trusted key
    and raises :class:`UntrustedCoordinator` naming the problem otherwise."""

    def __init__(self, base: str, *, pin: str | None = None, known_path: str | Path | None = None):
        self.base = base.rstrip("/")
        self.pin = check_pin(pin) if pin else None
        self.known_path = Path(known_path) if known_path is not None else known_coordinators_path()
        self.key: str | None = None  # the trusted key, once an answer showed it
        self.fingerprint: str | None = None

    def check(self, body: bytes, headers, what: str, nonce: str | None = None) -> None:
        """``nonce``: the one sent with the request (:meth:`request_headers`); the answer must be
        signed for it."""
        key, signature = headers.get(KEY_HEADER), headers.get(SIGNATURE_HEADER)
        if not key or not signature:
            raise UntrustedCoordinator(
                f"{what} came without the coordinator's signature: either the coordinator runs another crowdtrain, "
                "from before signed answers, or something between you and it removed the signature; not joining."
                + _unverified_install_line(body))
        if self.key is None:
            self._trust(key)
        elif key != self.key:
            raise UntrustedCoordinator(f"{what} is signed by another key ({fingerprint(key)}) than the coordinator's "
                                       f"earlier answers ({self.fingerprint}); not using it")
        if verify_answer(key, body, signature, nonce):
            return
        answered = headers.get(NONCE_HEADER) or None
        if nonce and answered != nonce and verify_answer(key, body, signature, answered):
            raise UntrustedCoordinator(
                f"{what} is signed by the coordinator, but not for this request: it is an answer recorded earlier "
                "and replayed (an attacker on the network path), or the coordinator runs an older crowdtrain "
                "(ask the organizer to update it); not using it")
        raise UntrustedCoordinator(f"{what} does not match the coordinator's signature: it was changed on the way "
                                   "(a proxy or an attacker on the network path); not using it")

    @staticmethod
    def request_headers() -> tuple[dict[str, str], str]:
        """Headers for a request whose answer will be checked, and the nonce to check it with."""
        nonce = new_nonce()
        return {NONCE_HEADER: nonce}, nonce

    def _trust(self, key: str) -> None:
        seen = fingerprint(key)
        if self.pin is not None:
            if seen != self.pin:
                raise UntrustedCoordinator(
                    f"the coordinator at {self.base} has key {seen}, not the pinned {self.pin}: this is not the run "
                    "the organizer published (or the organizer made a new key: check the fingerprint on their join "
                    "page). Not joining")
        elif not is_loopback(self.base):
            self._remember(key, seen)
        self.key, self.fingerprint = key, seen

    def _remember(self, key: str, seen: str) -> None:
        origin = _origin(self.base)
        try:
            known = json.loads(self.known_path.read_text())
            if not isinstance(known, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            known = {}
        except (OSError, ValueError) as e:
            raise UntrustedCoordinator(f"{self.known_path} is not readable ({e}): fix or delete it") from e
        before = known.get(origin)
        if before is None:
            logger.warning("first contact with %s: trusting its key %s from now on. Compare it with the fingerprint "
                           "on the organizer's join page; next time, pass --pin %s", origin, seen, seen)
            known[origin] = seen
            self.known_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.known_path.with_name(self.known_path.name + ".tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
            tmp.replace(self.known_path)
        elif before != seen:
            raise UntrustedCoordinator(
                f"the coordinator at {origin} has key {seen}, but when this machine first joined it, it had {before}. "
                f"Someone may be impersonating it. If the organizer made a new key (check the fingerprint on their "
                f"join page), delete the line for {origin} in {self.known_path}, or join with --pin {seen}")


def _unverified_install_line(body: bytes) -> str:
    """An unsigned answer's install line (an older coordinator's refusal names its crowdtrain), said as
    what it is: a hint to compare with the organizer's join page, not something to run blindly."""
    try:
        data = json.loads(body)
        line = data.get("install") or (data.get("crowdtrain") or {}).get("install")
        detail = data.get("detail")
    except (ValueError, TypeError, AttributeError):
        return ""
    if isinstance(line, str):
        return (" It says its crowdtrain installs with (unverified: run it only if the organizer's join page shows "
                f"the same line):\n\n    {line[:1000]}\n")
    if isinstance(detail, str):
        return f" It says (unverified): {detail[:1000]}"
    return ""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_file(name: str, data_sha256: str, expected: str | None, source: str) -> None:
    """Refuse a fetched file whose hash is not the signed one (``expected``; None: the signed
    manifest does not list it, also refused)."""
    if expected is None:
        raise FileMismatch(f"{name} from {source} is not in the coordinator's signed manifest; not using it")
    if data_sha256 != expected:
        raise FileMismatch(f"{name} from {source} does not match the coordinator's signed manifest (sha256 "
                           f"{data_sha256[:16]}..., signed {expected[:16]}...): it was changed on the way or on the "
                           "server; not using it")


def fetch_checked(url: str, expected: str | None, out, *, timeout_s: float, name: str | None = None) -> None:
    """Stream ``url`` into ``out`` (a binary file) and refuse it (:class:`FileMismatch`, naming
    the file) unless its sha256 is ``expected``, the signed one; a file the signed answers do not
    list is refused before a byte is fetched. The caller keeps ``out`` only when this returns."""
    import urllib.request

    name = name or url.rsplit("/", 1)[-1]
    if expected is None:
        check_file(name, "", None, url)
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        while block := response.read(1 << 20):
            digest.update(block)
            out.write(block)
    check_file(name, digest.hexdigest(), expected, url)
