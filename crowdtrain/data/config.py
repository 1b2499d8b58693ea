"""Typed configs of the data subsystem (torch-free, so the CLI can show defaults quickly)."""

from __future__ import annotations

from dataclasses import dataclass

from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P


@dataclass(frozen=True)
class VQTrainConfig:
    """Training of the small VQ image tokenizer. Defaults train the shipped shapes tokenizer
    (about 3 minutes on 2 idle CPU cores).

    If reconstructions lose shapes (low ``shapes_agreement`` in the report), raise ``steps``
    first, then ``channels``; CPU time grows about linearly with both.
    """

    image_size: int = 64
    patch: int = 4
    channels: tuple[int, ...] = (48, 96)
    codebook_size: int = 512
    codebook_dim: int = 16
    steps: int = 2500
    batch_size: int = 32
    lr: float = 2e-3
    commitment: float = 0.25
    dead_code_steps: int = 50
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("--steps and --batch-size must be positive")
        if not 2 <= self.codebook_size <= 32767:
            raise ValueError("shards store codes as int16: --codebook-size must be in [2, 32767]")


@dataclass(frozen=True)
class StreamConfig:
    """How a peer streams shards.

    ``shuffle_buffer``: rows held in memory for shuffling; if consecutive batches look alike
    (loss oscillates with the shard boundaries), raise it. ``http_timeout_s``: one request to a
    shard server waits at most this long, never a hang.

    Riding out an outage of an http(s) source (the coordinator restarting, a network cut): a
    shard fetch that fails transiently (connection refused or reset, timeout, HTTP 5xx/408/429)
    while the source's manifest does not answer either is retried with back-off (1 s, doubling,
    at most ``retry_max_delay_s``); meanwhile the peer trains on the last ``replay_rows`` rows it
    read, so it keeps stepping and averaging. A retry is one HEAD of the manifest (and the shard's
    GET once it answers): 10 s between retries costs the server about 100 small requests a second
    for 1,000 volunteers, during an outage only; raise it for a larger swarm behind a small server.
    A peer retries only when its shuffle buffer asks for rows (``datasets`` refills half of it at a
    time: 1,024 rows), so a slow one resumes later than its back-off says; a smaller buffer reads
    in smaller, more frequent pieces (``crowdtrain join --shuffle-buffer``). After
    ``outage_patience_s`` without an answer the stream stops with an error naming the source. If
    volunteers leave during planned maintenance, raise ``outage_patience_s`` (``crowdtrain join
    --data-outage-patience-s``); if a peer's memory is tight, lower ``replay_rows`` (a row is about
    2 bytes per image code plus its caption: ~2 KB at the paper's 32x32 grid, so 20 MB for 10,000
    rows). A shard that fails while the source answers (corrupt, truncated, 4xx, or a 5xx on that
    file only) is skipped for the epoch, logged once and counted.
    """

    shuffle_buffer: int = 2048
    http_timeout_s: float = 30.0
    outage_patience_s: float = 600.0
    retry_max_delay_s: float = 10.0
    replay_rows: int = 10_000
    min_caption_chars: int = 3  # the paper drops captions shorter than this
    max_aspect_ratio: float = 2.0  # ... and images more elongated than this
    safe_value: str = "UNLIKELY"  # LAION's NSFW column: only rows flagged UNLIKELY are kept
    # {URL: sha256} of an http(s) source's files as its coordinator signed them
    # (crowdtrain.runspec.trust): each shard is then fetched whole and checked before a row of it is
    # read, the shard list too, and a file that differs (or is not listed) stops the stream with
    # its name. None: files are read by byte ranges, unchecked (a local folder, a hub data set).
    verified: dict | None = None

    def __post_init__(self):
        if self.shuffle_buffer < 1:
            raise ValueError("shuffle_buffer must be >= 1 (1 disables shuffling within shards)")
        if self.http_timeout_s <= 0:
            raise ValueError("http_timeout_s must be positive")
        if self.outage_patience_s < 0:
            raise ValueError("outage_patience_s must be >= 0 (0: give up at the first failed retry)")
        if self.retry_max_delay_s <= 0:
            raise ValueError("retry_max_delay_s must be positive")
        if self.replay_rows < 0:
            raise ValueError("replay_rows must be >= 0 (0: stall instead of replaying rows during an outage)")


@dataclass(frozen=True)
class GenerateConfig:
    """Sampling and re-ranking for ``crowdtrain generate`` (defaults as the paper: best 4 of 128,
    one filter, ``DEFAULT_TOP_K`` / ``DEFAULT_TOP_P``; see ``crowdtrain.model.config.sampling_filters``)."""

    num_samples: int = 128
    keep: int = 4
    top_k: int | None = DEFAULT_TOP_K
    top_p: float | None = DEFAULT_TOP_P
    temperature: float = 1.0
    seed: int = 0
    batch_size: int = 32
    rerank: str = "auto"  # auto | clip | likelihood | none
    clip_dir: str | None = None

    def __post_init__(self):
        if not 1 <= self.keep <= self.num_samples:
            raise ValueError(f"--keep must be between 1 and --num-samples ({self.num_samples}), got {self.keep}")
        if self.rerank not in ("auto", "clip", "likelihood", "none"):
            raise ValueError(f"--rerank must be auto, clip, likelihood or none, got {self.rerank!r}")
        if self.rerank == "clip" and not self.clip_dir:
            raise ValueError("--rerank clip needs --clip DIR, a local transformers CLIP model directory "
                             "(see docs/data.md for where to get ViT-B/32)")
