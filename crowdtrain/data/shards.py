"""Shards: brotli-compressed parquet files of captions and image codes (``crowdtrain data prepare``).

Columns, the same as the paper's published LAION VQGAN data (``laion/laion_100m_vqgan_f8``),
so that data set streams unchanged:

==================  =======  ==============================================================
caption             string   the text
code                binary   the image's H' x W' codes in raster order, little-endian int16
original_width      int64    size of the source image before resizing
original_height     int64
NSFW                string   safety flag; "UNLIKELY" = safe (LAION's values: UNLIKELY, UNSURE, NSFW)
url                 string   where the sample came from (a URL, or a file path / shapes id)
==================  =======  ==============================================================

A folder of shards holds ``{split}-{index:05d}.parquet`` and ``shards.json`` (the manifest: the
image tokenizer's digest and grid, and per shard its rows and what was skipped). ``prepare``
cuts the input into fixed runs of ``shard_size`` items in a deterministic order, writes each
shard to a temporary name and renames it when complete, and rewrites the manifest after each
shard: after an interrupt, the same command skips the finished shards and continues. The
manifest is rewritten from what is on disk, under a lock on the folder, so runs of different
splits into one folder at the same time keep each other's shards.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

logger = logging.getLogger(__name__)

MANIFEST = "shards.json"
FORMAT = "crowdtrain-shards/1"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
COLUMNS = ("caption", "code", "original_width", "original_height", "NSFW", "url")
SKIPPED_SHOWN = 20  # skipped files named in the summary; more go to skipped-{split}.txt


def shard_schema():
    import pyarrow as pa

    return pa.schema([("caption", pa.string()), ("code", pa.binary()), ("original_width", pa.int64()),
                      ("original_height", pa.int64()), ("NSFW", pa.string()), ("url", pa.string())])


def codes_to_bytes(codes) -> bytes:
    """(H', W') or (N,) integer codes -> little-endian int16 bytes (the ``code`` column)."""
    arr = np.asarray(codes).reshape(-1)
    if arr.size and (arr.min() < -32768 or arr.max() > 32767):
        raise ValueError("codes do not fit int16")
    return arr.astype("<i2").tobytes()


def bytes_to_codes(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i2").astype(np.int64)


def write_shard(path, rows: dict[str, list]) -> int:
    """Write one shard atomically (temporary name, then rename). Returns the number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    table = pa.table({c: rows[c] for c in COLUMNS}, schema=shard_schema())
    tmp = path.with_name(path.name + ".tmp")
    # Dictionary encoding only where values repeat, and no min/max statistics of code blobs:
    # on unique binary values both only add bytes.
    pq.write_table(table, tmp, compression="brotli", row_group_size=1024, use_dictionary=["caption", "NSFW"],
                   write_statistics=["caption", "original_width", "original_height", "NSFW", "url"])
    os.replace(tmp, path)
    return table.num_rows


# ---- inputs -------------------------------------------------------------------------------

@dataclass
class Item:
    """One input sample before encoding; ``error`` set when it cannot be used (the skip reason)."""

    source: str
    image_bytes: bytes | None = None
    image_path: Path | None = None
    image: np.ndarray | None = None  # an in-memory (H, W, 3) uint8 image (the demo data)
    caption: str | None = None
    nsfw: str | None = None
    error: str | None = None


