"""``crowdtrain generate``: sample images for prompts, decode, re-rank, write one PNG grid.

As the paper: draw many samples (128) with top-k or top-p sampling, decode the codes with the
image tokenizer, score each against the prompt and keep the best few (4). The tokenizers come
from the checkpoint directory (``text_tokenizer.json``, ``image_tokenizer.safetensors``), or the
shipped shapes ones when it has none. Several prompts (``--prompts FILE``) make one grid with a
row per prompt, labelled with its text on the left.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from crowdtrain.data.config import GenerateConfig
from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

logger = logging.getLogger(__name__)


class TokenizerMismatch(ValueError):
    """The checkpoint's model and the image tokenizer at hand do not fit each other."""


@dataclass
class Generator:
    """A checkpoint's model with its tokenizers, ready to sample."""

    model: object
    meta: dict
    text_tokenizer: object
    image_tokenizer: object
    device: str = "cpu"

    @classmethod
    def from_checkpoint(cls, checkpoint, device: str = "cpu") -> "Generator":
        from crowdtrain.checkpoint import load_checkpoint
        from crowdtrain.data.image_tokenizer import load_image_tokenizer
        from crowdtrain.data.tokenizers import default_image_tokenizer, default_text_tokenizer, load_text_tokenizer

        directory = Path(checkpoint)
        model, meta = load_checkpoint(directory, device=device)
        model.eval()
        text_path, image_path = directory / "text_tokenizer.json", directory / "image_tokenizer.safetensors"
        text_tok = load_text_tokenizer(text_path) if text_path.is_file() else default_text_tokenizer()
        image_tok = load_image_tokenizer(image_path, device=device) if image_path.is_file() \
            else default_image_tokenizer(device)
        cfg = model.config
        if image_tok.grid_size != (cfg.image_height, cfg.image_width) or image_tok.vocab_size != cfg.image_vocab_size:
            raise TokenizerMismatch(
                f"checkpoint {directory}: the model draws a {cfg.image_height}x{cfg.image_width} grid of "
                f"{cfg.image_vocab_size} codes but the image tokenizer has {image_tok.grid_size} and "
                f"{image_tok.vocab_size}; save the run's tokenizer into the checkpoint")
        if text_tok.vocab_size > cfg.text_vocab_size:
            raise ValueError(f"checkpoint {directory}: the text tokenizer ({text_tok.vocab_size} tokens) does not fit "
                             f"model.text_vocab_size={cfg.text_vocab_size}")
        return cls(model, meta, text_tok, image_tok, device)

    def text_ids(self, prompt: str) -> torch.Tensor:
        return self.text_tokenizer.encode_batch([prompt], self.model.config.text_len).to(self.device)

    def sample(self, prompt: str, num: int, *, top_k: int | None = DEFAULT_TOP_K, top_p: float | None = DEFAULT_TOP_P,
               temperature: float = 1.0, seed: int, batch_size: int = 32, progress: bool = False):
        """``num`` samples -> (codes (num, h, w), images (num, H, W, 3) uint8). ``progress``: a
        bar on stderr with the time left, one tick per sample of each finished batch."""
        from tqdm import tqdm

        from crowdtrain.model.sampling import generate_images

        text = self.text_ids(prompt)
        codes = []
        with tqdm(total=num, desc="sampling", unit="img", disable=not progress) as bar:
            for i, start in enumerate(range(0, num, batch_size)):
                n = min(batch_size, num - start)
                codes.append(generate_images(self.model, text.expand(n, -1), temperature=temperature, top_k=top_k,
                                             top_p=top_p, seed=seed * 100_003 + i).cpu())
                bar.update(n)
        codes = torch.cat(codes)
        return codes, self.image_tokenizer.decode(codes)


def make_grid(images: torch.Tensor, *, columns: int | None = None, pad: int = 2):
    """(N, H, W, 3) uint8 -> one PIL image, ``columns`` per row (default: square-ish), white gaps."""
    from PIL import Image

    n, h, w, _ = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    grid = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for i, im in enumerate(images.numpy()):
        r, c = divmod(i, columns)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = im
    return Image.fromarray(grid)


def read_prompts_file(path) -> list[dict]:
    """The prompts of ``--prompts FILE`` as ``[{"prompt", "tag"}]``: one a line; blank lines and
    lines starting with ``#`` are skipped; a line may carry a ``[tag]`` as ``--sample-prompts``
    files do (shown in the row's label). A missing, non-UTF-8 or empty file is a ValueError naming
    it and the fix."""
    from crowdtrain.data.sample_prompts import read_prompt_file

    try:
        return read_prompt_file(path, flag="--prompts", max_prompts=None)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from e


