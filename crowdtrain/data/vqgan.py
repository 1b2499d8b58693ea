"""The taming-transformers VQGAN, written so its public checkpoints load unchanged.

The paper encoded LAION images with taming's f=8, 8192-code VQGAN (the Gumbel-quantizer
variant, ``vqgan_gumbel_f8_8192``). This module re-implements the architecture with the same
parameter names (``encoder.down.0.block.0.norm1.weight``, ``quantize.embed.weight``, ...), so a
checkpoint's ``state_dict`` loads with ``strict=True`` once the training-only ``loss.*``
entries (discriminator, LPIPS) are dropped. Both quantizers are supported:

- Gumbel (``quantize.proj`` + ``quantize.embed``): the code of a cell is the argmax of the
  projection's logits (taming samples Gumbel noise even in eval mode; argmax makes encoding
  deterministic, as other re-implementations do);
- plain VQ (``quantize.embedding``): the nearest codebook vector.

The shape of the network (channels, levels, attention levels, code dimension) is read from
the state dict itself, so no YAML config is needed. Images are in [-1, 1], as taming's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from crowdtrain.data.image_tokenizer_base import ImageTokenizer

logger = logging.getLogger(__name__)


def _norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, ch, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if self.nin_shortcut is not None else x) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all cells, with 1x1 convolutions for q, k, v and output."""

    def __init__(self, ch: int):
        super().__init__()
        self.norm = _norm(ch)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(ch, ch, 1) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (m(y).reshape(b, c, h * w).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, HW, C)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class Downsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # taming pads right/bottom only


