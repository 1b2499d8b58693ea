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


STRIPES = ["red and white stripes", "a blue checkerboard", "a green gradient", "yellow vertical bars"]


def stripes_items(num: int, seed: int):
    """Pictures that are not the shapes data (an organizer's own), with captions."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        image = np.full((64, 64, 3), 255, np.uint8)
        k = int(rng.integers(len(STRIPES)))
        image[:: 2 + k] = rng.integers(0, 255, 3, dtype=np.uint8)
        yield Item(f"stripes/{seed}/{i}.png", image=image, caption=f"{STRIPES[k]} number {i}")


def make_stripes_shards(directory: Path, *, train: int = 12, valid: int = 9) -> tuple[Path, Path]:
    """(shard folder with train and valid splits of stripes, the random VQ that coded them)."""
    vq = random_vq(directory / "vq.safetensors")
    tok = load_image_tokenizer(vq)
    for split, num, seed in (("train", train, 0), ("valid", valid, 1)):
        prepare_shards(None, directory / "shards", tok, split=split, shard_size=20, progress=False,
                       items=(stripes_items(num, seed), num))
    return directory / "shards", vq