def label_rows(grid, labels: list[str], *, row_height: int, top: int, width: int = 240, pad: int = 6):
    """``grid`` (a PIL image of one row per label, each ``row_height`` px from ``top``) with a white
    column of ``width`` px on its left holding each row's label, wrapped to fit."""
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    try:  # Pillow >= 10.1: its bundled scalable font, sized to the row
        font = ImageFont.load_default(size=max(11, min(18, row_height // 14)))
    except TypeError:
        font = ImageFont.load_default()
    out = Image.new("RGB", (grid.width + width, grid.height), "white")
    out.paste(grid, (width, 0))
    draw = ImageDraw.Draw(out)
    chars = max(8, int((width - 2 * pad) / max(1.0, draw.textlength("abcdefghijklmnopqrstuvwxyz", font=font) / 26)))
    box = font.getbbox("Ag")
    line_h = box[3] - box[1] + 3
    lines_fit = max(1, (row_height - 2 * pad) // line_h)
    for i, label in enumerate(labels):
        lines = textwrap.wrap(label, width=chars) or [""]
        if len(lines) > lines_fit:  # what does not fit ends in "..."
            rest = textwrap.shorten(" ".join(lines[lines_fit - 1:]), width=chars, placeholder="...")
            lines = lines[:lines_fit - 1] + [rest]
        y = top + i * row_height + max(pad, (row_height - len(lines) * line_h) // 2)
        for j, line in enumerate(lines):
            draw.text((pad, y + j * line_h), line, fill=(20, 20, 20), font=font)
    return out


def generate_rows(checkpoint, prompts: list[str], config: GenerateConfig, *, out,
                  labels: bool | list[str] | None = None, device: str = "cpu", scale: int = 4,
                  progress: bool = False, say=None) -> dict:
    """For each prompt, sample ``config.num_samples``, re-rank, and keep the best ``config.keep``;
    write ONE PNG to ``out`` (upscaled ``scale`` x): one row per prompt, in order, each labelled on
    the left (``labels``: True = the prompts, a list = these texts, False = none; default: the
    prompts when there are several). One prompt without a label is the classic grid (up to 4
    columns). ``say``: called with a line saying which re-ranker runs and why, before sampling."""
    from PIL import Image

    from crowdtrain.data.rerank import make_reranker, reranker_reason

    prompts = [p.strip() for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("give a prompt, e.g. crowdtrain generate --checkpoint CKPT \"a small red circle\", or a "
                         "file of prompts with --prompts FILE")
    labels = len(prompts) > 1 if labels is None else labels
    if labels is True:
        labels = list(prompts)
    if labels and len(labels) != len(prompts):
        raise ValueError(f"{len(labels)} labels for {len(prompts)} prompts")
    gen = Generator.from_checkpoint(checkpoint, device=device)
    reranker = make_reranker(config.rerank, model=gen.model, clip_dir=config.clip_dir, device=device)
    reason = reranker_reason(config.rerank, config.clip_dir)
    if say is not None:
        each = f" for each of the {len(prompts)} prompts" if len(prompts) > 1 else ""
        say(f"drawing {config.num_samples} samples{each}, keeping the best {config.keep} by {reranker.name}: {reason}")
    rows, kept = [], []
    for prompt in prompts:
        codes, images = gen.sample(prompt, config.num_samples, top_k=config.top_k, top_p=config.top_p,
                                   temperature=config.temperature, seed=config.seed, batch_size=config.batch_size,
                                   progress=progress)
        scores = reranker.scores(prompt, images, codes, gen.text_ids(prompt))
        order = torch.argsort(scores, descending=True, stable=True)[: config.keep]
        kept.append(images[order])
        rows.append({"prompt": prompt, "scores": [float(scores[i]) for i in order],
                     "indices": [int(i) for i in order]})
    pad = 2
    classic = len(prompts) == 1 and not labels
    grid = make_grid(torch.cat(kept), columns=min(config.keep, 4) if classic else config.keep, pad=pad)
    if scale > 1:
        grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    if labels:
        tile = kept[0].shape[1]
        grid = label_rows(grid, labels, row_height=(tile + pad) * scale, top=pad * scale // 2)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    return {"out": str(out), "reranker": reranker.name, "reason": reason, "rows": rows, "size": list(grid.size)}


def generate_grid(checkpoint, prompt: str, config: GenerateConfig, *, out, device: str = "cpu",
                  scale: int = 4, progress: bool = False, say=None) -> dict:
    """One prompt: :func:`generate_rows` without a label, its row's scores and indices at the top level."""
    if not prompt.strip():
        raise ValueError("give a prompt, e.g. crowdtrain generate --checkpoint CKPT \"a small red circle\"")
    result = generate_rows(checkpoint, [prompt], config, out=out, labels=False, device=device, scale=scale,
                           progress=progress, say=say)
    row = result.pop("rows")[0]
    return {**result, "scores": row["scores"], "indices": row["indices"]}
