"""Stream shards to a peer: from a local folder, an HTTP(S) base URL or a Hugging Face hub id.

Nobody downloads the data set: a peer reads the row groups it needs, shuffles them in a buffer
and turns rows into model batches. The pipeline is a ``datasets.IterableDataset`` (the object
``load_dataset(..., streaming=True)`` returns), built with ``IterableDataset.from_generator``
over the list of shard files, so ``datasets`` does the shard-order shuffle, the buffer shuffle,
the per-epoch reshuffle (``set_epoch``) and the filtering. We read each shard ourselves inside
the generator so that one bad shard is isolated: a corrupted or truncated file, or one that
fails while the rest of the source answers, is logged once as an error, counted in
``BatchStream.stats``, and skipped; the stream never crashes or hangs on it.

An http(s) or hub source that stops answering altogether (the coordinator restarting, the hub
down or rate-limiting) is an outage, not bad data: the shard is retried with back-off and,
meanwhile, the rows read last are replayed, so the peer keeps training; after
``StreamConfig.outage_patience_s`` the stream gives up with an error naming the source. A
transient failure (connection refused or reset, timeout, HTTP 5xx/408/429) counts as an outage
only if the source itself (an http(s) source's manifest, a hub data set's file list) does not
answer either; see :class:`_Source`.

Shuffle seeds come from the peer's identity through :func:`stable_seed` (SHA-256), never
Python's ``hash()``, which is salted per process: a restarted peer gets the same order, two
peers get different orders.

Filters, as the paper: captions shorter than 3 characters, images with aspect ratio above 2,
and rows whose ``NSFW`` flag is not ``UNLIKELY`` are dropped.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import io
import itertools
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from crowdtrain.data.config import StreamConfig
from crowdtrain.data.shards import MANIFEST
from crowdtrain.runspec.trust import FileMismatch, check_file, fetch_checked

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


def fetch_verified(url: str, expected: str | None, *, timeout_s: float, spool_bytes: int = 64 << 20):
    """The whole file at ``url`` in a temporary file (in memory up to ``spool_bytes``), once its
    sha256 is ``expected``; :class:`crowdtrain.runspec.trust.FileMismatch` naming it otherwise."""
    import tempfile

    out = tempfile.SpooledTemporaryFile(max_size=spool_bytes)
    try:
        fetch_checked(url, expected, out, timeout_s=timeout_s)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


def open_shard(path: str, *, timeout_s: float, verified: dict | None = None):
    """A shard to read: by byte ranges over http(s), or fetched whole and checked when ``verified``
    ({URL: sha256}, see ``StreamConfig.verified``) is given."""
    if verified is not None and path.startswith(("http://", "https://")):
        return fetch_verified(path, verified.get(path), timeout_s=timeout_s)
    if path.startswith(("http://", "https://")):
        return io.BufferedReader(HttpRangeFile(path, timeout_s=timeout_s), buffer_size=1 << 20)
    if path.startswith("hf://"):
        from huggingface_hub import HfFileSystem
        return HfFileSystem().open(path, "rb")
    return open(path, "rb")


class DataSourceUnavailable(ValueError):
    """An http(s) data source did not answer for longer than ``StreamConfig.outage_patience_s``."""


class ShardListUnavailable(ValueError):
    """An http(s) source's manifest could not be read for a reason that may pass (down, busy)."""


