"""Image tokenizers: which ones there are, and loading any of them from one file.

The interface (:class:`crowdtrain.data.image_tokenizer_base.ImageTokenizer`): ``encode(images) ->
codes`` of shape (B, H', W') and ``decode(codes) -> images`` as (B, H, W, 3) uint8. Three
implementations, one per ``kind`` in ``KINDS``:

- :class:`SmallVQ` (here): a small VQ-VAE the project trains itself on CPU
  (``crowdtrain tokenizer train``), for data sets with no published tokenizer. The shapes
  tokenizer shipped in ``crowdtrain/assets/`` is one.
- :class:`crowdtrain.data.vqgan.TamingVQGAN`: the taming-transformers VQGAN whose public
  checkpoints the paper used (f=8, 8192 codes); loads their state dicts unchanged.
- :class:`crowdtrain.data.palette_tokenizer.PaletteMaskTokenizer`: a (mask, colour) code per
  patch, for flat-coloured pictures such as the shapes data.

Every tokenizer is ONE file: a ``.safetensors`` whose metadata holds the tokenizer's kind and
config as JSON, so loading never unpickles anything. ``load_image_tokenizer`` also reads a taming
``.ckpt`` directly (with ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from crowdtrain.data.image_tokenizer_base import METADATA_KEY, ImageTokenizer
from crowdtrain.data.palette_tokenizer import PaletteMaskTokenizer
from crowdtrain.data.vqgan import TamingVQGAN

logger = logging.getLogger(__name__)


# ---- the small VQ-VAE ---------------------------------------------------------------------

class _Res(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class SmallVQ(ImageTokenizer):
    """A small convolutional VQ-VAE with a k-means-style codebook, cheap enough to train on CPU.

    Layout: the image is cut into ``patch`` x ``patch`` pixel blocks (pixel-unshuffle, so no
    convolution ever runs at full resolution), then one stride-2 convolution per extra entry of
    ``channels``: f = patch * 2**(len(channels) - 1). The decoder mirrors it and ends in a
    pixel-shuffle. The codebook is updated by exponential moving averages of the encodings
    assigned to each code (no gradient), and codes unused for ``dead_code_steps`` steps are
    restarted on random encodings; both keep most of the codebook alive on tiny data.

    Tuning by symptom: blurry reconstructions or wrong shapes -> more ``channels`` or steps;
    few codes used (the report's ``codes_used``) -> lower ``codebook_dim`` or ``dead_code_steps``.
    """

    kind = "small_vq"

    def __init__(self, *, image_size: int = 64, patch: int = 4, channels: tuple[int, ...] = (32, 64),
                 codebook_size: int = 512, codebook_dim: int = 16, ema_decay: float = 0.95):
        super().__init__()
        self.image_size = image_size
        self.patch = patch
        self.downsample = patch * 2 ** (len(channels) - 1)
        self.vocab_size = codebook_size
        self.channels = tuple(channels)
        self.codebook_dim = codebook_dim
        self.ema_decay = ema_decay
        if image_size % self.downsample:
            raise ValueError(f"image_size {image_size} must be a multiple of the downsampling factor {self.downsample}")
        # Shapes (B = batch, S = image_size): (B, 3, S, S) -> unshuffle (B, 3p^2, S/p, S/p) -> ... -> (B, D, S/f, S/f)
        enc: list[nn.Module] = [nn.PixelUnshuffle(patch), nn.Conv2d(3 * patch * patch, channels[0], 3, padding=1),
                                _Res(channels[0])]
        for prev, ch in zip(channels, channels[1:]):
            enc += [nn.Conv2d(prev, ch, 4, stride=2, padding=1), _Res(ch)]
        enc += [nn.SiLU(), nn.Conv2d(channels[-1], codebook_dim, 1)]
        self.encoder = nn.Sequential(*enc)
        dec: list[nn.Module] = [nn.Conv2d(codebook_dim, channels[-1], 3, padding=1), _Res(channels[-1])]
        for prev, ch in zip(reversed(channels), list(reversed(channels))[1:]):
            dec += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(prev, ch, 3, padding=1), _Res(ch)]
        dec += [nn.SiLU(), nn.Conv2d(channels[0], 3 * patch * patch, 3, padding=1), nn.PixelShuffle(patch)]
        self.decoder = nn.Sequential(*dec)
        self.register_buffer("codebook", torch.randn(codebook_size, codebook_dim) * 0.1)
        self.register_buffer("ema_count", torch.ones(codebook_size))
        self.register_buffer("ema_sum", self.codebook.clone())
        self.register_buffer("steps_unused", torch.zeros(codebook_size, dtype=torch.long))

    def config_dict(self) -> dict:
        return {"image_size": self.image_size, "patch": self.patch, "channels": list(self.channels),
                "codebook_size": self.vocab_size,
                "codebook_dim": self.codebook_dim, "ema_decay": self.ema_decay}

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """(N, D) encodings -> (N,) index of the nearest code."""
        d = z.pow(2).sum(1, keepdim=True) - 2 * z @ self.codebook.t() + self.codebook.pow(2).sum(1)[None]
        return d.argmin(1)

    def encode_float(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encoder(x)  # (B, D, h, w)
        b, d, h, w = z.shape
        return self.nearest(z.permute(0, 2, 3, 1).reshape(-1, d)).view(b, h, w)

    def decode_float(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.codebook[codes].permute(0, 3, 1, 2))

    def forward(self, x: torch.Tensor, *, generator: torch.Generator | None = None, dead_code_steps: int = 50):
        """Training step body: (B, 3, H, W) in [-1, 1] -> (reconstruction, commitment loss, codes).

        In training mode also updates the codebook (EMA) and restarts dead codes.
        """
        z = self.encoder(x)
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        idx = self.nearest(flat.detach())
        if self.training:
            self._update_codebook(flat.detach(), idx, generator, dead_code_steps)
        q = self.codebook[idx]
        commit = F.mse_loss(flat, q)
        q = flat + (q - flat).detach()  # straight-through
        recon = self.decoder(q.view(b, h, w, d).permute(0, 3, 1, 2))
        return recon, commit, idx.view(b, h, w)

    @torch.no_grad()
    def _update_codebook(self, flat, idx, generator, dead_code_steps: int) -> None:
        onehot = F.one_hot(idx, self.vocab_size).type_as(flat)  # (N, K)
        count = onehot.sum(0)
        decay = self.ema_decay
        self.ema_count.mul_(decay).add_(count, alpha=1 - decay)
        self.ema_sum.mul_(decay).add_(onehot.t() @ flat, alpha=1 - decay)
        n = self.ema_count.sum()
        smoothed = (self.ema_count + 1e-5) / (n + self.vocab_size * 1e-5) * n
        self.codebook.copy_(self.ema_sum / smoothed[:, None])
        self.steps_unused.add_(1).masked_fill_(count > 0, 0)
        dead = (self.steps_unused >= dead_code_steps).nonzero().flatten()
        if len(dead):
            pick = torch.randint(len(flat), (len(dead),), generator=generator)
            self.codebook[dead] = flat[pick]
            self.ema_sum[dead] = flat[pick]
            self.ema_count[dead] = 1.0
            self.steps_unused[dead] = 0


KINDS: dict[str, type[ImageTokenizer]] = {cls.kind: cls for cls in (SmallVQ, TamingVQGAN, PaletteMaskTokenizer)}


def load_image_tokenizer(path, *, device: str | torch.device = "cpu", trust_checkpoint: bool = False) -> ImageTokenizer:
    """Load an image tokenizer from one file.

    - ``.safetensors`` written by :meth:`ImageTokenizer.save` (any kind);
    - a taming-transformers ``.ckpt`` (or a ``.pt`` holding its ``state_dict``): read with
      ``torch.load(weights_only=True)``. Some Lightning checkpoints pickle extra objects and are
      refused; convert such a file once where you trust it with
      ``crowdtrain tokenizer convert --taming FILE.ckpt --out FILE.safetensors --trust-checkpoint``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image tokenizer {path} does not exist; train one with `crowdtrain tokenizer "
                                "train` or see docs/data.md for the taming VQGAN checkpoints")
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = (f.metadata() or {}).get(METADATA_KEY)
        if meta is None:
            raise ValueError(f"{path} has no '{METADATA_KEY}' metadata: it is not a crowdtrain image tokenizer "
                             "(convert a taming checkpoint with `crowdtrain tokenizer convert`)")
        meta = json.loads(meta)
        if meta["kind"] not in KINDS:
            raise ValueError(f"{path}: unknown image tokenizer kind {meta['kind']!r}")
        model = KINDS[meta["kind"]](**meta["config"])
        state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
        model.load_state_dict(state)
        model.report = meta.get("report", {})
        model.source_path = str(path)
        return model.to(device).eval()
    if path.suffix in (".ckpt", ".pt", ".pth", ".bin"):
        model = TamingVQGAN.from_checkpoint(path, trust_checkpoint=trust_checkpoint)
        model.source_path = str(path)
        return model.to(device).eval()
    raise ValueError(f"{path}: expected a .safetensors image tokenizer or a taming .ckpt")


def tokenizer_digest(tokenizer: ImageTokenizer) -> str:
    """A short hash of a tokenizer's config and weights: shards record it, so a resumed
    `data prepare` refuses to mix codes from two tokenizers."""
    import hashlib

    h = hashlib.sha256(json.dumps({"kind": tokenizer.kind, "config": tokenizer.config_dict()}, sort_keys=True).encode())
    for k, v in sorted(tokenizer.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes() if v.is_floating_point() else v.cpu().numpy().tobytes())
    return h.hexdigest()[:16]
