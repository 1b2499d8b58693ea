"""The demo's data: shapes shards made on the fly with the shipped tokenizers.

``ensure_demo_shards`` generates the shapes images in memory (no PNG files), encodes them with
the shipped VQ tokenizer and writes shards, once: a later call with the same arguments finds the
finished folder (``demo.json`` records what made it) and returns at once. 2,000 images take a
few seconds on 2 CPU cores.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from crowdtrain.data.shards import Item, prepare_shards, read_manifest

logger = logging.getLogger(__name__)

VALID_SIZE = 256


def ensure_demo_shards(directory, *, num_train: int = 2000, seed: int = 0, progress: bool = False) -> Path:
    """Make (if missing) shapes shards under ``directory``: split ``train`` (``num_train`` images,
    no held-out compositions) and ``valid`` (256 images from another seed). Returns the folder."""
    from crowdtrain.data import shapes
    from crowdtrain.data.image_tokenizer import tokenizer_digest
    from crowdtrain.data.tokenizers import default_image_tokenizer

    out = Path(directory)
    if num_train <= 0:
        raise ValueError("num_train must be positive")
    tokenizer = default_image_tokenizer()
    recipe = {"num_train": num_train, "seed": seed, "tokenizer": tokenizer_digest(tokenizer)}
    marker = out / "demo.json"
    if marker.exists() and json.loads(marker.read_text()) == recipe and read_manifest(out):
        return out
    if out.exists():  # made with other arguments (or interrupted): start over, keep nothing stale
        for old in [*out.glob("*.parquet"), out / "shards.json", marker]:
            old.unlink(missing_ok=True)
    for split, num, split_seed in (("train", num_train, seed), ("valid", VALID_SIZE, seed + 1_000_003)):
        items = (Item(f"shapes://seed{split_seed}/{i:06d}", image=image, caption=caption)
                 for i, (image, caption, _) in enumerate(shapes.generate_samples(num, seed=split_seed)))
        prepare_shards(None, out, tokenizer, split=split, shard_size=max(num_train // 4, 256), progress=progress,
                       items=(items, num))
    marker.write_text(json.dumps(recipe))
    logger.info("demo shards ready in %s (%d train images)", out, num_train)
    return out