def is_transient(error: BaseException) -> bool:
    """True for failures that say the server is unreachable or busy, not that the data is bad:
    connection refused or reset, timeouts, a dropped connection mid-read, HTTP 5xx, 408, 429.
    A 4xx (missing file, refused access) or a parquet error is about the data: not transient."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500 or error.code in (408, 429)
    # The hub client's (httpx) errors: an HTTP status on .response, or a transport failure.
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(status, int):
        return status >= 500 or status in (408, 429)
    try:
        import httpx
        if isinstance(error, (httpx.TransportError, httpx.TimeoutException)):
            return True
    except ImportError:
        pass
    return isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException))


@dataclass
class StreamStats:
    """What the stream has seen; ``bad_shards`` are (shard, error) pairs, each logged once.
    ``retries``: shard fetches tried again after a transient failure; ``replayed_rows``: rows
    served again from memory while the source was down; ``outages``: times it stopped answering."""

    rows_read: int = 0
    rows_kept: int = 0
    shards_read: int = 0
    bad_shards: list[tuple[str, str]] = field(default_factory=list)
    retries: int = 0
    replayed_rows: int = 0
    outages: int = 0

    @property
    def shards_failed(self) -> int:
        return len(self.bad_shards)


class _Source:
    """Reads shards for one stream and decides what a failed read means.

    A transient failure of an http(s) shard leads to a probe of the source's manifest (a HEAD
    request). If the manifest answers, the source is up and the shard itself is failing: it is
    read once more (the source may just have come back), then skipped for this epoch. If the
    manifest does not answer, the source is down: the shard is retried after 1, 2, 4 ... s (at most
    ``retry_max_delay_s``), resuming after its rows already yielded, and between retries the
    reader yields rows from ``replay`` (the last ``replay_rows`` kept rows read) in a shuffled
    order, paced by the trainer pulling them (the shuffle buffer pulls in bursts of half its
    size, so a retry can come later than its back-off says); without rows to replay it sleeps.
    The outage clock is the source's, not a shard's: ``datasets`` reads up to 10 shards at once,
    in threads, and all of them wait out the same outage.
    """

    def __init__(self, stats: StreamStats, config: StreamConfig, *, manifest_url: str | None, seed: int):
        self.stats, self.config, self.manifest_url, self.seed = stats, config, manifest_url, seed
        self.replay: collections.deque = collections.deque(maxlen=config.replay_rows)
        self._lock = threading.Lock()
        self._down_since: float | None = None  # monotonic time the source was found down; None: it answers
        self._replays = itertools.count()

    def rows(self, shard: str) -> Iterator[dict]:
        done = 0  # rows of this shard already yielded: a retry resumes after them
        delay, retried_while_up = 1.0, False
        while True:
            try:
                for row in itertools.islice(self._read(shard), done, None):
                    done += 1
                    if self.config.replay_rows and keep_row(row, self.config):
                        with self._lock:
                            self.replay.append(row)
                    yield row
                self.stats.shards_read += 1
                self._mark_up()
                return
            except FileMismatch:
                raise  # not bad luck: someone changed the run's data; the volunteer stops, naming it
            except Exception as e:
                if not (self.manifest_url and is_transient(e)):
                    self._skip(shard, e)
                    return
                down_for = self._down_for(shard, e)
                if down_for is None:  # the source answers
                    if retried_while_up:  # ... but this shard keeps failing
                        self._skip(shard, e)
                        return
                    retried_while_up = True
                    self.stats.retries += 1
                    continue
                patience = self.config.outage_patience_s
                if down_for >= patience:
                    raise DataSourceUnavailable(
                        f"the data source {self.manifest_url} has not answered for {down_for:.0f} s ({shard}: "
                        f"{type(e).__name__}: {str(e)[:200]}); gave up after outage_patience_s = {patience:.0f} s. "
                        "Check that the coordinator (or shard server) is running and reachable, then join again; "
                        "to wait longer, raise --data-outage-patience-s") from e
                wait = min(delay, patience - down_for)
                self.stats.retries += 1
                logger.info("data source still down after %.0f s: retry %d, of %s in %.0f s (%s rows replayed so "
                            "far)", down_for, self.stats.retries, shard.rsplit("/", 1)[-1], wait,
                            self.stats.replayed_rows)
                yield from self._replay(until=time.monotonic() + wait)
                delay = min(2 * delay, self.config.retry_max_delay_s)

    def _down_for(self, shard: str, error: Exception) -> float | None:
        """None if the source's manifest answers; else how long the source has been down."""
        if self._source_answers():
            self._mark_up()
            return None
        now = time.monotonic()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = now
                self.stats.outages += 1
            down_for = now - self._down_since
        if first:
            logger.warning("the data source %s does not answer (%s: %s: %s): retrying with back-off and training "
                           "meanwhile on the %d rows already read; giving up after %.0f s without an answer",
                           self.manifest_url, shard.rsplit("/", 1)[-1], type(error).__name__, str(error)[:120],
                           len(self.replay), self.config.outage_patience_s)
        return down_for

    def _mark_up(self) -> None:
        with self._lock:
            down_since, self._down_since = self._down_since, None
        if down_since is not None:
            logger.warning("the data source %s answers again after %.0f s; streaming resumes (%d retries, %d rows "
                           "replayed so far)", self.manifest_url, time.monotonic() - down_since, self.stats.retries,
                           self.stats.replayed_rows)

    def _read(self, shard: str) -> Iterator[dict]:
        import pyarrow.parquet as pq

        with open_shard(shard, timeout_s=self.config.http_timeout_s, verified=self.config.verified) as f:
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
                self.stats.rows_read += n
                for i in range(n):
                    yield {c: d[c][i] for c in READ_COLUMNS}

    def _source_answers(self) -> bool:
        try:
            if self.manifest_url.startswith("hf://"):
                from huggingface_hub import HfFileSystem
                HfFileSystem(skip_instance_cache=True).ls(self.manifest_url.removeprefix("hf://"), detail=False)
                return True
            request = urllib.request.Request(self.manifest_url, method="HEAD")
            with urllib.request.urlopen(request, timeout=self.config.http_timeout_s):
                return True
        except Exception:
            return False

    def _replay(self, *, until: float) -> Iterator[dict]:
        rng = np.random.default_rng((self.seed, next(self._replays)))
        while time.monotonic() < until:
            with self._lock:
                rows = list(self.replay)
            if not rows:
                time.sleep(max(0.0, until - time.monotonic()))
                return
            for i in rng.permutation(len(rows)):
                self.stats.replayed_rows += 1
                yield rows[i]
                if time.monotonic() >= until:
                    return

    def _skip(self, shard: str, e: Exception) -> None:
        with self._lock:
            seen = any(s == shard for s, _ in self.stats.bad_shards)
            if not seen:
                self.stats.bad_shards.append((shard, f"{type(e).__name__}: {e}"))
        if not seen:
            logger.error("skipping shard %s: %s: %s", shard, type(e).__name__, str(e)[:300])


