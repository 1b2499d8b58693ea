"""Attention over ``[text | image]`` with per-layer sparse image patterns.

Who may attend to whom (position i attends to key j only if j <= i, and):
- a text query: real (non-padded) text keys, and always itself (so a padded query has a key);
- an image query at grid cell (r, c): every real text key, plus the image keys its layer's
  pattern allows among cells at or before it in raster order:
  ``full`` all of them; ``axial_row`` its own row; ``axial_col`` its own column;
  ``conv_like`` a causal k x k window centred on it (rows r-k//2..r, columns c-k//2..c+k//2).

Every pattern exists twice: ``pattern_mask`` builds the dense boolean (queries x keys) mask
from index arithmetic (the reference, also used to prefill the KV cache; a one-token decoding
step sees only the text and its block, ``DecodeState.step_inputs``); ``Attention`` computes the same thing efficiently by grouping image queries into
blocks (a row, a column, or a band of rows) that only ever see their own block plus the text.
Tests compare the two on random inputs. ``choose_impl`` decides per layer which one runs when
the model's ``attention_impl`` is ``"auto"`` (the default): dense for short sequences.
"""

from __future__ import annotations

import functools
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
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three ops: rotate-half's sign lives in ``sin``
    (first half negated) and its swap is a roll by half the head."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Rotary(nn.Module):
    """Rotary position embeddings: 1-D over text positions, axial 2-D over image cells.

    Text position p rotates every pair of a head by ``p * freq``. An image cell (r, c) rotates
    the first half of the pairs by ``r * freq`` and the second half by ``c * freq``. Text and
    image never share a relative-position meaning, so this is all the model needs.

    The tables are ``(2, seq_len, head_dim)``: row 0 for queries, row 1 for keys. The query row
    also carries the softmax scale 1/sqrt(head_dim), so queries leave the rotation already
    scaled and no attention path spends an op on it (they call SDPA with ``scale=1``).
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
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (seq_len, dh)
        scale = dh ** -0.5
        self.register_buffer("cos", torch.stack([cos * scale, cos]), persistent=False)
        self.register_buffer("sin", torch.stack([sin * scale, sin]), persistent=False)

    def tables(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(2, length, head_dim) cos and signed sin for positions start..start+length-1 (views)."""
        return self.cos[:, start: start + length].to(dtype), self.sin[:, start: start + length].to(dtype)


# ---- which implementation a layer runs ---------------------------------------------------
IMPLS = ("auto", "efficient", "dense")

# Below this many positions "auto" runs the dense reference on a CPU. Short sequences leave little
# to skip and the block layout spends more, smaller ops (copies, two score matmuls, a cat), which
# per-op overhead punishes. Measured whole training steps (benchmarks/bench_model.py, 2 shared
# CPU cores): the demo preset (96 positions) runs the two within 10% of each other on one thread
# and dense ~1.4x faster on two; 16x16 grids after 64 text tokens (320) gain ~1.1x from
# efficient, 32x32 (1088) ~1.7x. If your CPU shows another crossover (the bench prints both),
# move this.
AUTO_EFFICIENT_MIN_SEQ = 256
# On a CUDA device "auto" always runs dense: scaled_dot_product_attention's fused kernels never
# hold the scores, while the block layout launches several small kernels per layer. Measured on
# one H100 (benchmarks/bench_gpu.py, the paper preset, 1280 positions, bf16): dense trained
# 1.24x (reversible, batch 32) to 1.37x (not reversible, batch 8) faster than efficient, and in
# 42 GiB where efficient took 56. Set ``model.attention_impl = "efficient"`` to override.
AUTO_DENSE_DEVICES = ("cuda",)


