"""The run as a coordinator hands it out (``GET /api/join``): fetched, and checked whole before a
volunteer starts.

The answer comes from the network: a broken or hostile coordinator (or a proxy in front of it)
can send a negative or NaN learning rate, a JSON list instead of an object, a key too few, an
address that is no multiaddr, or a model no machine holds. Each must end ``crowdtrain join``
with one line that names the field, before the DHT, the averagers or any of their threads
exist: a failure after those start left a progress-tracker thread that kept the process alive.

Typical use, in ``crowdtrain.swarm.peer`` (and ``crowdtrain.swarm.machine``, for the join
notebook's preview)::

    info = fetch_json(join_url(base), api_key=config.api_key)
    check_same_protocol(info, base)
    checked = check_join_info(info, model_overrides=config.model_overrides, source=base)
    checked.swarm, checked.model  # a SwarmConfig and a ModelConfig, each validated
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from crowdtrain.model.config import ModelConfig
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.runspec.typed import json_type, matches, typed_config

logger = logging.getLogger(__name__)

# The least a peer holds per parameter: fp32 parameters and their gradients. The averagers, the
# optimizer state and activations come on top, so a model over this bound cannot train here at all.
MIN_BYTES_PER_PARAM = 8


@dataclass(frozen=True)
class CheckedJoinInfo:
    swarm: SwarmConfig
    model: ModelConfig
    params: int  # parameters of the model this peer will build


def _require(container: dict, key: str, kind: type, field: str = ""):
    name = f"{field}.{key}" if field else key
    if key not in container:
        raise ValueError(f"{name} is missing")
    value = container[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{name} must be a JSON {json_type(kind())}, got a JSON {json_type(value)}: {value!r}"[:300])
    return value


def _check_url(value, field: str) -> None:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ValueError(f"{field} must be an http(s) URL, got {value!r}"[:300])


def check_multiaddr(value, field: str) -> None:
    """A peer address the DHT can dial: a valid multiaddr that ends in the peer's ID (/p2p/...)."""
    from hivemind.utils.multiaddr import Multiaddr

    if not isinstance(value, str):
        raise ValueError(f"{field} must be a multiaddr string, got {value!r}"[:300])
    try:
        address = Multiaddr(value)
    except Exception as e:
        raise ValueError(f"{field} is not a valid multiaddr: {e}"[:300]) from None
    if "p2p" not in [p.name for p in address.protocols()]:
        raise ValueError(f"{field} has no peer ID (/p2p/...): {value!r}"[:300])


def machine_ram_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: str) -> tuple[int | None, str]:
    """(bytes, name) of the memory a model trains in on ``device``: a GPU's own memory for
    ``cuda[:i]`` (parameters and gradients live there; the optimizer state may be offloaded),
    else this machine's RAM. (None, name) where it cannot be read: no check then."""
    if device.startswith("cuda"):
        try:
            import torch

            index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return int(props.total_memory), f"this GPU ({props.name})"
        except Exception:  # no CUDA here: the device check after this one says so
            return None, "this GPU"
    return machine_ram_bytes(), "this machine"


def check_model_fits(model: ModelConfig, ram_bytes: int | None, source: str, where: str = "this machine") -> int:
    """The model's parameter count; refuses a model whose parameters and gradients alone exceed
    ``ram_bytes``, the memory of ``where`` (this machine's RAM, or a GPU's memory)."""
    from crowdtrain.memcalc.architectures import crowdtrain_param_count

    params = crowdtrain_param_count(model)
    need = params * MIN_BYTES_PER_PARAM
    if ram_bytes is not None and need > ram_bytes:
        bigger = "a GPU with more memory" if "GPU" in where else "a machine with more memory"
        raise ValueError(
            f"task.model has {params / 1e9:,.2f} billion parameters: training it needs at least {need / 2**30:,.1f} "
            f"GiB of memory for its fp32 parameters and gradients alone, and {where} has "
            f"{ram_bytes / 2**30:,.1f} GiB. Join a run with a smaller model, or use {bigger} "
            f"(sizes: {source.rstrip('/')}/memcalc/)")
    return params


