"""A factorised image tokenizer for flat-coloured pictures: each patch is a (mask, colour) pair.

Why: a learned VQ code stands for a *coloured piece of a shape* ("the red top of a circle"). A
colour-shape pair held out of training then needs codes the model was never trained to emit (the
red tip of a triangle), and maximum likelihood pushes every such code down: the model draws the
right colour on a shape it has seen in that colour (measured on the shapes data, 30-minute demo:
right colour on another shape in 75% of held-out images, both right in 7%). Here a code is
``mask * n_colours + colour``: which pixels of the patch are foreground (one of ``n_masks`` learned
masks, mask 0 empty) and their colour (one of the palette's). With
``ModelConfig.image_code_factors = (n_masks, n_colours)`` the model's tied embedding of a code is
the sum of a mask embedding and a colour embedding, so its logit is a mask score plus a colour
score: the tip of a triangle (seen in other colours) and red (seen on other shapes) are each
trained, and so is their sum.

It is exact on pictures drawn from a palette with at most one foreground colour per patch (the
shapes data: every pixel is a palette colour, no patch holds two objects); others are coded to the
nearest palette colour and the nearest mask (Hamming distance). It fits the shapes data set and
its like; photographs need a VQGAN (``crowdtrain.data.vqgan``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from crowdtrain.data.image_tokenizer_base import ImageTokenizer


class PaletteMaskTokenizer(ImageTokenizer):
    kind = "palette_mask"

    def __init__(self, *, image_size: int = 64, patch: int = 8, palette: list | tuple = ((0, 0, 0),),
                 background: list | tuple = (255, 255, 255), n_masks: int = 256):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch}")
        self.image_size, self.downsample, self.patch = image_size, patch, patch
        self.palette = [tuple(int(v) for v in c) for c in palette]
        self.background = tuple(int(v) for v in background)
        self.n_masks, self.n_colours = n_masks, len(self.palette)
        self.vocab_size = n_masks * self.n_colours
        # (n_masks, patch * patch) booleans; mask 0 is the empty patch. Unfitted rows stay empty.
        self.register_buffer("masks", torch.zeros(n_masks, patch * patch, dtype=torch.uint8))

    @property
    def factors(self) -> tuple[int, int]:
        """(n_masks, n_colours): code = mask * n_colours + colour (``ModelConfig.image_code_factors``)."""
        return self.n_masks, self.n_colours

    def config_dict(self) -> dict:
        return {"image_size": self.image_size, "patch": self.patch, "palette": [list(c) for c in self.palette],
                "background": list(self.background), "n_masks": self.n_masks}

    # ---- pixels <-> (mask, colour) per patch --------------------------------------------------
    def _patches(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, H, W, 3) uint8 -> per patch the foreground colour (B, h, w) and mask (B, h, w, p*p)."""
        b, p = images.shape[0], self.patch
        colours = np.array(self.palette + [self.background], dtype=np.int32)
        dist = ((images[..., None, :].astype(np.int32) - colours) ** 2).sum(-1)
        labels = dist.argmin(-1)  # (B, H, W); len(palette) = background
        g = self.image_size // p
        labels = labels.reshape(b, g, p, g, p).transpose(0, 1, 3, 2, 4).reshape(b, g, g, p * p)
        counts = np.stack([(labels == c).sum(-1) for c in range(self.n_colours)], axis=-1)  # (B, g, g, C)
        colour = counts.argmax(-1)
        mask = (labels == colour[..., None]) & (counts.max(-1, keepdims=True) > 0)
        return colour, mask.astype(np.uint8)

    def fit(self, images: np.ndarray) -> dict:
        """Learn the masks: the ``n_masks - 1`` most frequent non-empty patch masks in ``images``.
        Returns the share of patches whose mask is kept exactly."""
        _, masks = self._patches(np.asarray(images, dtype=np.uint8))
        flat = masks.reshape(-1, self.patch * self.patch)
        counts = Counter(row.tobytes() for row in flat if row.any())
        common = counts.most_common(self.n_masks - 1)
        kept = [np.frombuffer(k, dtype=np.uint8) for k, _ in common]
        table = np.zeros((self.n_masks, self.patch * self.patch), dtype=np.uint8)
        if kept:
            table[1:1 + len(kept)] = np.stack(kept)
        self.masks.copy_(torch.from_numpy(table))
        exact = sum(n for _, n in common) + int((~flat.any(1)).sum())
        return {"distinct_masks": len(counts), "masks_kept": len(kept), "exact_patch_share": exact / len(flat)}

    def encode_uint8(self, images: np.ndarray) -> torch.Tensor:
        colour, mask = self._patches(np.asarray(images, dtype=np.uint8))
        table = self.masks.cpu().numpy().astype(np.int32)
        flat = mask.reshape(-1, self.patch * self.patch).astype(np.int32)
        # Hamming distance to every mask: |a - b| summed, as a @ (1 - b) + (1 - a) @ b.
        hamming = flat @ (1 - table).T + (1 - flat) @ table.T
        nearest = hamming.argmin(-1).reshape(colour.shape)
        codes = np.where(nearest == 0, 0, nearest * self.n_colours + colour)
        return torch.from_numpy(codes.astype(np.int64))

    def decode_uint8(self, codes: torch.Tensor) -> np.ndarray:
        codes = codes.detach().cpu().numpy().astype(np.int64)
        b, g, p = codes.shape[0], codes.shape[1], self.patch
        mask = self.masks.cpu().numpy()[codes // self.n_colours].astype(bool)  # (B, g, g, p*p)
        rgb = np.array(self.palette, dtype=np.uint8)[codes % self.n_colours]  # (B, g, g, 3)
        out = np.where(mask[..., None], rgb[:, :, :, None, :], np.array(self.background, dtype=np.uint8))
        return out.reshape(b, g, g, p, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * p, g * p, 3)

    def _device(self) -> torch.device:
        return self.masks.device  # no parameters: nothing is learned by gradient

    # ---- the ImageTokenizer interface (floats in [-1, 1], channels first) ------------------
    def encode_float(self, x: torch.Tensor) -> torch.Tensor:
        images = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return self.encode_uint8(images).to(x.device)

    def decode_float(self, codes: torch.Tensor) -> torch.Tensor:
        images = torch.from_numpy(self.decode_uint8(codes)).to(codes.device)
        return images.permute(0, 3, 1, 2).float() / 127.5 - 1


def fit_shapes_palette_tokenizer(num_images: int = 4000, seed: int = 0) -> tuple[PaletteMaskTokenizer, dict]:
    """The tokenizer for the bundled shapes data: its palette, masks fitted on ``num_images``
    training pictures (every colour-shape pair's masks occur in other colours too)."""
    from crowdtrain.data import shapes

    tok = PaletteMaskTokenizer(image_size=shapes.IMAGE_SIZE, patch=8, palette=list(shapes.COLORS.values()),
                               background=shapes.BACKGROUNDS["white"], n_masks=256)
    images = np.stack([img for img, _, _ in shapes.generate_samples(num_images, seed=seed + 1000)])
    report = tok.fit(images)
    return tok, report