def iter_items(source) -> tuple[Iterator[Item], int | None]:
    """Items of an input, in a deterministic order, and their count when known up front."""
    source = Path(source)
    if source.is_dir():
        paths = sorted(p for p in source.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not paths:
            raise ValueError(f"--input {source} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        return (_folder_item(p, source) for p in paths), len(paths)
    if not source.is_file():
        raise FileNotFoundError(f"--input {source} does not exist")
    if source.suffix == ".tar":
        return _tar_items(source), None
    if source.suffix == ".parquet":
        import pyarrow.parquet as pq
        return _parquet_items(source), pq.ParquetFile(source).metadata.num_rows
    raise ValueError(f"--input {source}: expected a folder of images with .txt captions, a webdataset .tar "
                     "or a .parquet with image bytes and captions")


def _folder_item(path: Path, root: Path) -> Item:
    txt = path.with_suffix(".txt")
    caption = txt.read_text().strip() if txt.exists() else None
    return Item(str(path.relative_to(root)), image_path=path, caption=caption,
                error=None if txt.exists() else "missing caption (.txt)")


def _tar_items(path: Path) -> Iterator[Item]:
    """webdataset layout: members grouped by key (name up to the first dot): key.jpg + key.txt/json."""
    def flush(key, parts):
        image = next((parts[e] for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
        caption = parts.get("txt", b"").decode("utf-8", "replace").strip() or None
        nsfw = None
        if "json" in parts:
            try:
                meta = json.loads(parts["json"])
                caption = caption or meta.get("caption")
                nsfw = meta.get("NSFW")
            except ValueError:
                pass
        error = "no image in the sample" if image is None else None if caption else "missing caption"
        return Item(f"{path.name}/{key}", image_bytes=image, caption=caption, nsfw=nsfw, error=error)

    with tarfile.open(path) as tar:
        key, parts = None, {}
        for member in tar:
            if not member.isfile():
                continue
            name = member.name
            base = name.rsplit("/", 1)[-1]
            k, _, ext = base.partition(".")
            k = name[: len(name) - len(base)] + k
            if key is not None and k != key:
                yield flush(key, parts)
                parts = {}
            key = k
            parts[ext.lower()] = tar.extractfile(member).read()
        if key is not None:
            yield flush(key, parts)


def _parquet_items(path: Path) -> Iterator[Item]:
    """A parquet with an image column (binary, or HF's Image struct {bytes, path}) and a caption column."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    image_col = next((c for c in ("image", "jpg", "png", "image_bytes", "img") if c in names), None)
    caption_col = next((c for c in ("caption", "text", "txt") if c in names), None)
    if image_col is None or caption_col is None:
        raise ValueError(f"{path}: need an image column (image/jpg/png/image_bytes) and a caption column "
                         f"(caption/text); found {names}")
    columns = [image_col, caption_col] + [c for c in ("NSFW", "url") if c in names]
    n = 0
    for batch in pf.iter_batches(columns=columns, batch_size=256):
        d = batch.to_pydict()
        for i in range(batch.num_rows):
            img = d[image_col][i]
            if isinstance(img, dict):
                img = img.get("bytes")
            caption = d[caption_col][i]
            src = d["url"][i] if "url" in d and d["url"][i] else f"{path.name}#{n}"
            yield Item(src, image_bytes=img, caption=caption.strip() if caption else None,
                       nsfw=d["NSFW"][i] if "NSFW" in d else None,
                       error=None if img else "no image bytes" if caption else "missing caption")
            n += 1


# ---- prepare ------------------------------------------------------------------------------

@dataclass
class PrepareSummary:
    out: Path
    shards_written: int = 0
    shards_resumed: int = 0
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)
    skipped_items: list = field(default_factory=list)  # [source, reason] of each skipped item
    skipped_file: Path | None = None  # where all of them are listed when there are many

    def format(self) -> str:
        lines = [f"{self.out}: {self.rows} rows in {self.shards_written + self.shards_resumed} shards "
                 f"({self.shards_written} written now, {self.shards_resumed} already done)"]
        if self.skipped:
            lines.append(f"skipped {sum(self.skipped.values())} items:")
            lines += [f"  {n:6d}  {reason}" for reason, n in self.skipped.most_common()]
            shown = self.skipped_items[:SKIPPED_SHOWN]
            lines += [f"  {source}: {reason}" for source, reason in shown]
            if self.skipped_file is not None:
                lines.append(f"  ... all {len(self.skipped_items)} listed in {self.skipped_file}")
        else:
            lines.append("skipped nothing")
        return "\n".join(lines)


def prepare_shards(source, out_dir, tokenizer, *, split: str = "train", shard_size: int = 5000, batch_size: int = 64,
                   nsfw_default: str = "UNLIKELY", progress: bool = True, stop_after_shards: int | None = None,
                   items: tuple[Iterator[Item], int | None] | None = None,
                   dataset: dict | None = None) -> PrepareSummary:
    """Encode images + captions from ``source`` into shards under ``out_dir`` (see the module docstring).

    ``stop_after_shards`` stops early as an interrupt would (tests use it); ``items`` replaces
    ``source`` with ready-made items (the demo data uses it to skip writing PNG files).
    ``dataset``: what the data set is, ``{"name": NAME, ...}``, recorded in the manifest (kept by
    later calls that give none): ``crowdtrain.data.judges`` picks the judge of its pictures by NAME.
    """
    from tqdm import tqdm

    from crowdtrain.data.image_tokenizer import tokenizer_digest

    if shard_size <= 0:
        raise ValueError("--shard-size must be positive")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    digest = tokenizer_digest(tokenizer)
    h, w = tokenizer.grid_size
    manifest = {"format": FORMAT, "image_tokenizer": {"kind": tokenizer.kind, "digest": digest, "grid": [h, w],
                                                      "vocab_size": tokenizer.vocab_size,
                                                      "image_size": tokenizer.image_size},
                "splits": {}}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old.get("image_tokenizer", {}).get("digest") != digest:
            raise ValueError(f"{out} holds shards made with another image tokenizer "
                             f"({old.get('image_tokenizer')}); use a new --out folder")
        manifest["splits"] = old.get("splits", {})
        if old.get("dataset") is not None:
            manifest["dataset"] = old["dataset"]
    if dataset is not None:
        manifest["dataset"] = dataset
    done = {s["index"]: s for s in manifest["splits"].get(split, [])
            if s.get("shard_size") == shard_size and (out / s["file"]).exists()}
    summary = PrepareSummary(out)
    for s in done.values():
        summary.shards_resumed += 1
        summary.rows += s["rows"]
        summary.skipped.update(s["skipped"])
        summary.skipped_items += s.get("skipped_items", [])
    if done:
        logger.info("resuming: %d finished shard(s) of %s in %s", len(done), split, out)

    item_iter, total = items if items is not None else iter_items(source)
    bar = tqdm(total=total, desc=f"prepare {split}", unit="img", disable=not progress)
    index, buffer = 0, []

    def finish_shard(index: int, buffer: list[Item]) -> None:
        if index in done:
            return
        rows, skipped, skipped_items = _encode_items(buffer, tokenizer, batch_size=batch_size,
                                                     nsfw_default=nsfw_default)
        name = f"{split}-{index:05d}.parquet"
        n = write_shard(out / name, rows)
        entry = {"index": index, "file": name, "rows": n, "skipped": dict(skipped), "skipped_items": skipped_items,
                 "shard_size": shard_size}
        _add_to_manifest(manifest_path, manifest, split, entry)
        summary.shards_written += 1
        summary.rows += n
        summary.skipped.update(skipped)
        summary.skipped_items += skipped_items

    for item in item_iter:
        buffer.append(item)
        if len(buffer) == shard_size:
            finish_shard(index, buffer)
            bar.update(len(buffer))
            index, buffer = index + 1, []
            if stop_after_shards is not None and summary.shards_written >= stop_after_shards:
                bar.close()
                return summary
    if buffer:
        finish_shard(index, buffer)
        bar.update(len(buffer))
    bar.close()
    listing = out / f"skipped-{split}.txt"
    listing.unlink(missing_ok=True)
    if len(summary.skipped_items) > SKIPPED_SHOWN:
        listing.write_text("".join(f"{source}\t{reason}\n" for source, reason in summary.skipped_items))
        summary.skipped_file = listing
    return summary


def _encode_items(items: list[Item], tokenizer, *, batch_size: int, nsfw_default: str):
    from PIL import Image

    from crowdtrain.data.vq_train import fit_image

    rows = {c: [] for c in COLUMNS}
    skipped: Counter = Counter()
    named = []  # [source, reason]: what the summary lists
    ready = []  # (item, fitted image, original size)
    for item in items:
        if item.error:
            skipped[item.error] += 1
            named.append([item.source, item.error])
            continue
        if not item.caption:
            skipped["empty caption"] += 1
            named.append([item.source, "empty caption"])
            continue
        if item.image is not None:
            ready.append((item, np.asarray(fit_image(Image.fromarray(item.image), tokenizer.image_size)),
                          (item.image.shape[1], item.image.shape[0])))
            continue
        try:
            src = item.image_path if item.image_path is not None else io.BytesIO(item.image_bytes)
            with Image.open(src) as im:
                im.load()
                size = im.size
                fitted = np.asarray(fit_image(im, tokenizer.image_size))
        except Exception as e:  # PIL raises many types for broken files
            skipped[f"unreadable image ({type(e).__name__})"] += 1
            named.append([item.source, f"unreadable image ({type(e).__name__}: {str(e)[:200]})"])
            continue
        ready.append((item, fitted, size))
    for i in range(0, len(ready), batch_size):
        chunk = ready[i: i + batch_size]
        codes = tokenizer.encode(np.stack([f for _, f, _ in chunk])).cpu().numpy()
        for (item, _, (w, h)), c in zip(chunk, codes):
            rows["caption"].append(item.caption)
            rows["code"].append(codes_to_bytes(c))
            rows["original_width"].append(w)
            rows["original_height"].append(h)
            rows["NSFW"].append(item.nsfw or nsfw_default)
            rows["url"].append(item.source)
    return rows, skipped, named


# How well the image tokenizer keeps the user's images (``data prepare``'s fit report). PSNR over
# 0..255 RGB: the shipped learned VQ gives ~25 dB on the shapes pictures it was trained for, where
# a model learns them well; below ~22 dB edges and small details are visibly gone (letters garble,
# gradients band) and the model can learn no more than the codes keep. Raise the bar for photos.
FIT_POOR_DB = 22.0
FIT_IMAGES = 32


def fit_sample(source, num: int, *, seed: int = 0) -> tuple[list[Item], int]:
    """A seeded random sample of ``num`` items of ``source`` (reservoir sampling, one pass; items
    that already carry an error are left out) and how many items it was drawn from. Random, not
    the first files in sort order, which are often alike (one folder, one class, one style)."""
    import random

    rng = random.Random(seed)
    item_iter, _ = iter_items(source)
    sample: list[Item] = []
    seen = 0
    for item in item_iter:
        if item.error:
            continue
        seen += 1
        if len(sample) < num:
            sample.append(item)
        else:
            j = rng.randrange(seen)
            if j < num:
                sample[j] = item
    return sample, seen


def tokenizer_fit_report(source, tokenizer, out_dir, *, num: int = FIT_IMAGES, split: str = "train",
                         seed: int = 0) -> dict | None:
    """Encode and decode a seeded random sample of ``num`` images of ``source`` (:func:`fit_sample`);
    returns the PSNR and mean absolute error of the round trip and writes ``fit_report-SPLIT.png`` in
    ``out_dir`` (originals on the top row of each pair, reconstructions below), so each split's
    `data prepare` keeps its own picture. None when no image could be read."""
    from PIL import Image

    from crowdtrain.data.vq_train import fit_image

    sample, population = fit_sample(source, num, seed=seed)
    originals = []
    for item in sample:
        try:
            if item.image is not None:
                im = Image.fromarray(item.image)
            else:
                im = Image.open(item.image_path if item.image_path is not None else io.BytesIO(item.image_bytes))
                im.load()
            originals.append(np.asarray(fit_image(im, tokenizer.image_size)))
        except Exception:  # counted as unreadable by the prepare pass itself
            continue
    if not originals:
        return None
    batch = np.stack(originals)
    recon = tokenizer.decode(tokenizer.encode(batch)).cpu().numpy()
    err = batch.astype(np.float64) - recon.astype(np.float64)
    mse = float((err ** 2).mean())
    psnr = 10 * math.log10(255 ** 2 / mse) if mse > 0 else float("inf")
    # Pairs side by side: 8 per row, the original above its reconstruction.
    size, per_row = tokenizer.image_size, 8
    rows = math.ceil(len(batch) / per_row)
    sheet = np.full((rows * (2 * size + 6), per_row * (size + 2), 3), 255, np.uint8)
    for i, (a, b) in enumerate(zip(batch, recon)):
        r, c = divmod(i, per_row)
        y, x = r * (2 * size + 6), c * (size + 2)
        sheet[y: y + size, x: x + size] = a
        sheet[y + size + 1: y + 2 * size + 1, x: x + size] = b
    picture = Path(out_dir) / f"fit_report-{split}.png"
    Image.fromarray(sheet).resize((sheet.shape[1] * 2, sheet.shape[0] * 2), Image.NEAREST).save(picture)
    return {"images": len(batch), "of": population, "split": split, "seed": seed, "psnr_db": psnr,
            "mean_abs_error": float(np.abs(err).mean()), "picture": str(picture), "poor": psnr < FIT_POOR_DB,
            "sources": [item.source for item in sample]}


def format_fit_report(report: dict | None, tokenizer_name: str) -> str:
    if report is None:
        return "tokenizer fit: no readable image to check"
    psnr = "exact" if math.isinf(report["psnr_db"]) else f"PSNR {report['psnr_db']:.1f} dB"
    drawn = (f" ({report['split']} split, a random sample of {report['of']}, seed {report['seed']})"
             if "of" in report else "")
    line = (f"tokenizer fit: {psnr}, mean error {report['mean_abs_error']:.1f}/255 on {report['images']} of your "
            f"images{drawn} (originals over reconstructions: {report['picture']})")
    if not report["poor"]:
        return line
    return (line + f"\nWARNING: the image tokenizer ({tokenizer_name}) loses much of your images (below "
            f"{FIT_POOR_DB:.0f} dB): the model can learn only what the codes keep. Look at the picture; then train "
            "a tokenizer on your images (`crowdtrain tokenizer train --data DIR --out my_vq.safetensors`, and "
            "prepare with `--image-tokenizer my_vq.safetensors`), or for 256x256 photographs convert the "
            "paper's VQGAN (`crowdtrain tokenizer convert`).")


def _add_to_manifest(path: Path, fresh: dict, split: str, entry: dict) -> None:
    """Write ``entry`` (a shard of ``split``) into the manifest at ``path`` as it is on disk now,
    under a lock on its folder: two ``data prepare`` runs of different splits into one folder (two
    terminals, or a script's parallel jobs) each keep the other's shards. ``fresh``: this run's
    manifest, written as it is when there is none on disk yet."""
    import fcntl

    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        manifest = json.loads(path.read_text()) if path.exists() else fresh
        theirs = manifest.get("image_tokenizer", {}).get("digest")
        if theirs != fresh["image_tokenizer"]["digest"]:
            raise ValueError(f"{path.parent} now holds shards made with another image tokenizer "
                             f"({manifest.get('image_tokenizer')}), written while this run was going on; "
                             "use a new --out folder")
        splits = manifest.setdefault("splits", {})
        entries = [e for e in splits.get(split, []) if e["index"] != entry["index"]] + [entry]
        splits[split] = sorted(entries, key=lambda e: e["index"])
        if fresh.get("dataset") is not None:
            manifest["dataset"] = fresh["dataset"]
        _write_json(path, manifest)
    finally:
        os.close(folder)  # and with it the lock


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def read_manifest(directory) -> dict | None:
    p = Path(directory) / MANIFEST
    return json.loads(p.read_text()) if p.exists() else None