_STREAMS: dict[str, _Source] = {}  # by stream id: the generator below runs inside `datasets`
_STREAM_IDS = itertools.count()


def _shard_rows(shards: list[str], stream_id: str) -> Iterator[dict]:
    """The rows of each shard in turn (the generator behind the IterableDataset)."""
    source = _STREAMS[stream_id]
    for shard in shards:
        yield from source.rows(shard)


# ---- listing shards -----------------------------------------------------------------------

def remote_manifest_url(source) -> str | None:
    """The manifest's URL of an http(s) shard source; None for other sources."""
    source = str(source)
    if not source.startswith(("http://", "https://")):
        return None
    return source.rstrip("/") + "/" + MANIFEST


def remote_probe(source) -> str | None:
    """What tells whether a remote source answers (an http(s) manifest, ``hf://datasets/OWNER/NAME``
    for a hub data set); None for a local folder, whose failures are never an outage."""
    if (url := remote_manifest_url(source)) is not None:
        return url
    source = str(source)
    if re.fullmatch(HUB_ID, source) and not Path(source).exists():  # "data/shards" may be a folder
        return "hf://datasets/" + source.removeprefix("hf://datasets/")
    return None


HUB_ID = r"(hf://datasets/)?[\w.-]+/[\w.-]+"


def list_shards(source: str, split: str = "train", *, timeout_s: float = 30.0,
                verified: dict | None = None) -> list[str]:
    """The shard files of ``split`` in a local folder, under an http(s) base URL, or in a hub data set.
    ``verified``: {URL: sha256} the http(s) manifest must match (``StreamConfig.verified``)."""
    source = str(source)
    if (url := remote_manifest_url(source)) is not None:
        base = url.removesuffix(MANIFEST)
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                text = r.read()
            if verified is not None:
                check_file(MANIFEST, hashlib.sha256(text).hexdigest(), verified.get(url), url)
            manifest = json.loads(text)
        except FileMismatch:
            raise
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
            kind = ShardListUnavailable if is_transient(e) else ValueError
            raise kind(f"cannot read {url} ({e}); serve a shard folder made by "
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
    if re.fullmatch(HUB_ID, source) and not path.exists():
        repo = source.removeprefix("hf://datasets/")
        try:
            from huggingface_hub import HfFileSystem
            files = sorted(HfFileSystem(skip_instance_cache=True).glob(f"datasets/{repo}/**/*.parquet"))
        except Exception as e:
            kind = ShardListUnavailable if is_transient(e) else ValueError
            raise kind(f"cannot list hub data set {repo} ({type(e).__name__}: {e}); check the id and your "
                       "network, or download its parquet files and pass the folder") from e
        split_files = [f for f in files if f"/{split}" in f or f"{split}-" in f.rsplit("/", 1)[-1]]
        files = split_files or files
        return [f"hf://{f}" for f in files] or _no_shards(source, split)
    raise FileNotFoundError(f"data source {source!r} is neither a folder, an http(s) URL nor a hub id (owner/name)")


def read_source_json(source, name: str = MANIFEST, *, timeout_s: float = 30.0) -> dict | None:
    """The JSON file ``name`` (``shards.json``, ``demo.json``, ...) next to the shards of a local
    folder or an http(s) base URL; None when the source has no such file, or is generated data or
    a hub id (no files of ours). A source that does not answer, or a file that is not a JSON
    object, is a ValueError naming both."""
    source = str(source)
    if (url := remote_manifest_url(source)) is not None:
        url = url.removesuffix(MANIFEST) + name
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise ValueError(f"cannot read {url} (HTTP {e.code})") from e
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise ValueError(f"cannot read {url} ({e}): is the data source up?") from e
    else:
        path = Path(source) / name
        if not Path(source).is_dir() or not path.is_file():
            return None
        url, text = str(path), path.read_bytes()
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{url} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{url} is not a JSON object")
    return data


def source_splits(source, *, timeout_s: float = 30.0) -> list[str]:
    """The splits of a shard source, by name: from its ``shards.json``, else (a local folder of
    ``{split}-NNNNN.parquet`` files without one) from the file names; [] for generated data
    (``pattern``, ``synthetic``) and hub ids, which record none."""
    if str(source) in ("pattern", "synthetic"):
        return []
    manifest = read_source_json(source, MANIFEST, timeout_s=timeout_s)
    if manifest is not None:
        splits = manifest.get("splits")
        return sorted(k for k, v in splits.items() if v) if isinstance(splits, dict) else []
    path = Path(str(source))
    if str(source).startswith(("http://", "https://")):
        raise ValueError(f"{source} has no {MANIFEST}: serve a shard folder made by `crowdtrain data prepare`")
    if not path.is_dir():
        return []
    return sorted({f.name.rsplit("-", 1)[0] for f in path.glob("*-*.parquet")})


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


def _list_shards_riding_out_outages(source, split: str, config: StreamConfig) -> list[str]:
    """``list_shards``, retried with back-off (1 s doubling to ``config.retry_max_delay_s``) while
    an http(s) source is down or busy, for up to ``config.outage_patience_s``: a volunteer that
    starts while the coordinator restarts waits for it, as a running stream does."""
    start, delay = time.monotonic(), min(1.0, config.retry_max_delay_s)
    while True:
        try:
            return list_shards(source, split, timeout_s=config.http_timeout_s, verified=config.verified)
        except ShardListUnavailable as e:
            down_for = time.monotonic() - start
            if down_for + delay > config.outage_patience_s:
                raise DataSourceUnavailable(
                    f"the data source {source} has not answered for {down_for:.0f} s ({e}); gave up after "
                    f"outage_patience_s = {config.outage_patience_s:.0f} s. If the coordinator is down for "
                    "longer, raise it (crowdtrain join --data-outage-patience-s)") from e
            logger.warning("the data source %s does not answer (%s); retrying in %.0f s", source, e, delay)
            time.sleep(delay)
            delay = min(2 * delay, config.retry_max_delay_s)


def open_stream(source, *, seed_key: str, split: str = "train", config: StreamConfig = StreamConfig()):
    """(rows IterableDataset, stats, shard list): shuffled and filtered, one epoch per iteration."""
    from datasets import IterableDataset

    shards = _list_shards_riding_out_outages(source, split, config)
    stream_id = f"{seed_key}/{split}/{next(_STREAM_IDS)}"
    stats = StreamStats()
    _STREAMS[stream_id] = _Source(stats, config, manifest_url=remote_probe(source),
                                  seed=stable_seed(f"replay/{seed_key}"))
    ds = IterableDataset.from_generator(
        _shard_rows, features=_features(), gen_kwargs={"shards": shards, "stream_id": stream_id})
    if config.shuffle_buffer > 1:
        ds = ds.shuffle(seed=stable_seed(seed_key), buffer_size=config.shuffle_buffer)
    ds = ds.filter(lambda row: keep_row(row, config))
    return ds, stats, shards


class BatchStream:
    """Infinite iterator of model batches ``{"text": (B, text_len), "image": (B, H*W)}`` (LongTensors).

    Each pass over the shards is one epoch, reshuffled with ``set_epoch``. ``stats`` counts rows,
    failed shards and outage retries. Raises ValueError (never loops forever) when a whole epoch
    yields no row, and :class:`DataSourceUnavailable` when an http(s) source stays down longer
    than ``config.outage_patience_s``.
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
