"""Stream shards to a peer: from a local folder, an HTTP(S) base URL or a Hugging Face hub id.

Nobody downloads the data set: a peer reads the row groups it needs, shuffles them in a buffer
and turns rows into model batches. The pipeline is a ``datasets.IterableDataset`` (the object
``load_dataset(..., streaming=True)`` returns), built with ``IterableDataset.from_generator``
over the list of shard files, so ``datasets`` does the shard-order shuffle, the buffer shuffle,
the per-epoch reshuffle (``set_epoch``) and the filtering. We read each shard ourselves inside
the generator so that one bad shard is isolated: a corrupted or truncated file, or a server that
stops answering within ``http_timeout_s``, is logged once as an error, counted in
``BatchStream.stats``, and skipped; the stream never crashes or hangs on it.

Shuffle seeds come from the peer's identity through :func:`stable_seed` (SHA-256), never
Python's ``hash()``, which is salted per process: a restarted peer gets the same order, two
peers get different orders.

Filters, as the paper: captions shorter than 3 characters, images with aspect ratio above 2,
and rows whose ``NSFW`` flag is not ``UNLIKELY`` are dropped.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from crowdtrain.data.config import StreamConfig
from crowdtrain.data.shards import MANIFEST

logger = logging.getLogger(__name__)

READ_COLUMNS = ("caption", "code", "original_width", "original_height", "NSFW")


def stable_seed(key: str) -> int:
    """A 32-bit seed from a string, the same in every process and on every machine."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:4], "little")


# ---- reading one shard --------------------------------------------------------------------

