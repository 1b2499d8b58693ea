"""The demo's data: shapes shards made on the fly with the shipped tokenizers, made once.

``ensure_demo_shards`` generates the shapes images in memory (no PNG files), encodes them with
the shipped VQ tokenizer and writes shards through the real ``prepare_shards`` path. Three splits:

- ``train``: ``num_train`` images (50,000 by default: a 14-minute demo run sees each image about
  once, so the model learns the shapes rather than memorising pictures), never a held-out
  composition (:data:`crowdtrain.data.shapes.HELDOUT_PAIRS`);
- ``valid``: 256 fresh images of training compositions from another seed (the validation loss:
  same distribution as training, never trained on);
- ``heldout``: 256 images that each show at least one held-out composition (the loss on what
  the model must compose; empty of training compositions by construction).

A finished folder holds ``demo.json``, the recipe that made it (sizes, seed, the tokenizer's
digest and a fingerprint of the drawing code); a later call with the same recipe returns at once.
Large sets are also kept in a shared cache (``$CROWDTRAIN_CACHE``, else ``~/.cache/crowdtrain``),
so ``runs/demo``, the benchmarks and a second checkout copy (hard-link) finished shards instead of
making them again. The default 50,000 images (1.8 MB of shards) take 2-7 minutes on 2 CPU cores
(encoding dominates, ~130 images/s on busy cores), once; memory stays under one shard of images
(5,000 x 12 KB). Lower ``num_train`` where that is too long: 20,000 still shows each image only
a few times in a 14-minute run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from crowdtrain.data.shards import MANIFEST, Item, prepare_shards, read_manifest

logger = logging.getLogger(__name__)

DEFAULT_NUM_TRAIN = 50_000
VALID_SIZE = 256
HELDOUT_SIZE = 256
SHARD_SIZE = 5_000  # images held in memory at once while encoding (~60 MB)
# Smaller sets take seconds to make: not worth a place in the shared cache (keeps the test
# suite, which makes a few hundred images at a time, from filling it).
SHARED_CACHE_MIN_IMAGES = 10_000
MARKER = "demo.json"


def default_cache_dir() -> Path:
    """Where finished demo shards are shared between runs: ``$CROWDTRAIN_CACHE`` or ``~/.cache/crowdtrain``."""
    return Path(os.environ.get("CROWDTRAIN_CACHE") or Path.home() / ".cache" / "crowdtrain")


def demo_recipe(num_train: int, seed: int, tokenizer) -> dict:
    """What makes a demo folder: equal recipes give equal shards (the cache key)."""
    from crowdtrain.data import shapes
    from crowdtrain.data.image_tokenizer import tokenizer_digest

    # A change to the drawing code changes these first pictures, and so the key.
    h = hashlib.sha256()
    for image, caption, _ in shapes.generate_samples(16, seed=seed, heldout=None):
        h.update(image.tobytes())
        h.update(caption.encode())
    return {"num_train": num_train, "seed": seed, "valid": VALID_SIZE, "heldout": HELDOUT_SIZE,
            "shard_size": SHARD_SIZE, "tokenizer": tokenizer_digest(tokenizer), "shapes": h.hexdigest()[:16]}


def ensure_demo_shards(directory, *, num_train: int = DEFAULT_NUM_TRAIN, seed: int = 0,
                       progress: bool | None = None, cache: str | Path | bool = True) -> Path:
    """Make (if missing) the demo shards under ``directory`` and return the folder.

    ``cache``: True = the shared cache (:func:`default_cache_dir`) for sets of at least
    ``SHARED_CACHE_MIN_IMAGES`` images; a path = that cache folder, for any size; False = none.
    ``progress``: progress bars on stderr; None = only for sets worth a cache entry (they take
    a minute, the small ones a few seconds).
    """
    from crowdtrain.data.tokenizers import default_image_tokenizer

    out = Path(directory)
    if num_train <= 0:
        raise ValueError("num_train must be positive")
    tokenizer = default_image_tokenizer()
    recipe = demo_recipe(num_train, seed, tokenizer)
    if _is_finished(out, recipe):
        return out
    if progress is None:
        progress = num_train >= SHARED_CACHE_MIN_IMAGES
    if cache is True:
        cache_root = default_cache_dir() if num_train >= SHARED_CACHE_MIN_IMAGES else None
    else:
        cache_root = Path(cache) if cache else None
    return build_cached(out, cache_root=cache_root, entry=f"shapes-{num_train}", recipe=recipe, marker=MARKER,
                        make=lambda folder, _entry: _make(folder, recipe, tokenizer, progress=progress),
                        is_finished=lambda folder: _is_finished(folder, recipe), clear=_clear,
                        what=f"{num_train} demo images")


def build_cached(out: Path, *, cache_root: Path | None, entry: str, recipe: dict, marker: str,
                 make: Callable[[Path, Path | None], None], is_finished: Callable[[Path], bool],
                 clear: Callable[[Path], None], what: str) -> Path:
    """Make a data set once and keep it in the cache: a bundled data set (shapes, emoji) is made
    from its ``recipe`` the first time and reused by every later run and test.

    ``make(folder, entry_path)`` writes the set into ``folder``, ``marker`` (the recipe) last;
    ``entry_path`` is where the cache entry will live (None without a cache), for state that
    must outlive an interrupt (a tokenizer's training). The entry is made in a private folder
    and renamed into place, so two processes that start at once (the demo's coordinator and
    peers) never read a half-made one; ``out`` then gets links to its files, the marker last,
    so a copy cut short is not finished either."""
    if cache_root is None:
        clear(out)
        make(out, None)
        return out
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    cached = cache_root / "demo-shards" / f"{entry}-{key}"
    if not is_finished(cached):
        cached.parent.mkdir(parents=True, exist_ok=True)
        with _one_maker(cache_root / "locks" / f"{cached.name}.lock", what):
            if is_finished(cached):  # made by the process this one waited for
                logger.info("%s: reusing %s", what, cached)
            else:
                _make_entry(cached, make, is_finished, what)
    else:
        logger.info("%s: reusing %s", what, cached)
    clear(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(cached.iterdir()):
        if f.is_file() and f.name != marker:
            _link_or_copy(f, out / f.name)
    _link_or_copy(cached / marker, out / marker)
    return out


def _make_entry(cached: Path, make, is_finished, what: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=cached.name + ".tmp-", dir=cached.parent))
    logger.info("making %s once; later runs reuse %s", what, cached)
    try:
        make(tmp, cached)
        try:
            os.replace(tmp, cached)
        except OSError:  # a process without the lock (another filesystem's) finished first, or a broken entry
            if not is_finished(cached):
                shutil.rmtree(cached, ignore_errors=True)
                os.replace(tmp, cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _one_maker(lock: Path, what: str):
    """One process at a time makes a cache entry: a second one (the benchmarks beside a demo, two
    test workers, a coordinator and its peers) waits for the first rather than spending the same
    minutes of a busy machine again, and never trains a tokenizer into the same resume file. An
    advisory lock: the OS drops it when its holder dies, so an interrupted maker blocks nobody,
    and the next one takes over (resuming a tokenizer's training from its saved state). Where there are no such locks (Windows) both make the
    entry and the rename keeps it whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is making %s; waiting for it to finish (lock: %s)", what, lock)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_finished(folder: Path, recipe: dict) -> bool:
    marker = folder / MARKER
    try:
        return json.loads(marker.read_text()) == recipe and read_manifest(folder) is not None
    except (OSError, ValueError):
        return False


def _clear(out: Path) -> None:
    """Remove what an older recipe (or an interrupted run) left, and nothing else."""
    if out.exists():
        for old in [*out.glob("*.parquet"), out / MANIFEST, out / MARKER]:
            old.unlink(missing_ok=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def _make(out: Path, recipe: dict, tokenizer, *, progress: bool) -> None:
    from crowdtrain.data import shapes

    seed, num_train = recipe["seed"], recipe["num_train"]
    splits = (("train", num_train, seed, False), ("valid", VALID_SIZE, seed + 1_000_003, False),
              ("heldout", HELDOUT_SIZE, seed + 2_000_003, True))
    for split, num, split_seed, heldout in splits:
        items = (Item(f"shapes://seed{split_seed}/{i:06d}", image=image, caption=caption)
                 for i, (image, caption, _) in enumerate(shapes.generate_samples(num, seed=split_seed,
                                                                                 heldout=heldout)))
        prepare_shards(None, out, tokenizer, split=split, shard_size=min(max(num_train // 4, 256), SHARD_SIZE),
                       progress=progress, items=(items, num))
    (out / MARKER).write_text(json.dumps(recipe))
    logger.info("demo shards ready in %s (%d train images)", out, num_train)