class Upsample(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ResnetBlocks), ``attn`` (maybe empty), then down/upsample."""

    def __init__(self, blocks: list[nn.Module], attn: list[nn.Module]):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attn)

    def run(self, h):
        for i, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[i](h)
        return h


class _Mid(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.block_1 = ResnetBlock(ch, ch)
        self.attn_1 = AttnBlock(ch)
        self.block_2 = ResnetBlock(ch, ch)

    def forward(self, h):
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    def __init__(self, *, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, attn_levels: tuple[int, ...],
                 z_channels: int, double_z: bool, in_channels: int = 3):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        for i, mult in enumerate(ch_mult):
            cin, cout = ch * in_mult[i], ch * mult
            blocks = [ResnetBlock(cin if j == 0 else cout, cout) for j in range(num_res_blocks)]
            level = _Level(blocks, [AttnBlock(cout) for _ in blocks] if i in attn_levels else [])
            if i != len(ch_mult) - 1:
                level.downsample = Downsample(cout)
            self.down.append(level)
        top = ch * ch_mult[-1]
        self.mid = _Mid(top)
        self.norm_out = _norm(top)
        self.conv_out = nn.Conv2d(top, 2 * z_channels if double_z else z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = level.run(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, *, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, attn_levels: tuple[int, ...],
                 z_channels: int, out_ch: int = 3):
        super().__init__()
        cin = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, cin, 3, padding=1)
        self.mid = _Mid(cin)
        levels: list[_Level] = []
        for i in reversed(range(len(ch_mult))):
            cout = ch * ch_mult[i]
            blocks = [ResnetBlock(cin if j == 0 else cout, cout) for j in range(num_res_blocks + 1)]
            level = _Level(blocks, [AttnBlock(cout) for _ in blocks] if i in attn_levels else [])
            if i != 0:
                level.upsample = Upsample(cout)
            levels.insert(0, level)  # stored low-to-high index as taming's `up`, run from the top
            cin = cout
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(cin)
        self.conv_out = nn.Conv2d(cin, out_ch, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level.run(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class GumbelQuantize(nn.Module):
    def __init__(self, num_hiddens: int, embed_dim: int, n_embed: int):
        super().__init__()
        self.proj = nn.Conv2d(num_hiddens, n_embed, 1)
        self.embed = nn.Embedding(n_embed, embed_dim)

    def codes(self, h):
        return self.proj(h).argmax(dim=1)

    def lookup(self, codes):
        return self.embed(codes).permute(0, 3, 1, 2)


class VectorQuantize(nn.Module):
    def __init__(self, embed_dim: int, n_embed: int):
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)

    def codes(self, h):
        b, d, hh, ww = h.shape
        z = h.permute(0, 2, 3, 1).reshape(-1, d)
        w = self.embedding.weight
        dist = z.pow(2).sum(1, keepdim=True) - 2 * z @ w.t() + w.pow(2).sum(1)[None]
        return dist.argmin(1).view(b, hh, ww)

    def lookup(self, codes):
        return self.embedding(codes).permute(0, 3, 1, 2)


class TamingVQGAN(ImageTokenizer):
    """taming's ``VQModel`` / ``GumbelVQ`` for inference: encoder, quant_conv, quantize,
    post_quant_conv, decoder. ``image_size`` is the resolution images are resized to before
    encoding (256 for the paper's 32x32 codes); the network itself works at any multiple of f."""

    kind = "taming_vqgan"

    def __init__(self, *, quantizer: str = "gumbel", ch: int = 128, ch_mult=(1, 1, 2, 4), num_res_blocks: int = 2,
                 attn_levels=(3,), z_channels: int = 256, double_z: bool = False, embed_dim: int = 256,
                 n_embed: int = 8192, image_size: int = 256):
        super().__init__()
        if quantizer not in ("gumbel", "vq"):
            raise ValueError(f"quantizer must be 'gumbel' or 'vq', got {quantizer!r}")
        self.cfg = dict(quantizer=quantizer, ch=ch, ch_mult=list(ch_mult), num_res_blocks=num_res_blocks,
                        attn_levels=list(attn_levels), z_channels=z_channels, double_z=double_z,
                        embed_dim=embed_dim, n_embed=n_embed, image_size=image_size)
        arch = dict(ch=ch, ch_mult=tuple(ch_mult), num_res_blocks=num_res_blocks, attn_levels=tuple(attn_levels),
                    z_channels=z_channels)
        self.encoder = Encoder(**arch, double_z=double_z)
        self.decoder = Decoder(**arch)
        self.quant_conv = nn.Conv2d(2 * z_channels if double_z else z_channels, embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(embed_dim, z_channels, 1)
        # taming builds GumbelQuantize(z_channels, embed_dim, n_embed) and feeds it quant_conv's
        # output, so it only works when z_channels == embed_dim (256 in the f8 models).
        self.quantize = GumbelQuantize(z_channels, embed_dim, n_embed) if quantizer == "gumbel" \
            else VectorQuantize(embed_dim, n_embed)
        self.image_size = image_size
        self.downsample = 2 ** (len(ch_mult) - 1)
        self.vocab_size = n_embed

    def config_dict(self) -> dict:
        return dict(self.cfg)

    def encode_float(self, x):
        return self.quantize.codes(self.quant_conv(self.encoder(x)))

    def decode_float(self, codes):
        return self.decoder(self.post_quant_conv(self.quantize.lookup(codes)))

    # ---- loading the public checkpoints ----------------------------------------------------
    @staticmethod
    def config_from_state_dict(state: dict, image_size: int = 256) -> dict:
        """Read the architecture off the parameter names and shapes."""
        ch = state["encoder.conv_in.weight"].shape[0]
        levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("encoder.down.")})
        ch_mult = [state[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in levels]
        num_res_blocks = len({k.split(".")[4] for k in state if k.startswith("encoder.down.0.block.")})
        attn_levels = [i for i in levels if f"encoder.down.{i}.attn.0.q.weight" in state]
        z_channels = state["decoder.conv_in.weight"].shape[1]
        double_z = state["encoder.conv_out.weight"].shape[0] == 2 * z_channels
        if "quantize.embed.weight" in state:
            quantizer, codebook = "gumbel", state["quantize.embed.weight"]
        elif "quantize.embedding.weight" in state:
            quantizer, codebook = "vq", state["quantize.embedding.weight"]
        else:
            raise ValueError("not a taming VQGAN state dict: no quantize.embed.weight (Gumbel) or "
                             "quantize.embedding.weight (plain VQ)")
        return dict(quantizer=quantizer, ch=ch, ch_mult=ch_mult, num_res_blocks=num_res_blocks, attn_levels=attn_levels,
                    z_channels=z_channels, double_z=double_z, embed_dim=codebook.shape[1], n_embed=codebook.shape[0],
                    image_size=image_size)

    @classmethod
    def from_state_dict(cls, state: dict, image_size: int = 256) -> "TamingVQGAN":
        # Training-only entries: the discriminator and LPIPS (`loss.`), Gumbel's remap buffer.
        state = {k: v for k, v in state.items() if not k.startswith("loss.") and k != "quantize.used"}
        model = cls(**cls.config_from_state_dict(state, image_size))
        model.load_state_dict(state, strict=True)
        return model.eval()

    @classmethod
    def from_checkpoint(cls, path, *, trust_checkpoint: bool = False, image_size: int = 256) -> "TamingVQGAN":
        """Load a taming ``.ckpt`` (``{"state_dict": ...}``) or a bare state dict saved with torch.save."""
        path = Path(path)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=not trust_checkpoint)
        except Exception as e:  # pickle refuses unknown globals under weights_only
            if trust_checkpoint:
                raise
            raise ValueError(
                f"{path}: torch.load(weights_only=True) refused it ({type(e).__name__}: {str(e)[:200]}). "
                "Lightning checkpoints sometimes pickle training objects. If you trust the file, convert it once: "
                f"`crowdtrain tokenizer convert --taming {path} --out vqgan.safetensors --trust-checkpoint`, "
                "then use the .safetensors") from e
        state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds no state dict")
        return cls.from_state_dict(state, image_size=image_size)
