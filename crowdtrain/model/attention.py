"""Attention over ``[text | image]`` with per-layer sparse image patterns.

Who may attend to whom (position i attends to key j only if j <= i, and):
- a text query: real (non-padded) text keys, and always itself (so a padded query has a key);
- an image query at grid cell (r, c): every real text key, plus the image keys its layer's
  pattern allows among cells at or before it in raster order:
  ``full`` all of them; ``axial_row`` its own row; ``axial_col`` its own column;
  ``conv_like`` a causal k x k window centred on it (rows r-k//2..r, columns c-k//2..c+k//2).

Every pattern exists twice: ``pattern_mask`` builds the dense boolean (queries x keys) mask
from index arithmetic (the reference, also used for cached decoding, where one row costs
O(sequence)); ``Attention`` computes the same thing efficiently by grouping image queries into
blocks (a row, a column, or a band of rows) that only ever see their own block plus the text.
Tests compare the two on random inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from crowdtrain.model.config import ModelConfig


# ---- dense reference masks ---------------------------------------------------------------
def image_pattern_allows(pattern: str, q_cell: torch.Tensor, k_cell: torch.Tensor, *, width: int,
                         conv_kernel: int) -> torch.Tensor:
    """Bool tensor broadcast over ``q_cell[..., None]`` and ``k_cell[None, ...]``: may image cell q
    attend to image cell k under ``pattern``? Cells are raster indices r * width + c."""
    q = q_cell[:, None]
    k = k_cell[None, :]
    causal = k <= q
    qr, qc, kr, kc = q // width, q % width, k // width, k % width
    if pattern == "full":
        return causal
    if pattern == "axial_row":
        return causal & (qr == kr)
    if pattern == "axial_col":
        return causal & (qc == kc)
    if pattern == "conv_like":
        half = conv_kernel // 2
        return causal & ((qr - kr).abs() <= half) & ((qc - kc).abs() <= half)
    raise ValueError(f"unknown attention pattern {pattern!r}")


def pattern_mask(pattern: str, config: ModelConfig, text_keep: torch.Tensor,
                 q_pos: torch.Tensor | None = None, num_keys: int | None = None) -> torch.Tensor:
    """Dense reference mask ``(batch, len(q_pos), num_keys)``: True where attention is allowed.

    ``q_pos`` are absolute sequence positions of the queries (default: all), keys are positions
    ``0..num_keys-1`` (default: the whole sequence). ``text_keep`` is ``(batch, text_len)``,
    True for real text tokens.
    """
    device = text_keep.device
    t = config.text_len
    if q_pos is None:
        q_pos = torch.arange(config.seq_len, device=device)
    if num_keys is None:
        num_keys = config.seq_len
    k_pos = torch.arange(num_keys, device=device)
    q_is_text = (q_pos < t)[:, None]
    k_is_text = (k_pos < t)[None, :]
    causal = k_pos[None, :] <= q_pos[:, None]
    image_ok = image_pattern_allows(pattern, (q_pos - t).clamp(min=0), (k_pos - t).clamp(min=0),
                                    width=config.image_width, conv_kernel=config.conv_kernel)
    # (batch, num_keys): is key j a real text token?
    key_is_real_text = torch.zeros(text_keep.shape[0], num_keys, dtype=torch.bool, device=device)
    n = min(t, num_keys)
    key_is_real_text[:, :n] = text_keep[:, :n]
    text_query = q_is_text & k_is_text & causal  # (nq, nk)
    text_query = text_query[None] & (key_is_real_text[:, None, :] | (q_pos[:, None] == k_pos[None, :])[None])
    image_query = (~q_is_text) & ((k_is_text & key_is_real_text[:, None, :]) | (~k_is_text & image_ok))
    return torch.where(q_is_text[None], text_query, image_query)


# ---- rotary embeddings -------------------------------------------------------------------
class Rotary(nn.Module):
    """Rotary position embeddings: 1-D over text positions, axial 2-D over image cells.

    Text position p rotates every pair of a head by ``p * freq``. An image cell (r, c) rotates
    the first half of the pairs by ``r * freq`` and the second half by ``c * freq``. Text and
    image never share a relative-position meaning, so this is all the model needs.
    """

    def __init__(self, config: ModelConfig, base: float = 10000.0):
        super().__init__()
        self.config = config
        dh = config.head_dim
        inv_text = 1.0 / base ** (torch.arange(0, dh, 2).float() / dh)  # dh/2 pairs
        inv_axis = 1.0 / base ** (torch.arange(0, dh // 2, 2).float() / (dh // 2))  # dh/4 pairs
        t = torch.arange(config.text_len).float()
        text_angles = t[:, None] * inv_text[None, :]
        cells = torch.arange(config.image_len)
        rows = (cells // config.image_width).float()
        cols = (cells % config.image_width).float()
        image_angles = torch.cat([rows[:, None] * inv_axis[None, :], cols[:, None] * inv_axis[None, :]], dim=-1)
        angles = torch.cat([text_angles, image_angles], dim=0)  # (seq_len, dh/2)
        angles = torch.cat([angles, angles], dim=-1)  # (seq_len, dh) for rotate-half
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: slice | torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (..., n, head_dim) whose rows sit at sequence ``positions``."""
        cos = self.cos[positions].to(x.dtype)
        sin = self.sin[positions].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ---- the attention module ----------------------------------------------------------------