def choose_impl(impl: str, pattern: str, seq_len: int, device_type: str = "cpu") -> str:
    """The implementation one layer runs: ``impl`` itself unless it is ``"auto"``.

    ``auto`` picks ``dense`` on the devices of ``AUTO_DENSE_DEVICES``, for the ``full`` pattern
    (its efficient form attends to every earlier cell anyway, so there is nothing to skip) and for
    sequences shorter than ``AUTO_EFFICIENT_MIN_SEQ``, and ``efficient`` otherwise.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose from {list(IMPLS)}")
    if impl != "auto":
        return impl
    if device_type in AUTO_DENSE_DEVICES or pattern == "full" or seq_len < AUTO_EFFICIENT_MIN_SEQ:
        return "dense"
    return "efficient"


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> additive bias: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@functools.lru_cache(maxsize=64)
def _static_block_bias(pattern: str, rows: int, cols: int, conv_kernel: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """Additive bias of the image keys inside each block; depends only on shapes, so it is
    built once per (pattern, grid, device, dtype) and shared by every forward.

    ``axial_row``: (1, cols, cols) causal; ``axial_col``: (1, rows, rows) causal;
    ``conv_like``: (rows, cols, (half+1)*cols), query (r, c) against band slot (o, c') holding
    key row r-half+o (rows above the image are zero padding and never allowed).
    """
    if pattern == "axial_row":
        allowed = torch.ones(cols, cols, dtype=torch.bool, device=device).tril()[None]
    elif pattern == "axial_col":
        allowed = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()[None]
    elif pattern == "conv_like":
        half = conv_kernel // 2
        r = torch.arange(rows, device=device)[:, None, None, None]
        c = torch.arange(cols, device=device)[None, :, None, None]
        o = torch.arange(half + 1, device=device)[None, None, :, None]
        c2 = torch.arange(cols, device=device)[None, None, None, :]
        key_row = r - half + o
        allowed = (key_row >= 0) & ((c - c2).abs() <= half) & ((key_row < r) | (c2 <= c))
        allowed = allowed.reshape(rows, cols, (half + 1) * cols)
    else:
        raise ValueError(f"pattern {pattern!r} has no block layout")
    return _additive(allowed, dtype)


@dataclass
class AttentionContext:
    """Per-forward state shared by all layers: which text is real, which implementation, and
    the masks, built on first use and reused by every layer of this forward."""

    text_keep: torch.Tensor  # (batch, text_len) bool
    impl: str = "auto"  # "efficient", "dense" (the reference), or "auto" (see choose_impl)
    _masks: dict = field(default_factory=dict)

    def mask(self, key, build):
        if key not in self._masks:
            self._masks[key] = build()
        return self._masks[key]


class KVCache:
    """Keys and values of one layer for incremental decoding, preallocated to the sequence length.

    ``append`` returns views ``(batch, heads, filled, head_dim)``; appending writes in place, so
    a decoding step copies only the new token's keys, not the whole cache.
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
    """Everything incremental decoding keeps between steps: per-layer caches and the masks, and
    with token shift each layer's ``shift_past``: for its attention and its feed-forward branch,
    the half of the normalized input channels that move, at the last ``image_width`` positions
    (the previous token and the row above are all a shifted position reads;
    ``crowdtrain.model.token_shift``).

    The image-to-image part of each pattern's mask is built once, ``(image_len, image_len)``,
    as an additive bias; a step's bias row is the real-text bias plus one row of it (one cat
    per pattern per step, shared by every layer of that pattern).

    A one-token image step (``step_inputs``) attends to the text plus only the span of cached
    cells its pattern can allow: from the first allowed cell to itself, every ``image_width``-th
    cell for ``axial_col``. That is the block of the training path (a row, a column, a band),
    so a step reads O(text + block) cached keys per layer instead of O(sequence): after 64
    text tokens on a 32x32 grid, at most 96 (axial) or 160 (5x5 conv) of up to 1088.
    """

    def __init__(self, config: ModelConfig, text_keep: torch.Tensor):
        self.config = config
        self.text_keep = text_keep
        self.caches = [KVCache(config.seq_len) for _ in range(config.depth)]
        self.shift_past: list[list[torch.Tensor | None]] = [[None, None] for _ in range(config.depth)]
        self._memo: dict = {}
        cells = torch.arange(config.image_len, device=text_keep.device)
        self.image_allowed = {p: image_pattern_allows(p, cells, cells, width=config.image_width,
                                                      conv_kernel=config.conv_kernel)
                              for p in dict.fromkeys(config.patterns)}
        # First cell each cell's pattern allows (the diagonal always is, so argmax finds one).
        self._first = {p: a.int().argmax(dim=1).tolist() for p, a in self.image_allowed.items()}
        self._additive: dict = {}  # (name, dtype) -> additive bias tables, built on first use
        self._step: tuple | None = None
        self._step_masks: dict = {}

    def memo(self, key, build):
        """``build()`` once per key for the whole decode (token shift's padding multipliers)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def _table(self, name, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._additive:
            allowed = self.text_keep if name == "text" else self.image_allowed[name]
            self._additive[key] = _additive(allowed, dtype)
        return self._additive[key]

    def mask(self, pattern: str, start: int, n: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """(batch, 1, n, start+n) mask for queries at positions start..start+n-1: bool, or an
        additive bias of ``dtype``. Cached for the current step, so layers share it."""
        if self._step != (start, n):
            self._step, self._step_masks = (start, n), {}
        key = (pattern, dtype)
        if key not in self._step_masks:
            self._step_masks[key] = self._build(pattern, start, n, dtype)
        return self._step_masks[key]

    def step_inputs(self, pattern: str, start: int, n: int,
                    dtype: torch.dtype = torch.bool) -> tuple[slice | None, torch.Tensor]:
        """``(image_keys, mask)`` for ``Attention.forward_cached``. For one image query,
        ``image_keys`` selects the cached image cells it may see (a slice of cell indices, with
        step ``image_width`` for ``axial_col``) and ``mask`` is ``(batch, 1, 1, text_len + cells)``
        over the text and those cells; otherwise ``(None, self.mask(...))`` over every key."""
        t = self.config.text_len
        if not (n == 1 and start >= t):
            return None, self.mask(pattern, start, n, dtype)
        if self._step != (start, n):
            self._step, self._step_masks = (start, n), {}
        key = ("keys", pattern, dtype)
        if key not in self._step_masks:
            cell = start - t
            cells = slice(self._first[pattern][cell], cell + 1,
                          self.config.image_width if pattern == "axial_col" else 1)
            if dtype == torch.bool:
                text, row = self.text_keep, self.image_allowed[pattern][cell, cells]
            else:
                text, row = self._table("text", dtype), self._table(pattern, dtype)[cell, cells]
            mask = torch.cat([text, row.expand(text.shape[0], -1)], dim=1)[:, None, None, :]
            self._step_masks[key] = (cells, mask)
        return self._step_masks[key]

    def _build(self, pattern: str, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        t, b = self.config.text_len, self.text_keep.shape[0]
        if n == 1 and start >= t:
            cell = start - t
            if dtype == torch.bool:
                text, row = self.text_keep, self.image_allowed[pattern][cell, : cell + 1]
            else:
                text, row = self._table("text", dtype), self._table(pattern, dtype)[cell, : cell + 1]
            return torch.cat([text, row.expand(b, -1)], dim=1)[:, None, None, :]
        q_pos = torch.arange(start, start + n, device=self.text_keep.device)
        allowed = pattern_mask(pattern, self.config, self.text_keep, q_pos=q_pos, num_keys=start + n)[:, None]
        return allowed if dtype == torch.bool else _additive(allowed, dtype)


class Attention(nn.Module):
    """One attention layer with a fixed image pattern; see the module docstring for the rules.

    Training forward (``forward``) has two implementations that compute the same function:

    - ``dense``: one SDPA call with the (seq x seq) boolean mask of ``pattern_mask``. Cost grows
      with seq^2; it is the reference, and the faster choice for short sequences.
    - ``efficient``: text queries attend to the text; image queries are grouped into blocks
      (a row, a column, or a row with the band of rows above it for ``conv_like``) whose keys
      are the text plus the block's own cells. Scores are ``q @ k_text^T`` for all image
      queries at once (text keys are never copied per block) next to ``q_block @ k_block^T``,
      one softmax over both, then ``p_text @ v_text + p_block @ v_block``. Each image query
      touches text_len + block keys instead of seq, and every op is a plain batched matmul or
      elementwise op, so it runs the same on any device. Columns are laid out column-major by
      the same copy that splits the heads, so blocks are always views.
    """

    def __init__(self, config: ModelConfig, pattern: str, rotary: Rotary | None):
        super().__init__()
        self.config = config
        self.pattern = pattern
        self.to_qkv = nn.Linear(config.width, 3 * config.inner_dim, bias=False)
        self.to_out = nn.Linear(config.inner_dim, config.width)
        self.dropout = config.dropout
        # Not a submodule: the rotary tables belong to the model, shared by every layer.
        self._rotary = [rotary]

    # ---- projections -------------------------------------------------------------------
    def _heads(self, qkv: torch.Tensor, start: int, *, column_major: bool = False):
        """Projections ``(b, len, 3*inner)`` of positions start.. -> q, k, v, each contiguous
        ``(b, heads, len, head_dim)``, q rotated and scaled, k rotated.

        ``column_major``: the positions are whole image rows, and come out ordered column by
        column (the layout ``axial_col`` blocks need), in the same single copy.
        """
        cfg = self.config
        b, length, _ = qkv.shape
        h, dh, w = cfg.heads, cfg.head_dim, cfg.image_width
        z = qkv.view(b, length, 3, h, dh)
        if column_major:
            rows = length // w
            z = z.view(b, rows, w, 3, h, dh).permute(3, 0, 4, 2, 1, 5).contiguous()  # (3, b, h, w, rows, dh)
        else:
            z = z.permute(2, 0, 3, 1, 4).contiguous()  # (3, b, h, len, dh)
        qk, v = z.split([2, 1])
        rotary = self._rotary[0]
        if rotary is not None:
            cos, sin = rotary.tables(start, length, qk.dtype)
            if column_major:  # tables in raster order, viewed column-major: (2, 1, 1, w, rows, dh)
                cos, sin = (c.view(2, 1, 1, rows, w, dh).transpose(3, 4) for c in (cos, sin))
            else:
                cos, sin = cos[:, None, None], sin[:, None, None]
            qk = rotate(qk, cos, sin)
        q, k = qk.reshape(2, b, h, length, dh).unbind(0)
        if rotary is None:
            q = q * dh ** -0.5
        return q, k, v.reshape(b, h, length, dh)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        b, h, n, dh = out.shape
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * dh))

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        p = scores.softmax(dim=-1)
        return F.dropout(p, self.dropout) if self.training and self.dropout > 0 else p

    # ---- full sequence (training) -------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.to_qkv(x)
        if choose_impl(ctx.impl, self.pattern, n, x.device.type) == "dense":
            q, k, v = self._heads(qkv, 0)
            mask = ctx.mask(("dense", self.pattern), lambda: self._dense_mask(ctx, n))
            p = self.dropout if self.training else 0.0
            return self._merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0))
        cfg = self.config
        t, w = cfg.text_len, cfg.image_width
        rows = (n - t) // w
        qkv_text, qkv_image = qkv.split([t, n - t], dim=1)
        q_t, k_t, v_t = self._heads(qkv_text, 0)
        text_bias = ctx.mask(("text", q_t.dtype), lambda: self._text_bias(ctx, q_t.dtype))
        out_text = self._softmax(q_t @ k_t.transpose(-1, -2) + text_bias) @ v_t  # (b, h, t, dh)
        column_major = self.pattern == "axial_col"
        q, k, v = self._heads(qkv_image, t, column_major=column_major)
        out_image = self._image_attention(q, k, v, k_t, v_t, rows, ctx)  # (b, h, image, dh)
        if column_major:  # back to raster order, (b, image, h, dh)
            out_image = out_image.view(b, cfg.heads, w, rows, -1).permute(0, 3, 2, 1, 4)
            out_image = out_image.reshape(b, n - t, cfg.heads, -1)
        else:
            out_image = out_image.transpose(1, 2)
        out = torch.cat([out_text.transpose(1, 2), out_image], dim=1)  # (b, n, h, dh), one copy
        return self.to_out(out.reshape(b, n, cfg.inner_dim))

    def _dense_mask(self, ctx: AttentionContext, n: int) -> torch.Tensor:
        positions = torch.arange(n, device=ctx.text_keep.device)
        return pattern_mask(self.pattern, self.config, ctx.text_keep, q_pos=positions, num_keys=n)[:, None]

    def _text_bias(self, ctx: AttentionContext, dtype: torch.dtype) -> torch.Tensor:
        """(batch, 1, t, t): causal over real text keys, and every text query sees itself."""
        t = self.config.text_len
        device = ctx.text_keep.device
        eye = torch.eye(t, dtype=torch.bool, device=device)
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return _additive(causal & (ctx.text_keep[:, None, :] | eye), dtype)[:, None]

    def _image_bias(self, ctx: AttentionContext, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """(batch, 1, blocks or 1, block queries, text + block keys): real text | the block."""
        cfg = self.config
        static = _static_block_bias(self.pattern, rows, cfg.image_width, cfg.conv_kernel, ctx.text_keep.device, dtype)
        b, t = ctx.text_keep.shape
        keep = _additive(ctx.text_keep, dtype)[:, None, None, None, :]  # (b, 1, 1, 1, t)
        static = static[None, None]  # (1, 1, blocks or 1, queries, keys)
        return torch.cat([keep.expand(b, 1, static.shape[2], static.shape[3], t),
                          static.expand(b, -1, -1, -1, -1)], dim=-1)

    def _image_attention(self, q, k, v, k_t, v_t, rows: int, ctx: AttentionContext) -> torch.Tensor:
        """Image queries ``q`` (b, h, image, dh) against the text and their block's cells."""
        cfg = self.config
        b, h, n_image, dh = q.shape
        t, w = cfg.text_len, cfg.image_width
        if self.pattern == "full":
            # One block holding every cell: nothing to skip, so a masked SDPA over text + image.
            mask = ctx.mask("full", lambda: torch.cat([
                ctx.text_keep[:, None, None, :].expand(b, 1, n_image, t),
                torch.ones(n_image, n_image, dtype=torch.bool, device=q.device).tril().expand(b, 1, -1, -1),
            ], dim=-1))
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, torch.cat([k_t, k], 2), torch.cat([v_t, v], 2), attn_mask=mask,
                                                  dropout_p=p, scale=1.0)
        if self.pattern == "axial_row":
            blocks, size = rows, w
            k_b, v_b = k.view(b, h, blocks, size, dh), v.view(b, h, blocks, size, dh)
        elif self.pattern == "axial_col":  # q, k, v arrive column-major
            blocks, size = w, rows
            k_b, v_b = k.view(b, h, blocks, size, dh), v.view(b, h, blocks, size, dh)
        elif self.pattern == "conv_like":  # each row of queries sees the band of rows r-half..r
            blocks, size = rows, w
            k_b, v_b = self._band(k, rows), self._band(v, rows)
        else:
            raise ValueError(f"unknown attention pattern {self.pattern!r}")
        bias = ctx.mask(("image", self.pattern, q.dtype), lambda: self._image_bias(ctx, rows, q.dtype))
        q_b = q.view(b, h, blocks, size, dh)
        scores = torch.cat([(q @ k_t.transpose(-1, -2)).view(b, h, blocks, size, t),
                            q_b @ k_b.transpose(-1, -2)], dim=-1)  # (b, h, blocks, size, t + block keys)
        p_text, p_block = self._softmax(scores + bias).split([t, k_b.shape[3]], dim=-1)
        return p_text.reshape(b, h, n_image, t) @ v_t + (p_block @ v_b).view(b, h, n_image, dh)

    def _band(self, z: torch.Tensor, rows: int) -> torch.Tensor:
        """(b, h, rows*w, dh) raster -> (b, h, rows, (half+1)*w, dh): for each row r the key rows
        r-half..r, with zero rows above the image (the static bias never allows them)."""
        cfg = self.config
        b, h, _, dh = z.shape
        half, w = cfg.conv_kernel // 2, cfg.image_width
        padded = F.pad(z.view(b, h, rows, w, dh), (0, 0, 0, 0, half, 0))  # (b, h, rows+half, w, dh)
        band = padded.unfold(2, half + 1, 1)  # (b, h, rows, w, dh, half+1)
        return band.permute(0, 1, 2, 5, 3, 4).reshape(b, h, rows, (half + 1) * w, dh)

    # ---- incremental decoding -----------------------------------------------------------
    def forward_cached(self, x_new: torch.Tensor, start: int, cache: KVCache, mask: torch.Tensor,
                       tables: tuple[torch.Tensor, torch.Tensor] | None = None,
                       image_keys: slice | None = None) -> torch.Tensor:
        """Attend for new positions ``start..start+n-1`` given the cache of all earlier ones.

        ``image_keys`` and ``mask`` come from ``DecodeState.step_inputs``: with ``image_keys``
        None, ``mask`` is ``(batch, 1, n, start+n)`` over every cached key (bool or additive);
        otherwise the query sees the text and the cached image cells ``image_keys`` (copied
        next to the text keys unless they already follow it), and ``mask`` covers those.
        ``tables`` are the step's rotary tables from ``decode_tables`` (computed here if None; a
        decoding step computes them once for all layers). Costs O(text + block) per image token,
        in about ten ops per layer.
        """
        cfg = self.config
        b, n, _ = x_new.shape
        if cache.length != start:
            raise ValueError(f"KV cache holds {cache.length} positions but decoding resumes at {start}")
        qkv = self.to_qkv(x_new).view(b, n, 3, cfg.heads, cfg.head_dim)
        qk, v = qkv.split([2, 1], dim=2)
        rotary = self._rotary[0]
        if rotary is not None:
            cos, sin = tables if tables is not None else decode_tables(rotary, start, n, qk.dtype)
            qk = rotate(qk, cos, sin)
        q, k = qk.unbind(2)  # (b, n, h, dh)
        if rotary is None:
            q = q * cfg.head_dim ** -0.5
        k_all, v_all = cache.append(k.transpose(1, 2), v.squeeze(2).transpose(1, 2))
        if image_keys is not None and (image_keys.start, image_keys.step) != (0, 1):
            t = cfg.text_len
            k_all = torch.cat([k_all[:, :, :t], k_all[:, :, t:][:, :, image_keys]], dim=2)
            v_all = torch.cat([v_all[:, :, :t], v_all[:, :, t:][:, :, image_keys]], dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask, scale=1.0)
        return self._merge(out)


def decode_tables(rotary: Rotary, start: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of positions start..start+n-1 shaped (n, 2, 1, head_dim) for projections laid
    out (batch, n, q/k, heads, head_dim): views of the model's tables, no copy unless dtype differs."""
    cos, sin = rotary.tables(start, n, dtype)
    return cos.transpose(0, 1)[:, :, None], sin.transpose(0, 1)[:, :, None]