def check_join_info(info, *, model_overrides: dict | None = None, source: str = "the coordinator",
                    ram_bytes: int | None = -1, device: str = "cpu") -> CheckedJoinInfo:
    """Everything ``crowdtrain join`` reads from ``info``, checked; a ValueError names the field.

    ``ram_bytes``: the memory a model must fit in (-1: ``device``'s, see ``device_memory``;
    None: no check).
    """
    where = f"the run config from {source}"
    memory, name = device_memory(device)
    if ram_bytes != -1:
        memory = ram_bytes
    try:
        return _check(info, model_overrides or {}, source, memory, name)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _check(info, model_overrides: dict, source: str, ram_bytes: int | None,
           memory_name: str = "this machine") -> CheckedJoinInfo:
    if not isinstance(info, dict):
        raise ValueError(f"expected a JSON object, got a JSON {json_type(info)}: is {source} a crowdtrain "
                         "coordinator?")
    fingerprint = _require(info, "fingerprint", str)
    if not re.fullmatch(r"[0-9a-f]{1,128}", fingerprint):
        raise ValueError(f"fingerprint must be a hex string, got {fingerprint!r}"[:300])
    swarm = typed_config(SwarmConfig, _require(info, "swarm", dict), "swarm")
    task = _require(info, "task", dict)
    _require(task, "data", str, "task")
    model = typed_config(ModelConfig, {**_require(task, "model", dict, "task"), **model_overrides}, "task.model")
    peers = _require(info, "initial_peers", list)
    if len(peers) > 64:
        raise ValueError(f"initial_peers lists {len(peers)} addresses; at most 64 are expected")
    for i, address in enumerate(peers):
        check_multiaddr(address, f"initial_peers[{i}]")
    tokenizer = info.get("text_tokenizer")
    if tokenizer is not None:
        if not isinstance(tokenizer, dict):
            raise ValueError(f"text_tokenizer must be an object or null, got a JSON {json_type(tokenizer)}")
        _check_url(_require(tokenizer, "url", str, "text_tokenizer"), "text_tokenizer.url")
        if not re.fullmatch(r"[0-9a-f]{64}", _require(tokenizer, "sha256", str, "text_tokenizer")):
            raise ValueError("text_tokenizer.sha256 must be 64 hex digits")
    initial = info.get("initial_model")
    if initial is not None:
        if not isinstance(initial, dict):
            raise ValueError(f"initial_model must be an object or null, got a JSON {json_type(initial)}")
        _require(initial, "seed", int, "initial_model")
        _require(initial, "digest", str, "initial_model")
    auth = info.get("auth")
    if auth is not None:
        if not isinstance(auth, dict):
            raise ValueError(f"auth must be an object or null, got a JSON {json_type(auth)}")
        if _require(auth, "mode", str, "auth") not in ("open", "allowlist"):
            raise ValueError(f"auth.mode must be open or allowlist, got {auth['mode']!r}"[:300])
        _require(auth, "coordinator_public_key", str, "auth")
        _check_url(_require(auth, "token_url", str, "auth"), "auth.token_url")
        lifetime = auth.get("token_lifetime_s")
        if not matches(lifetime, float) or not lifetime > 0:
            raise ValueError(f"auth.token_lifetime_s must be a positive finite number, got {lifetime!r}"[:300])
    params = check_model_fits(model, ram_bytes, source, memory_name)
    return CheckedJoinInfo(swarm=swarm, model=model, params=params)


# ---- fetching it -------------------------------------------------------------------------------
def _refused(error: BaseException) -> bool:
    """Connection refused: the host answered, and nothing listens on that port."""
    return isinstance(getattr(error, "reason", error), ConnectionRefusedError)


def _detail(body: bytes, limit: int = 2000) -> str:
    """An error answer's ``detail`` (the coordinator says what is wrong there), else its text."""
    text = body.decode(errors="replace")[:limit]
    try:
        detail = json.loads(text)["detail"]
    except (ValueError, KeyError, TypeError):
        return text
    return detail if isinstance(detail, str) else json.dumps(detail)[:limit]


def join_url(base: str) -> str:
    """``/api/join`` with this crowdtrain's version and protocol: a coordinator of another protocol
    answers 409 with the line that installs its own (crowdtrain.release)."""
    from crowdtrain.release import this_crowdtrain

    return f"{base}/api/join?{urllib.parse.urlencode(this_crowdtrain())}"