@dataclass
class AttentionContext:
    """Per-forward state shared by all layers: which text is real, and masks built once."""

    text_keep: torch.Tensor  # (batch, text_len) bool
    impl: str = "efficient"  # or "dense": the reference path, for tests and benchmarks
    _masks: dict = field(default_factory=dict)

    def mask(self, key: str, build):
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]


class KVCache:
    """Keys and values of one layer for incremental decoding, preallocated to the sequence length.

    ``keys()`` and ``values()`` are views ``(batch, heads, filled, head_dim)``; appending writes in
    place, so a decoding step copies only the new token's keys, not the whole cache.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {n} positions > capacity {self.capacity}")
        self.k[:, :, self.length: self.length + n] = k
        self.v[:, :, self.length: self.length + n] = v
        self.length += n
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


class DecodeState:
    """Everything incremental decoding keeps between steps: per-layer caches and the masks.

    The image-to-image part of each pattern's mask is built once, ``(image_len, image_len)``; a
    step's mask row is the real-text flags plus one row of it, O(sequence) per token.
    """

    def __init__(self, config: ModelConfig, text_keep: torch.Tensor):
        self.config = config
        self.text_keep = text_keep
        self.caches = [KVCache(config.seq_len) for _ in range(config.depth)]
        cells = torch.arange(config.image_len, device=text_keep.device)
        self.image_masks = {p: image_pattern_allows(p, cells, cells, width=config.image_width,
                                                    conv_kernel=config.conv_kernel)
                            for p in dict.fromkeys(config.patterns)}

    def mask(self, pattern: str, start: int, n: int) -> torch.Tensor:
        """(batch, 1, n, start+n) mask for queries at positions start..start+n-1."""
        t = self.config.text_len
        if n == 1 and start >= t:
            row = self.image_masks[pattern][start - t, : start - t + 1]
            b = self.text_keep.shape[0]
            return torch.cat([self.text_keep, row.expand(b, -1)], dim=1)[:, None, None, :]
        q_pos = torch.arange(start, start + n, device=self.text_keep.device)
        return pattern_mask(pattern, self.config, self.text_keep, q_pos=q_pos, num_keys=start + n)[:, None]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, pattern: str, rotary: Rotary | None):
        super().__init__()
        self.config = config
        self.pattern = pattern
        self.to_qkv = nn.Linear(config.width, 3 * config.inner_dim, bias=False)
        self.to_out = nn.Linear(config.inner_dim, config.width)
        self.dropout = config.dropout
        # Not a submodule: the rotary tables belong to the model, shared by every layer.
        self._rotary = [rotary]

    def _project(self, x: torch.Tensor, positions):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.config.heads, self.config.head_dim).permute(2, 0, 3, 1, 4)
        rotary = self._rotary[0]
        if rotary is not None:
            q, k = rotary(q, positions), rotary(k, positions)
        return q, k, v  # each (batch, heads, n, head_dim)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        b, h, n, dh = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * dh))

    def _sdpa(self, q, k, v, mask):
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)

    # ---- full sequence (training) -------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self._project(x, slice(None))
        if ctx.impl == "dense":
            mask = ctx.mask(f"dense:{self.pattern}", lambda: pattern_mask(self.pattern, self.config, ctx.text_keep)[:, None])
            return self._merge(self._sdpa(q, k, v, mask))
        t = self.config.text_len
        text_out = self._sdpa(q[:, :, :t], k[:, :, :t], v[:, :, :t], ctx.mask("text", lambda: self._text_mask(ctx)))
        image_out = self._image_attention(q[:, :, t:], k, v, ctx)
        return self._merge(torch.cat([text_out, image_out], dim=2))

    def _text_mask(self, ctx: AttentionContext) -> torch.Tensor:
        t = self.config.text_len
        eye = torch.eye(t, dtype=torch.bool, device=ctx.text_keep.device)
        causal = torch.ones(t, t, dtype=torch.bool, device=ctx.text_keep.device).tril()
        return (causal & (ctx.text_keep[:, None, :] | eye))[:, None]  # (batch, 1, t, t)

    def _image_attention(self, q_img, k, v, ctx: AttentionContext) -> torch.Tensor:
        """Image queries in blocks: each block sees the text keys plus its own image keys."""
        cfg = self.config
        b, h, _, dh = q_img.shape
        t, rows, cols = cfg.text_len, cfg.image_height, cfg.image_width
        k_text, v_text = k[:, :, :t], v[:, :, :t]
        k_img, v_img = k[:, :, t:], v[:, :, t:]
        keep = ctx.text_keep[:, None, None, None, :]  # (batch, 1, 1, 1, t): broadcast over blocks
        device = q_img.device

        if self.pattern == "full":
            mask = ctx.mask("full", lambda: torch.cat([
                ctx.text_keep[:, None, None, :].expand(b, 1, cfg.image_len, t),
                torch.ones(cfg.image_len, cfg.image_len, dtype=torch.bool, device=device).tril().expand(b, 1, -1, -1),
            ], dim=-1))
            return self._sdpa(q_img, torch.cat([k_text, k_img], 2), torch.cat([v_text, v_img], 2), mask)

        if self.pattern in ("axial_row", "axial_col"):
            grid = lambda z: z.reshape(b, h, rows, cols, dh)
            q_g, k_g, v_g = grid(q_img), grid(k_img), grid(v_img)
            if self.pattern == "axial_col":  # columns become the blocks
                q_g, k_g, v_g = (z.transpose(2, 3) for z in (q_g, k_g, v_g))
            n_blocks, block = q_g.shape[2], q_g.shape[3]
            mask = ctx.mask(f"axial:{block}", lambda: torch.cat([
                keep.expand(b, 1, 1, block, t),
                torch.ones(block, block, dtype=torch.bool, device=device).tril().expand(b, 1, 1, -1, -1),
            ], dim=-1))
            out = self._blocks(q_g, k_g, v_g, k_text, v_text, n_blocks, mask)
            if self.pattern == "axial_col":
                out = out.transpose(2, 3)
            return out.reshape(b, h, cfg.image_len, dh)

        if self.pattern == "conv_like":
            # Each row of queries sees a band of rows r-half..r (zero rows pad the top); the
            # static mask keeps the k x k window and raster causality inside the band.
            half = cfg.conv_kernel // 2
            grid = lambda z: z.reshape(b, h, rows, cols, dh)
            q_g = grid(q_img)
            pad = lambda z: F.pad(grid(z), (0, 0, 0, 0, half, 0))
            k_p, v_p = pad(k_img), pad(v_img)
            band = lambda z: torch.stack([z[:, :, o:o + rows] for o in range(half + 1)], dim=3).reshape(
                b, h, rows, (half + 1) * cols, dh)
            mask = ctx.mask("conv", lambda: torch.cat([
                keep.expand(b, 1, rows, cols, t), self._conv_band_mask(device).expand(b, 1, -1, -1, -1)], dim=-1))
            out = self._blocks(q_g, band(k_p), band(v_p), k_text, v_text, rows, mask)
            return out.reshape(b, h, cfg.image_len, dh)
        raise ValueError(f"unknown attention pattern {self.pattern!r}")

    def _conv_band_mask(self, device) -> torch.Tensor:
        """(rows, cols, (half+1)*cols) bool: query (r, c) may see band slot (o, c')."""
        cfg = self.config
        half = cfg.conv_kernel // 2
        r = torch.arange(cfg.image_height, device=device)[:, None, None, None]
        c = torch.arange(cfg.image_width, device=device)[None, :, None, None]
        o = torch.arange(half + 1, device=device)[None, None, :, None]
        c2 = torch.arange(cfg.image_width, device=device)[None, None, None, :]
        key_row = r - half + o
        ok = (key_row >= 0) & ((c - c2).abs() <= half) & ((key_row < r) | (c2 <= c))
        return ok.reshape(cfg.image_height, cfg.image_width, (half + 1) * cfg.image_width)

    def _blocks(self, q_g, k_g, v_g, k_text, v_text, n_blocks, mask):
        """Attention inside blocks. q_g: (B, heads, blocks, n, dh); keys are the text plus k_g.

        Blocks are folded into the head dimension, a free view, so this is one 4-D SDPA call
        that the fused (flash) kernels take, on CPU too; 5-D inputs fall back to the slow path.
        """
        b, h, nb, n, dh = q_g.shape
        k_cat = torch.cat([k_text[:, :, None].expand(-1, -1, nb, -1, -1), k_g], dim=3)
        v_cat = torch.cat([v_text[:, :, None].expand(-1, -1, nb, -1, -1), v_g], dim=3)
        keys = k_cat.shape[3]
        if mask.shape[2] == 1:  # the same mask for every block: (B, 1, n, keys) broadcasts
            mask = mask[:, :, 0]
        else:
            mask = mask.expand(b, h, nb, n, keys).reshape(b, h * nb, n, keys)
        fold = lambda z: z.reshape(b, h * nb, z.shape[3], dh)
        return self._sdpa(fold(q_g), fold(k_cat), fold(v_cat), mask).view(b, h, nb, n, dh)

    # ---- incremental decoding -----------------------------------------------------------
    def forward_cached(self, x_new: torch.Tensor, start: int, cache: KVCache, mask: torch.Tensor) -> torch.Tensor:
        """Attend for new positions ``start..start+n-1`` given the cache of all earlier ones.

        ``mask`` is ``(batch, 1, n, start+n)`` from ``DecodeState.mask``. Costs O(sequence) per
        new token: one pass over the cached keys.
        """
        n = x_new.shape[1]
        if cache.length != start:
            raise ValueError(f"KV cache holds {cache.length} positions but decoding resumes at {start}")
        positions = torch.arange(start, start + n, device=x_new.device)
        q, k, v = self._project(x_new, positions)
        k_all, v_all = cache.append(k, v)
        return self._merge(F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask))
