"""hivemind's p2p, RPC and wire internals that crowdtrain's auth, reconnection and codec use.

Each function is an entry of ``crowdtrain.swarm.hivemind_seam.SEAMS`` (upstream code, why,
canary test).
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Callable

from hivemind.compression import serialization
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)


def rsa_key_from_der(der: bytes) -> RSAPrivateKey:
    """hivemind's RSA key from DER bytes (a libp2p identity file's key), through its unpickling path."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def current_token(authorizer: TokenAuthorizerBase) -> AccessToken | None:
    """The access token an authorizer holds now (None before the first), without asking for a new one."""
    return authorizer._local_access_token


async def dial(p2p, peer_id, transports) -> None:
    """Make the p2p daemon connect to ``peer_id`` at ``transports`` (multiaddrs without /p2p/ID).
    hivemind has no public call for this; its own bootstrap passes addresses at start only."""
    await p2p._client.connect(peer_id, transports)


# A protocol nobody serves: a peer that answers "protocol not supported" was reached.
_PROBE_PROTOCOL = "/crowdtrain/probe/0"


async def probe(p2p, peer_id) -> str | None:
    """Whether this peer's p2p daemon can reach ``peer_id`` as matchmaking does (by peer ID, its
    address looked up by libp2p): None if it answered, else the daemon's error ("routing: not
    found": no address known for it; a dial error: its address does not accept connections). A
    stream for a protocol it does not serve, refused by it, is how it answers."""
    try:
        _, _, writer = await p2p._client.stream_open(peer_id, (_PROBE_PROTOCOL,))
        writer.close()
        return None
    except Exception as e:
        text = str(e)
        return None if "protocol" in text else (text.removeprefix("Connect failed. msg=") or repr(e))


def with_wrapped_handlers(servicer_cls: type, make_wrapper: Callable, **attributes) -> type:
    """A subclass of a hivemind servicer (an averager) whose RPC handlers are registered through
    ``make_wrapper(servicer, handlers)``: an object with one coroutine per handler name, each
    called instead of the servicer's (``handlers``: hivemind's RPC handler records, with
    ``method_name`` and ``stream_output``). The class keeps its name: hivemind derives RPC
    protocol names from it, and peers must speak the same."""

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False):
        self._collect_rpc_handlers()
        await servicer_cls.add_p2p_handlers(self, p2p, make_wrapper(self, self._rpc_handlers),
                                            namespace=namespace, balanced=balanced)

    return type(servicer_cls.__name__, (servicer_cls,), {"add_p2p_handlers": add_p2p_handlers,
                                                          "__module__": servicer_cls.__module__, **attributes})


def replace_decoder(compression_type: str, codec, *, replaces: tuple[type, ...]) -> bool:
    """Make hivemind decode messages of ``compression_type`` (e.g. "UNIFORM_8BIT") with ``codec``.
    hivemind looks decoders up by the message's compression type in a module table; if a release
    renames the table or the entry is not one of ``replaces``, hivemind's own decoder stays in
    place and this returns False."""
    table = getattr(serialization, "_BASE_COMPRESSION_TYPES", None)
    if not isinstance(table, dict) or type(table.get(compression_type)) not in replaces:
        return False
    table[compression_type] = codec
    return True


_RESOURCE_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


class _RequestPipe:
    """The DHT process's end of its request pipe, where a request that cannot be read because its
    sender exited raises an ``OSError`` instead of ``EOFError``.

    A request carries its reply pipe, which multiprocessing fetches from the sending process's
    resource-sharing socket. If that process (one of a leaving peer's averagers) exits while the
    DHT process connects, the handshake reads end-of-file: ``EOFError``, which hivemind's request
    loop does not catch (it catches ``OSError``, ``ConnectionError`` and ``RuntimeError``): the DHT
    process would end with a traceback, and the requests queued after it, such as the removal of
    the leaving peer's progress record (the swarm would count it as a peer until the record
    expires), would be lost. As an ``OSError`` it is logged (``crowdtrain.noise`` drops that
    report) and only that request is lost. End-of-file on the pipe itself (the peer process is
    gone) is kept."""

    def __init__(self, pipe):
        self._pipe = pipe

    def recv(self):
        try:
            return self._pipe.recv()
        except EOFError as e:
            if any(frame.filename.endswith(_RESOURCE_SHARER) for frame in traceback.extract_tb(e.__traceback__)):
                raise ConnectionResetError("a request's sender exited before its reply pipe was fetched") from e
            raise

    def __getattr__(self, name):  # poll, fileno, close: the pipe's own
        return getattr(self._pipe, name)


def guard_request_pipe(dht):
    """``dht`` (a ``hivemind.DHT`` built with ``start=False``), whose process will survive a request
    from a process that exited (:class:`_RequestPipe`); start it next."""
    if dht.is_alive():
        raise RuntimeError("guard the DHT's request pipe before it starts (hivemind.DHT(..., start=False))")
    dht._inner_pipe = _RequestPipe(dht._inner_pipe)
    return dht