def coordinator_install_line(info: dict) -> str | None:
    """The line that installs the coordinator's crowdtrain, as its join information gives it."""
    theirs = info.get("crowdtrain") if isinstance(info, dict) else None
    install = theirs.get("install") if isinstance(theirs, dict) else None
    return install[:1000] if isinstance(install, str) else None


def check_same_protocol(info: dict, base: str) -> None:
    """Stop unless the coordinator said it runs this crowdtrain's protocol. A coordinator of another
    protocol answers ``join_url`` with 409 itself; this catches one from before protocol numbers,
    which ignores the question."""
    from crowdtrain.release import PROTOCOL, full_version

    if not isinstance(info, dict):
        return  # not join information at all: check_join_info says what is wrong with it
    theirs = info.get("crowdtrain")
    protocol = theirs.get("protocol") if isinstance(theirs, dict) else None
    install = coordinator_install_line(info)
    if protocol == PROTOCOL:
        version = theirs.get("version")
        if isinstance(version, str) and version != full_version():
            logger.info("this crowdtrain (%s) is another build than the coordinator's (%s); both speak protocol %d, "
                        "so it trains with the run. The coordinator's own: %s", full_version(), version[:60],
                        PROTOCOL, install or "")
        return
    said = f"protocol {protocol!r}" if protocol is not None else "no protocol number (an older crowdtrain)"
    fix = (f"Install the coordinator's crowdtrain, then join again:\n\n    {install}\n" if install else
           "Ask the organizer which crowdtrain the run uses (or to upgrade the coordinator), install it, and "
           "join again.")
    raise ValueError(f"the coordinator at {base} runs a crowdtrain of {said}; this one is {full_version()} "
                     f"(protocol {PROTOCOL}) and cannot train with it. {fix}")


def fetch_json(url: str, *, timeout_s: float = 15.0, patience_s: float = 120.0, api_key: str | None = None,
               trust=None) -> dict:
    """GET JSON, retrying while the coordinator is unreachable (e.g. restarting) for ``patience_s``.
    ``api_key``: sent as a bearer token (an allowlist run gives its peers' addresses only to its
    users), never over plain HTTP to another machine. ``trust``: a
    ``crowdtrain.runspec.trust.CoordinatorTrust`` the answer must satisfy (signed by the pinned or
    remembered key), the refusal of another protocol included, as it carries an install line.

    A refused first connection is most often a wrong address (a typo'd port), so that is said at
    once, before the retries that wait for a coordinator that is still starting."""
    deadline = time.monotonic() + patience_s
    delay, last = 1.0, None
    if api_key:
        from crowdtrain.runspec.trust import check_key_transport

        check_key_transport(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    nonce = None
    if trust is not None:
        fresh, nonce = trust.request_headers()
        headers.update(fresh)
    where = urllib.parse.urlsplit(url)
    address = f"{where.hostname}:{where.port or (443 if where.scheme == 'https' else 80)}"
    first = True
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
                body = response.read()
                if trust is not None:
                    trust.check(body, response.headers, f"the answer of {url}", nonce)
                return json.loads(body)
        except urllib.error.HTTPError as e:
            if e.code < 500:
                body = e.read()
                if trust is not None and e.code == 409:
                    trust.check(body, e.headers, f"the answer of {url}", nonce)
                raise ValueError(f"{url} answered {e.code}: {_detail(body)}") from e
            last = e  # 503 while the run starts: retry
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            last = e
            if first and _refused(e):
                logger.warning("no coordinator is listening at %s: check the address you gave `crowdtrain join` "
                               "(host and port, as the organizer's join page shows it). Retrying for %.0f s in "
                               "case it is still starting", address, patience_s)
        first = False
        if time.monotonic() + delay > deadline:
            hint = (f"nothing listens at {address}: check the address (host and port)" if _refused(last)
                    else "check the address and that it is running")
            raise ValueError(f"cannot reach the coordinator at {url} ({last}); {hint}")
        logger.warning("coordinator not answering (%s); retrying in %.0fs", last, delay)
        time.sleep(delay)
        delay = min(2 * delay, 10.0)
