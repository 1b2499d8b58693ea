"""Re-rankers: score sampled images against their prompt, keep the best.

- ``clip``: as the paper (CLIP ViT-B/32 keeps the best 4 of 128): cosine similarity of CLIP's
  text and image embeddings, through ``transformers``' CLIP implementation, loaded from a local
  directory (``CLIPModel.save_pretrained`` layout: ``config.json``, weights, ``tokenizer.json``).
- ``likelihood``: needs no weights. The score of a sample is the mean log-probability the
  transformer itself gives its codes given the prompt (one teacher-forced forward pass, no
  top-k/top-p filtering). It prefers samples the model is sure fit the prompt and rejects the
  ones where sampling drifted into low-probability codes (a stray blob, a half-drawn shape),
  the most common failure of a small model. It also slightly prefers simple images, which CLIP
  does not; use CLIP when you have the weights.
- ``none``: keep the first samples.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

# OpenAI CLIP's normalisation, used when the directory has no preprocessor_config.json.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class Reranker:
    name = "base"

    def scores(self, prompt: str, images: torch.Tensor, codes: torch.Tensor, text_ids: torch.Tensor) -> torch.Tensor:
        """(N,) scores, higher is better, for ``images`` (N, H, W, 3) uint8 with ``codes`` (N, h, w)."""
        raise NotImplementedError


class NoReranker(Reranker):
    name = "none"

    def scores(self, prompt, images, codes, text_ids):
        return -torch.arange(len(images), dtype=torch.float)  # keeps sampling order


class LikelihoodReranker(Reranker):
    name = "likelihood"

    def __init__(self, model, *, batch_size: int = 32):
        self.model, self.batch_size = model, batch_size

    @torch.no_grad()
    def scores(self, prompt, images, codes, text_ids):
        self.model.eval()
        device = next(self.model.parameters()).device
        out = []
        flat = codes.reshape(len(codes), -1).to(device)
        for i in range(0, len(flat), self.batch_size):
            c = flat[i: i + self.batch_size]
            t = text_ids.to(device).expand(len(c), -1)
            logits = self.model(t, c, return_logits=True).image_logits.float()  # (B, N, V)
            logp = logits.log_softmax(-1).gather(-1, c[..., None]).squeeze(-1)
            out.append(logp.mean(-1).cpu())
        return torch.cat(out)


class ClipReranker(Reranker):
    name = "clip"

    def __init__(self, directory, *, device: str = "cpu", batch_size: int = 32):
        from transformers import AutoTokenizer, CLIPModel

        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"--clip {directory} is not a transformers CLIP model directory (no config.json); "
                                    "see docs/data.md for how to get openai/clip-vit-base-patch32")
        self.model = CLIPModel.from_pretrained(str(directory)).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.size = self.model.config.vision_config.image_size
        mean, std = CLIP_MEAN, CLIP_STD
        pre = directory / "preprocessor_config.json"
        if pre.is_file():
            cfg = json.loads(pre.read_text())
            mean, std = cfg.get("image_mean", mean), cfg.get("image_std", std)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)
        self.device, self.batch_size = device, batch_size

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        from PIL import Image

        resized = [np.asarray(Image.fromarray(im.numpy()).resize((self.size, self.size), Image.BICUBIC))
                   for im in images]
        x = torch.from_numpy(np.stack(resized)).permute(0, 3, 1, 2).float() / 255
        return ((x - self.mean) / self.std).to(self.device)

    @staticmethod
    def _tensor(out) -> torch.Tensor:
        # transformers versions differ: a tensor, or an output object carrying the pooled embedding.
        if isinstance(out, torch.Tensor):
            return out
        for attr in ("text_embeds", "image_embeds", "pooler_output"):
            if getattr(out, attr, None) is not None:
                return getattr(out, attr)
        raise TypeError(f"unexpected CLIP output {type(out).__name__}")

    @torch.no_grad()
    def scores(self, prompt, images, codes, text_ids):
        tok = self.tokenizer([prompt], padding=True, truncation=True,
                             max_length=self.model.config.text_config.max_position_embeddings, return_tensors="pt")
        text = self._tensor(self.model.get_text_features(**{k: v.to(self.device) for k, v in tok.items()}))
        text = torch.nn.functional.normalize(text.float(), dim=-1)
        out = []
        for i in range(0, len(images), self.batch_size):
            emb = self._tensor(self.model.get_image_features(pixel_values=self._pixels(images[i: i + self.batch_size])))
            out.append((torch.nn.functional.normalize(emb.float(), dim=-1) @ text.t()).squeeze(-1).cpu())
        return torch.cat(out)


def reranker_reason(kind: str, clip_dir: str | None) -> str:
    """Why ``make_reranker(kind, clip_dir=...)`` picks what it picks, in words for the user."""
    if kind == "none":
        return "--rerank none: the first samples drawn, as the model makes them"
    if kind == "clip" or (kind == "auto" and clip_dir):
        return f"CLIP ({clip_dir}) scores how well each image matches the prompt, as the paper did"
    likelihood = ("the model's own likelihood of each sample, which favours flat, simple images early in "
                  "training; --rerank none shows raw samples, --clip DIR ranks by CLIP")
    return ("no --clip DIR given, so " if kind == "auto" else "--rerank likelihood: ") + likelihood


def make_reranker(kind: str, *, model=None, clip_dir: str | None = None, device: str = "cpu") -> Reranker:
    """``auto`` = ``clip`` when ``clip_dir`` is given, else ``likelihood``."""
    if kind == "auto":
        kind = "clip" if clip_dir else "likelihood"
    if kind == "clip":
        if not clip_dir:
            raise ValueError("the clip re-ranker needs --clip DIR (a local transformers CLIP model directory)")
        return ClipReranker(clip_dir, device=device)
    if kind == "likelihood":
        return LikelihoodReranker(model)
    if kind == "none":
        return NoReranker()
    raise ValueError(f"unknown re-ranker {kind!r}; choose auto, clip, likelihood or none")