class HttpRangeFile(io.RawIOBase):
    """A seekable read-only file over HTTP Range requests (what pyarrow needs to read parquet)."""

    def __init__(self, url: str, *, timeout_s: float):
        super().__init__()
        self.url, self.timeout_s, self.pos = url, timeout_s, 0
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            if r.headers.get("Accept-Ranges", "").lower() != "bytes":
                logger.warning("%s does not advertise Range support; reads may fetch whole files", url)
            self.size = int(r.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: offset, io.SEEK_CUR: self.pos + offset, io.SEEK_END: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            data = r.read(n) if r.status == 206 else r.read()[self.pos: self.pos + n]
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def open_shard(path: str, *, timeout_s: float):
    if path.startswith(("http://", "https://")):
        return io.BufferedReader(HttpRangeFile(path, timeout_s=timeout_s), buffer_size=1 << 20)
    if path.startswith("hf://"):
        from huggingface_hub import HfFileSystem
        return HfFileSystem().open(path, "rb")
    return open(path, "rb")


@dataclass
class StreamStats:
    """What the stream has seen; ``bad_shards`` are (shard, error) pairs, each logged once."""

    rows_read: int = 0
    rows_kept: int = 0
    shards_read: int = 0
    bad_shards: list[tuple[str, str]] = field(default_factory=list)

    @property
    def shards_failed(self) -> int:
        return len(self.bad_shards)


_STATS: dict[str, StreamStats] = {}  # by stream id: the generator below runs inside `datasets`
_STATS_LOCK = threading.Lock()
_STREAM_IDS = itertools.count()


def _shard_rows(shards: list[str], stream_id: str, timeout_s: float) -> Iterator[dict]:
    """The rows of each shard in turn (the generator behind the IterableDataset)."""
    import pyarrow.parquet as pq

    stats = _STATS[stream_id]
    for shard in shards:
        try:
            with open_shard(shard, timeout_s=timeout_s) as f:
                pf = pq.ParquetFile(f)
                names = pf.schema_arrow.names
                missing = {"caption", "code"} - set(names)
                if missing:
                    raise ValueError(f"missing column(s) {sorted(missing)}")
                cols = [c for c in READ_COLUMNS if c in names]
                for batch in pf.iter_batches(columns=cols, batch_size=512):
                    d = batch.to_pydict()
                    n = batch.num_rows
                    for c in READ_COLUMNS:
                        d.setdefault(c, [None] * n)
                    stats.rows_read += n
                    for i in range(n):
                        yield {c: d[c][i] for c in READ_COLUMNS}
            stats.shards_read += 1
        except Exception as e:  # corrupted / truncated parquet, network errors, timeouts
            with _STATS_LOCK:
                seen = any(s == shard for s, _ in stats.bad_shards)
                if not seen:
                    stats.bad_shards.append((shard, f"{type(e).__name__}: {e}"))
            if not seen:
                logger.error("skipping shard %s: %s: %s", shard, type(e).__name__, str(e)[:300])


# ---- listing shards -----------------------------------------------------------------------

def list_shards(source: str, split: str = "train", *, timeout_s: float = 30.0) -> list[str]:
    """The shard files of ``split`` in a local folder, under an http(s) base URL, or in a hub data set."""
    source = str(source)
    if source.startswith(("http://", "https://")):
        base = source if source.endswith("/") else source + "/"
        try:
            with urllib.request.urlopen(base + MANIFEST, timeout=timeout_s) as r:
                manifest = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ValueError(f"cannot read {base + MANIFEST} ({e}); serve a shard folder made by "
                             "`crowdtrain data prepare` (it holds the manifest) with `crowdtrain data serve`") from e
        files = [s["file"] for s in manifest.get("splits", {}).get(split, [])]
        if not files:
            raise ValueError(f"{base} has no shards for split {split!r} (splits: {sorted(manifest.get('splits', {}))})")
        return [base + f for f in files]
    path = Path(source)
    if path.is_dir():
        manifest = path / MANIFEST
        if manifest.exists():
            files = [s["file"] for s in json.loads(manifest.read_text()).get("splits", {}).get(split, [])]
            return [str(path / f) for f in files if (path / f).exists()] or _no_shards(source, split)
        files = sorted(path.glob(f"{split}-*.parquet")) or sorted(path.rglob("*.parquet"))
        return [str(f) for f in files] or _no_shards(source, split)
    if re.fullmatch(r"(hf://datasets/)?[\w.-]+/[\w.-]+", source):
        repo = source.removeprefix("hf://datasets/")
        try:
            from huggingface_hub import HfFileSystem
            files = sorted(HfFileSystem().glob(f"datasets/{repo}/**/*.parquet"))
        except Exception as e:
            raise ValueError(f"cannot list hub data set {repo} ({type(e).__name__}: {e}); check the id and your "
                             "network, or download its parquet files and pass the folder") from e
        split_files = [f for f in files if f"/{split}" in f or f"{split}-" in f.rsplit("/", 1)[-1]]
        files = split_files or files
        return [f"hf://{f}" for f in files] or _no_shards(source, split)
    raise FileNotFoundError(f"data source {source!r} is neither a folder, an http(s) URL nor a hub id (owner/name)")


def _no_shards(source, split):
    raise ValueError(f"no parquet shards for split {split!r} in {source}; make them with `crowdtrain data prepare`")


# ---- the stream ---------------------------------------------------------------------------

_FEATURES = None


def _features():
    global _FEATURES
    if _FEATURES is None:
        from datasets import Features, Value
        _FEATURES = Features({"caption": Value("string"), "code": Value("binary"),
                              "original_width": Value("int64"), "original_height": Value("int64"),
                              "NSFW": Value("string")})
    return _FEATURES


def keep_row(row: dict, config: StreamConfig = StreamConfig()) -> bool:
    """The paper's filters. Rows without a size keep it unknown (aspect not checked)."""
    caption, w, h = row.get("caption"), row.get("original_width"), row.get("original_height")
    if caption is None or len(caption) < config.min_caption_chars:
        return False
    if w and h and max(w / h, h / w) > config.max_aspect_ratio:
        return False
    return row.get("NSFW") == config.safe_value and row.get("code") is not None


def open_stream(source, *, seed_key: str, split: str = "train", config: StreamConfig = StreamConfig()):
    """(rows IterableDataset, stats, shard list): shuffled and filtered, one epoch per iteration."""
    from datasets import IterableDataset

    shards = list_shards(source, split, timeout_s=config.http_timeout_s)
    stream_id = f"{seed_key}/{split}/{next(_STREAM_IDS)}"
    stats = _STATS.setdefault(stream_id, StreamStats())
    ds = IterableDataset.from_generator(
        _shard_rows, features=_features(),
        gen_kwargs={"shards": shards, "stream_id": stream_id, "timeout_s": config.http_timeout_s})
    if config.shuffle_buffer > 1:
        ds = ds.shuffle(seed=stable_seed(seed_key), buffer_size=config.shuffle_buffer)
    ds = ds.filter(lambda row: keep_row(row, config))
    return ds, stats, shards


class BatchStream:
    """Infinite iterator of model batches ``{"text": (B, text_len), "image": (B, H*W)}`` (LongTensors).

    Each pass over the shards is one epoch, reshuffled with ``set_epoch``. ``stats`` counts rows
    and failed shards. Raises ValueError (never loops forever) when a whole epoch yields no row.
    """

    def __init__(self, source, *, text_tokenizer, model_config, batch_size: int, seed_key: str, split: str = "train",
                 config: StreamConfig = StreamConfig()):
        if batch_size <= 0:
            raise ValueError("batch_size must be positive")
        if text_tokenizer.vocab_size > model_config.text_vocab_size:
            raise ValueError(f"the text tokenizer has {text_tokenizer.vocab_size} tokens but model.text_vocab_size is "
                             f"{model_config.text_vocab_size}; raise text_vocab_size or use a smaller tokenizer")
        self.source, self.split, self.seed_key = str(source), split, seed_key
        self.tokenizer, self.model_config, self.batch_size = text_tokenizer, model_config, batch_size
        self.dataset, self.stats, self.shards = open_stream(source, seed_key=seed_key, split=split, config=config)
        self.epoch = 0
        self._iter = self._batches()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._iter)

    def _rows(self) -> Iterator[dict]:
        while True:
            self.dataset.set_epoch(self.epoch)
            kept = 0
            for row in self.dataset:
                kept += 1
                self.stats.rows_kept += 1
                yield row
            if kept == 0:
                raise ValueError(f"no usable rows in {self.source} (split {self.split}): {self.stats.shards_failed} of "
                                 f"{len(self.shards)} shard(s) failed ({self.stats.bad_shards[:3]}), "
                                 f"{self.stats.rows_read} rows read, all filtered out or unreadable")
            logger.info("epoch %d of %s done: %d rows kept, %d shard(s) failed", self.epoch, self.source, kept,
                        self.stats.shards_failed)
            self.epoch += 1

    def _batches(self) -> Iterator[dict]:
        import torch

        cfg = self.model_config
        rows = self._rows()
        while True:
            chunk = list(itertools.islice(rows, self.batch_size))
            codes = np.stack([self._codes(r["code"]) for r in chunk])
            text = self.tokenizer.encode_batch([r["caption"] for r in chunk], cfg.text_len)
            yield {"text": text, "image": torch.from_numpy(codes)}

    def _codes(self, blob: bytes) -> np.ndarray:
        cfg = self.model_config
        codes = np.frombuffer(blob, dtype="<i2").astype(np.int64)
        if codes.size != cfg.image_len:
            raise ValueError(f"{self.source}: shards hold {codes.size} codes per image but the model expects "
                             f"{cfg.image_len} ({cfg.image_height}x{cfg.image_width}); set model.image_height/width "
                             "to the shards' grid or prepare shards with the matching image tokenizer")
        if codes.min() < 0 or codes.max() >= cfg.image_vocab_size:
            raise ValueError(f"{self.source}: image codes reach {codes.max()} but model.image_vocab_size is "
                             f"{cfg.image_vocab_size}; set it to the image tokenizer's codebook size")
        return codes


def batch_stream(source, *, text_tokenizer, model_config, batch_size: int, seed_key: str, split: str = "train",
                 config: StreamConfig = StreamConfig()) -> BatchStream:
    """Infinite model batches from shards at ``source`` (folder, http(s) base URL or hub id); see :class:`BatchStream`."""
    return BatchStream(source, text_tokenizer=text_tokenizer, model_config=model_config, batch_size=batch_size,
                       seed_key=seed_key, split=split, config=config)
