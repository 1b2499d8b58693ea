"""Shared helpers for the tests/test_data_*.py files (small tokenizers, shards, tiny checkpoints)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from crowdtrain.data import shapes
from crowdtrain.data.image_tokenizer import SmallVQ, load_image_tokenizer
from crowdtrain.data.shards import Item, prepare_shards


def random_vq(path: Path, *, seed: int = 0) -> Path:
    """An untrained SmallVQ (64x64 -> 8x8 of 512), fast to build: enough for plumbing tests."""
    torch.manual_seed(seed)
    return SmallVQ().save(path)


def make_shards(directory: Path, tokenizer_path: Path, *, num: int = 40, seed: int = 0, shard_size: int = 20,
                split: str = "train") -> Path:
    tok = load_image_tokenizer(tokenizer_path)
    items = (Item(f"shapes://{seed}/{i}", image=im, caption=cap)
             for i, (im, cap, _) in enumerate(shapes.generate_samples(num, seed=seed)))
    prepare_shards(None, directory, tok, split=split, shard_size=shard_size, progress=False, items=(items, num))
    return directory


def shard_rows(directory: Path, split: str = "train") -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted(Path(directory).glob(f"{split}-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def codes_of(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype="<i2").tolist())
