"""``crowdtrain generate``: sample images for a prompt, decode, re-rank, write a PNG grid.

As the paper: draw many samples (128) with top-k or top-p sampling, decode the codes with the
image tokenizer, score each against the prompt and keep the best few (4). The tokenizers come
from the checkpoint directory (``text_tokenizer.json``, ``image_tokenizer.safetensors``), or the
shipped shapes ones when it has none.
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


def generate_grid(checkpoint, prompt: str, config: GenerateConfig, *, out, device: str = "cpu",
                  scale: int = 4, progress: bool = False, say=None) -> dict:
    """Sample, re-rank, write the best ``config.keep`` to ``out`` (PNG, upscaled ``scale`` x).
    ``say``: called with a line saying which re-ranker runs and why, before sampling starts."""
    from PIL import Image

    from crowdtrain.data.rerank import make_reranker, reranker_reason

    if not prompt.strip():
        raise ValueError("give a prompt, e.g. crowdtrain generate --checkpoint CKPT \"a small red circle\"")
    gen = Generator.from_checkpoint(checkpoint, device=device)
    reranker = make_reranker(config.rerank, model=gen.model, clip_dir=config.clip_dir, device=device)
    reason = reranker_reason(config.rerank, config.clip_dir)
    if say is not None:
        say(f"drawing {config.num_samples} samples, keeping the best {config.keep} by {reranker.name}: {reason}")
    codes, images = gen.sample(prompt, config.num_samples, top_k=config.top_k, top_p=config.top_p,
                               temperature=config.temperature, seed=config.seed, batch_size=config.batch_size,
                               progress=progress)
    scores = reranker.scores(prompt, images, codes, gen.text_ids(prompt))
    order = torch.argsort(scores, descending=True, stable=True)[: config.keep]
    grid = make_grid(images[order], columns=min(config.keep, 4))
    if scale > 1:
        grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    return {"out": str(out), "reranker": reranker.name, "reason": reason, "scores": [float(scores[i]) for i in order],
            "indices": [int(i) for i in order]}
