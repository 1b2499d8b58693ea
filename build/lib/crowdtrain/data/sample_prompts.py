"""The prompts a run draws sample images for: on ``/samples``, in each checkpoint's sample folder,
and in ``crowdtrain demo``'s grid.

Where they come from (``crowdtrain coordinator``):

- ``--sample-prompts FILE``: one prompt a line, optionally tagged (``[tag] prompt``); blank lines
  and lines starting with ``#`` are skipped. A tag is any short label the organizer wants shown
  next to the images, e.g. ``[held-out]`` for a composition kept out of the training data.
- the bundled shapes data: three seen and three held-out evaluation prompts, tagged so
  (the run knows which compositions it left out);
- any other shard data: the first few captions of the valid split (the train split when there is
  none), each drawn next to its real image, untagged: the run cannot know what they hold.

This module reads no torch, so the coordinator's process can use it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_PROMPTS = 16  # each is drawn at every sampled checkpoint: a few seconds per prompt on a CPU
MAX_PROMPT_CHARS = 300
MAX_TAG_CHARS = 24
DEFAULT_FROM_DATA = 6
RUN_FILE = "sample_prompts.json"  # the run folder's copy, for the pages and the demo
_TAGGED = re.compile(r"\[([^\[\]]*)\]\s*(.*)")


def read_prompt_file(path, *, flag: str = "--sample-prompts", max_prompts: int | None = MAX_PROMPTS) -> list[dict]:
    """``[{"prompt", "tag"}]`` from a prompts file, or a ValueError naming ``flag``, the line and the
    fix (``crowdtrain generate --prompts`` reads the same format, with no limit on the count)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file; write one prompt a line, e.g. "
                                "'a red apple on a table' or '[held-out] a blue apple on a table'")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({e}); save it as UTF-8") from e
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tag = None
        if line.startswith("["):
            match = _TAGGED.fullmatch(line)
            if match is None:
                raise ValueError(f"{flag} {path}, line {number}: {line[:60]!r} opens a tag with '[' "
                                 "but does not close it; write '[tag] prompt'")
            tag, line = match.group(1).strip() or None, match.group(2).strip()
            if tag is not None and len(tag) > MAX_TAG_CHARS:
                raise ValueError(f"{flag} {path}, line {number}: the tag {tag[:40]!r} is longer than "
                                 f"{MAX_TAG_CHARS} characters; tags are short labels such as 'held-out'")
        if not line:
            raise ValueError(f"{flag} {path}, line {number}: a tag with no prompt after it")
        if len(line) > MAX_PROMPT_CHARS:
            raise ValueError(f"{flag} {path}, line {number}: the prompt has {len(line)} characters, more "
                             f"than {MAX_PROMPT_CHARS}; the model reads only its first text_len tokens anyway")
        prompts.append({"prompt": line, "tag": tag})
    if not prompts:
        raise ValueError(f"{flag} {path} holds no prompt (only blank lines or # comments); "
                         "write one prompt a line")
    if max_prompts is not None and len(prompts) > max_prompts:
        raise ValueError(f"{flag} {path} holds {len(prompts)} prompts; at most {max_prompts} are drawn "
                         "at each checkpoint: keep the ones that show the most")
    return prompts


def shapes_prompts(per_group: int = 3) -> list[dict]:
    """The shapes data's evaluation prompts: ``per_group`` seen, then as many held-out."""
    from crowdtrain.data.shapes import EVAL_PROMPTS

    return ([{"prompt": p, "tag": "seen"} for p in EVAL_PROMPTS["seen"][:per_group]]
            + [{"prompt": p, "tag": "held-out"} for p in EVAL_PROMPTS["heldout"][:per_group]])


def data_prompts(source, *, n: int = DEFAULT_FROM_DATA, timeout_s: float = 30.0) -> list[dict]:
    """The first ``n`` usable captions of ``source``'s valid split (else its train split), each
    with ``reference``: the codes of its real image, for drawing next to the samples."""
    import pyarrow.parquet as pq

    from crowdtrain.data.config import StreamConfig
    from crowdtrain.data.shards import bytes_to_codes
    from crowdtrain.data.streaming import keep_row, list_shards, open_shard

    errors = []
    for split in ("valid", "train"):
        try:
            shards = list_shards(str(source), split, timeout_s=timeout_s)
        except (ValueError, OSError) as e:
            errors.append(f"{split}: {e}")
            continue
        if split == "valid" and not any("valid" in shard for shard in shards):
            continue  # a folder without a manifest lists every parquet file for any split
        prompts, seen = [], set()
        for shard in shards[:4]:
            with open_shard(shard, timeout_s=timeout_s) as f:
                # The first rows only: a shard of a big data set may hold hundreds of MB.
                batch = next(pq.ParquetFile(f).iter_batches(batch_size=500, columns=["caption", "code", "NSFW"]),
                             None)
            for row in batch.to_pylist() if batch is not None else []:
                caption = (row.get("caption") or "").strip()
                if not caption or caption in seen or len(caption) > MAX_PROMPT_CHARS or not row.get("code") \
                        or not keep_row(row, StreamConfig()):
                    continue
                seen.add(caption)
                prompts.append({"prompt": caption, "tag": None, "split": split,
                                "reference": bytes_to_codes(row["code"]).tolist()})
                if len(prompts) == n:
                    return prompts
        if prompts:
            return prompts
    raise ValueError(f"no captions to draw samples for in {source} ({'; '.join(errors) or 'no usable rows'}); "
                     "pass --sample-prompts FILE")


def reference_codes(codes, config):
    """A sample prompt's real image as (1, H, W) codes for a model of ``config``; None when it
    has none or they do not fit the model (they come from the run's data: a stranger's file)."""
    import torch

    if codes is None:
        return None
    try:
        t = torch.as_tensor(codes, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        return None
    if t.numel() != config.image_len or t.min() < 0 or t.max() >= config.image_vocab_size:
        return None
    return t.view(1, config.image_height, config.image_width)


def load_run_prompts(run_dir) -> list[dict] | None:
    """The prompts the coordinator chose for the run in ``run_dir`` (None: not recorded)."""
    try:
        prompts = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return prompts if isinstance(prompts, list) else None
