"""The interface every image tokenizer implements, and its file format.

An image tokenizer turns pictures into grids of integer codes and back: ``encode(images) ->
codes`` of shape (B, H', W') and ``decode(codes) -> images`` as (B, H, W, 3) uint8. A concrete
tokenizer subclasses :class:`ImageTokenizer` and sets a ``kind``; the loader
(``crowdtrain.data.image_tokenizer.load_image_tokenizer``) maps kinds to classes. The concrete
tokenizers import this module and the loader imports them, never the other way round.

Every tokenizer is ONE file: a ``.safetensors`` whose metadata (under ``METADATA_KEY``) holds the
tokenizer's kind and config as JSON, so loading never unpickles anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

METADATA_KEY = "crowdtrain_image_tokenizer"


class ImageTokenizer(nn.Module):
    """Base class. Subclasses set ``image_size`` (pixels, square), ``downsample`` (f) and
    ``vocab_size`` and implement ``encode_float`` / ``decode_float`` on [-1, 1] images."""

    kind = "base"
    image_size: int
    downsample: int
    vocab_size: int

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.image_size // self.downsample, self.image_size // self.downsample

    def config_dict(self) -> dict:
        raise NotImplementedError

    def encode_float(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) floats in [-1, 1] -> (B, H/f, W/f) long codes."""
        raise NotImplementedError

    def decode_float(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, h, w) long codes -> (B, 3, h*f, w*f) floats, roughly in [-1, 1]."""
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, images) -> torch.Tensor:
        """Images (a (B, H, W, 3) uint8 array/tensor, or a list of PIL images / arrays) -> (B, H', W') codes."""
        self.eval()
        return self.encode_float(images_to_float(images).to(self._device()))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, H', W') codes -> (B, H, W, 3) uint8 images."""
        self.eval()
        codes = torch.as_tensor(codes, dtype=torch.long, device=self._device())
        if codes.dim() == 2:  # (B, H'*W') raster order, as the model and shards store them
            h, w = self.grid_size
            codes = codes.view(-1, h, w)
        if codes.min() < 0 or codes.max() >= self.vocab_size:
            raise ValueError(f"codes must lie in [0, {self.vocab_size}), got [{int(codes.min())}, {int(codes.max())}]")
        return float_to_images(self.decode_float(codes))

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def save(self, path, *, report: dict | None = None, half: bool = False) -> Path:
        """Write the tokenizer as one ``.safetensors`` file (config in the metadata)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: (v.half() if half and v.is_floating_point() else v).contiguous().cpu()
                 for k, v in self.state_dict().items()}
        meta = {"kind": self.kind, "config": self.config_dict(), "report": report or {}}
        save_file(state, str(path), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
        return path


def images_to_float(images) -> torch.Tensor:
    """Accepts (B, H, W, 3) uint8 or a list of PIL images / (H, W, 3) arrays -> (B, 3, H, W) in [-1, 1]."""
    if isinstance(images, (list, tuple)):
        images = np.stack([np.asarray(im.convert("RGB") if hasattr(im, "convert") else im) for im in images])
    t = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.array(images, dtype=np.uint8))
    if t.dim() != 4 or t.shape[-1] != 3:
        raise ValueError(f"images must be (batch, height, width, 3) uint8, got shape {tuple(t.shape)}")
    return t.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def float_to_images(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
