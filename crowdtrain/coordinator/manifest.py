"""The files a coordinator serves, by sha256: what its signed answers vouch for.

``/api/join`` carries the run's fixed files (the wheel, every shard and the shard folder's
JSON, the text tokenizer); ``/api/manifest`` adds every checkpoint's files, which appear as the
run goes. Keys are the paths under the coordinator's address (``shards/train-00000.parquet``),
so a volunteer checks a file by the URL it fetched it from (``crowdtrain.runspec.trust``).

Hashing a large shard folder or a GB checkpoint takes a while: digests are kept in
``RUN_DIR/file_hashes.json`` by path, size and modification time, so each file is read once
per change, not per start or request.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from crowdtrain.runspec.trust import sha256_file

logger = logging.getLogger(__name__)

CACHE_FILE = "file_hashes.json"


class FileHashes:
    """sha256 of files, cached by (size, mtime) in ``cache_path``."""

    def __init__(self, cache_path: str | Path):
        self.cache_path = Path(cache_path)
        self._lock = threading.Lock()
        try:
            cached = json.loads(self.cache_path.read_text())
            self._cache = cached if isinstance(cached, dict) else {}
        except (OSError, ValueError):
            self._cache = {}
        self._dirty = False

    def of(self, path: Path) -> str:
        path = Path(path).resolve()
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        with self._lock:
            entry = self._cache.get(str(path))
            if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
                return entry["sha256"]
        digest = sha256_file(path)
        with self._lock:
            self._cache[str(path)] = {"stamp": stamp, "sha256": digest}
            self._dirty = True
        return digest

    def save(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            # Entries of files that are gone (pruned checkpoints) are dropped.
            self._cache = {k: v for k, v in self._cache.items() if Path(k).exists()}
            text, self._dirty = json.dumps(self._cache, indent=0), False
        tmp = self.cache_path.with_name(self.cache_path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.cache_path)


def fixed_files(hashes: FileHashes, *, wheel_name: str, wheel_sha256: str, shards_dir: Path | None,
                served_shard, text_tokenizer: Path | None) -> dict[str, str]:
    """{path under the coordinator's address: sha256} of the files that do not change in a run."""
    started = time.monotonic()
    files = {f"install/{wheel_name}": wheel_sha256}
    if text_tokenizer is not None:
        files["assets/text_tokenizer.json"] = hashes.of(text_tokenizer)
    if shards_dir is not None:
        for path in sorted(Path(shards_dir).iterdir()):
            if path.is_file() and served_shard.fullmatch(path.name):
                files[f"shards/{path.name}"] = hashes.of(path)
    hashes.save()
    took = time.monotonic() - started
    if took > 5:
        logger.info("hashed the run's files for its signed manifest in %.0f s (cached in %s from now on)", took,
                    hashes.cache_path)
    return files


def checkpoint_files(hashes: FileHashes, checkpoint_dir: Path, names, allowed) -> dict[str, str]:
    """{``checkpoints/NAME/FILE``: sha256} of the checkpoints ``names`` (files in ``allowed``)."""
    files = {}
    for name in names:
        folder = Path(checkpoint_dir) / name
        for filename in sorted(allowed):
            path = folder / filename
            try:
                files[f"checkpoints/{name}/{filename}"] = hashes.of(path)
            except OSError:  # not in this checkpoint, or pruned meanwhile
                continue
    hashes.save()
    return files
