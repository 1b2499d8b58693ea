"""A run's coordinator seen from a volunteer's machine or notebook: its checkpoints and prompts.

What the coordinator answers is input from a stranger: a checkpoint name becomes part of a folder
name here, so it must be a plain name, and only the known checkpoint files are fetched (never a
path the answer makes up). Every file is checked against the coordinator's signed manifest
(``/api/manifest``, under the key pinned or remembered by ``crowdtrain.runspec.trust``) and the
cache is keyed by those hashes: a file changed on the way, or on the server under the same name,
is refused or fetched anew, never used. Checkpoints are data only (safetensors and JSON,
crowdtrain.checkpoint).

Typical use, in the ``/generate.ipynb`` notebook::

    checkpoint = fetch_checkpoint("https://HOST", pin="SHA256:...")  # the newest one, cached
    prompts = run_prompts("http://HOST:8000")                    # what the run draws on /samples
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
import urllib.request
from pathlib import Path

from crowdtrain.runspec.trust import CoordinatorTrust, check_file, fetch_checked, sha256_file

# What a checkpoint needs to draw (crowdtrain.checkpoint's layout); the optimizer state is not.
DRAW_FILES = ("config.json", "model.safetensors", "text_tokenizer.json", "image_tokenizer.safetensors")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def get_json(url: str, timeout_s: float = 30.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {url}: {e}; check the coordinator's address and that it runs") from e


def signed_manifest(base: str, trust: CoordinatorTrust, timeout_s: float = 30.0) -> dict[str, str]:
    """{path under ``base``: sha256} of the files the coordinator serves, checked against ``trust``."""
    url = f"{base}/api/manifest"
    headers, nonce = trust.request_headers()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as response:
            body = response.read()
            trust.check(body, response.headers, f"the answer of {url}", nonce)
    except OSError as e:
        raise ValueError(f"cannot read {url}: {e}; check the coordinator's address and that it runs") from e
    files = json.loads(body).get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{url} lists no files: is {base} a crowdtrain coordinator?")
    return files


def _checkpoints(base: str) -> list[dict]:
    entries = get_json(f"{base}/api/checkpoints")
    if not isinstance(entries, list):
        raise ValueError(f"{base}/api/checkpoints answered a JSON {type(entries).__name__}, not a list: is {base} a "
                         "crowdtrain coordinator?")
    usable = []
    for entry in entries:
        if isinstance(entry, dict) and not entry.get("pruned") and isinstance(entry.get("name"), str) \
                and _NAME.fullmatch(entry["name"]) and isinstance(entry.get("epoch"), int) \
                and isinstance(entry.get("files"), list):
            usable.append(entry)
    return usable


def fetch_checkpoint(coordinator: str, *, which: str = "latest", cache_dir: str | Path = "~/.cache/crowdtrain",
                     timeout_s: float = 300.0, pin: str | None = None) -> Path:
    """Download a run's checkpoint (``latest``, ``best``, or a name from ``/api/checkpoints``) into
    ``cache_dir/checkpoints/NAME-DIGEST`` (DIGEST: of its files' signed hashes) and return that
    folder; files already there are used when their hash is the signed one. ``pin``: the
    coordinator key's fingerprint (crowdtrain.runspec.trust); without it, the key this machine
    saw first at that address."""
    base = coordinator.rstrip("/")
    entries = _checkpoints(base)
    if not entries:
        raise ValueError(f"{base} has no checkpoint yet: the run saves one every few epochs (see {base}/checkpoints); "
                         "try again later")
    if which == "latest":
        chosen = max(entries, key=lambda e: e["epoch"])
    elif which == "best":
        best = [e for e in entries if e.get("best")]
        if not best:
            raise ValueError(f"{base} has no checkpoint with a validation loss yet; use which='latest'")
        chosen = best[-1]
    else:
        named = [e for e in entries if e["name"] == which]
        if not named:
            raise ValueError(f"{base} has no checkpoint {which!r}; it has {', '.join(e['name'] for e in entries)}")
        chosen = named[0]
    missing = [f for f in ("config.json", "model.safetensors") if f not in chosen["files"]]
    if missing:
        raise ValueError(f"checkpoint {chosen['name']} on {base} lacks {', '.join(missing)}")
    # The manifest after the list: a checkpoint saved in between is then in both (the other way
    # round, the newest one could be listed but not yet signed for).
    signed = signed_manifest(base, CoordinatorTrust(base, pin=pin))
    wanted = [f for f in DRAW_FILES if f in chosen["files"]]
    expected = {f: signed.get(f"checkpoints/{chosen['name']}/{f}") for f in wanted}
    for filename, sha in expected.items():
        if sha is None:
            check_file(f"{chosen['name']}/{filename}", "", None, base)
    digest = hashlib.sha256("".join(f"{f}:{expected[f]}\n" for f in wanted).encode()).hexdigest()
    folder = Path(cache_dir).expanduser() / "checkpoints" / f"{chosen['name']}-{digest[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    for filename in wanted:
        download_checked(f"{base}/checkpoints/{urllib.parse.quote(chosen['name'])}/{filename}", folder / filename,
                         expected[filename], name=f"{chosen['name']}/{filename}", timeout_s=timeout_s)
    return folder


def download_checked(url: str, target: Path, expected: str, *, name: str, timeout_s: float) -> Path:
    """``url`` into ``target`` unless a file with the ``expected`` sha256 is there already; a
    download with another hash is deleted and refused, naming ``name``."""
    if target.is_file() and sha256_file(target) == expected:
        return target
    tmp = target.with_name(target.name + ".partial")
    try:
        with open(tmp, "wb") as out:
            fetch_checked(url, expected, out, timeout_s=timeout_s, name=name)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"downloading {url} failed: {e}; run it again") from e
    except ValueError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)
    return target


def run_prompts(coordinator: str) -> list[str]:
    """The prompts the run draws on its samples page (``/api/prompts``)."""
    base = coordinator.rstrip("/")
    prompts = get_json(f"{base}/api/prompts")
    if not isinstance(prompts, list):
        raise ValueError(f"{base}/api/prompts answered a JSON {type(prompts).__name__}, not a list")
    return [p["prompt"][:300] for p in prompts if isinstance(p, dict) and isinstance(p.get("prompt"), str)
            and p["prompt"].strip()]


def fetch_data(shards_url: str, *, pin: str | None = None, cache_dir: str | Path = "~/.cache/crowdtrain",
               skip_splits=("train",), timeout_s: float = 300.0) -> Path:
    """A coordinator's shard folder (``https://HOST/shards``), all but the ``skip_splits`` shards,
    downloaded into ``cache_dir/data/DIGEST`` and each file checked against the coordinator's
    signed manifest (``pin``: its key's fingerprint, crowdtrain.runspec.trust). What `crowdtrain
    eval` reads a run's held-out splits from, instead of streaming them unchecked."""
    shards_url = shards_url.rstrip("/")
    if not shards_url.endswith("/shards"):
        raise ValueError(f"{shards_url} is not a coordinator's shard folder (https://HOST/shards)")
    base = shards_url.removesuffix("/shards")
    signed = {name.removeprefix("shards/"): sha for name, sha in signed_manifest(
        base, CoordinatorTrust(base, pin=pin)).items() if name.startswith("shards/") and _NAME.fullmatch(
        name.removeprefix("shards/"))}
    if "shards.json" not in signed:
        raise ValueError(f"{base}'s signed manifest lists no shards.json: its data is not served by it")
    digest = hashlib.sha256("".join(f"{n}:{s}\n" for n, s in sorted(signed.items())).encode()).hexdigest()
    folder = Path(cache_dir).expanduser() / "data" / digest[:16]
    folder.mkdir(parents=True, exist_ok=True)

    def fetch(name: str) -> Path:
        return download_checked(f"{shards_url}/{urllib.parse.quote(name)}", folder / name, signed[name], name=name,
                                timeout_s=timeout_s)

    manifest = json.loads(fetch("shards.json").read_text())
    for name in signed:
        if name.endswith(".json"):
            fetch(name)
    for split, entries in (manifest.get("splits") or {}).items():
        if split in skip_splits:
            continue
        for entry in entries:
            name = entry.get("file") if isinstance(entry, dict) else None
            if not isinstance(name, str) or name not in signed:
                check_file(str(name), "", None, shards_url)  # listed but not signed: refused by name
            fetch(name)
    return folder
