"""A run's coordinator seen from a volunteer's machine or notebook: its checkpoints and prompts.

What the coordinator answers is input from a stranger: a checkpoint name becomes a folder name
here, so it must be a plain name, and only the known checkpoint files are fetched (never a path the
answer makes up). Checkpoints are data only (safetensors and JSON, crowdtrain.checkpoint).

Typical use, in the ``/generate.ipynb`` notebook::

    checkpoint = fetch_checkpoint("http://HOST:8000")           # the newest one, cached
    prompts = run_prompts("http://HOST:8000")                    # what the run draws on /samples
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path

# What a checkpoint needs to draw (crowdtrain.checkpoint's layout); the optimizer state is not.
DRAW_FILES = ("config.json", "model.safetensors", "text_tokenizer.json", "image_tokenizer.safetensors")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def get_json(url: str, timeout_s: float = 30.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {url}: {e}; check the coordinator's address and that it runs") from e


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
                     timeout_s: float = 300.0) -> Path:
    """Download a run's checkpoint (``latest``, ``best``, or a name from ``/api/checkpoints``) into
    ``cache_dir/checkpoints/HOST_PORT/NAME`` and return that folder. Files already there are kept
    (a checkpoint's files do not change under its name)."""
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
    where = urllib.parse.urlsplit(base)
    folder = Path(cache_dir).expanduser() / "checkpoints" / f"{where.hostname}_{where.port or 80}" / chosen["name"]
    folder.mkdir(parents=True, exist_ok=True)
    for filename in DRAW_FILES:
        target = folder / filename
        if filename not in chosen["files"] or target.is_file():
            continue
        tmp = target.with_suffix(target.suffix + ".partial")
        url = f"{base}/checkpoints/{urllib.parse.quote(chosen['name'])}/{filename}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response, open(tmp, "wb") as out:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ValueError(f"downloading {url} failed: {e}; run it again to resume") from e
        tmp.replace(target)
    return folder


def run_prompts(coordinator: str) -> list[str]:
    """The prompts the run draws on its samples page (``/api/prompts``)."""
    base = coordinator.rstrip("/")
    prompts = get_json(f"{base}/api/prompts")
    if not isinstance(prompts, list):
        raise ValueError(f"{base}/api/prompts answered a JSON {type(prompts).__name__}, not a list")
    return [p["prompt"][:300] for p in prompts if isinstance(p, dict) and isinstance(p.get("prompt"), str)
            and p["prompt"].strip()]
