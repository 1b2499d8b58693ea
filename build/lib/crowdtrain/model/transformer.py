"""The DALL-E-like decoder: text tokens, then an image-code grid, one transformer.

Layout (B = batch, T = text_len, N = image_len = H * W, d = width)::

    input  [ t_0 .. t_{T-1} | <img> c_0 .. c_{N-2} ]     (B, T + N)
    target [ t_1 .. t_{T-1}, - | c_0 c_1 .. c_{N-1} ]

Text position p predicts text token p+1 (only where it is real, not padding); image cell k
holds code k-1 (or the image-start token) and predicts code k. Text positions score only the
text vocabulary, image positions only the image codes, both through the tied embedding.
Sharing is module identity: layer i uses ``attn[group[i]]`` and ``ff[group[i]]``; its norms (and,
with ``layer_scale``, its branch scales) are its own.

A layer's branch is ``scale * block(shift(norm(x)))``: ``shift`` is the token shift
(``crowdtrain.model.token_shift``, with ``token_shift``), ``scale`` the layer's LayerScale vector
(with ``layer_scale``); both are the identity when off. The training stack, the reversible
stack and the cached decoder all run this same branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from crowdtrain.model.attention import IMPLS, Attention, AttentionContext, DecodeState, Rotary, decode_tables
from crowdtrain.model.config import ModelConfig, layer_scale_init
from crowdtrain.model.reversible import reversible_stack
from crowdtrain.model.token_shift import shift_tokens


class FeedForward(nn.Module):
    """GEGLU: ``W_out(a * gelu(b))`` with ``[a, b] = W_in x`` and hidden size ff_mult * width."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.ff_mult * config.width
        self.w_in = nn.Linear(config.width, 2 * hidden)
        self.w_out = nn.Linear(hidden, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(self.dropout(a * F.gelu(gate)))


class LayerOwn(nn.Module):
    """A layer's own (never shared) parameters: its pre-norms and, with ``layer_scale``, the
    per-channel scales of its attention and feed-forward outputs. The shared modules are
    looked up by group, so layers that share weights still scale their branches apart."""

    def __init__(self, config: ModelConfig, group: int, pattern: str, index: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.width)
        self.ff_norm = nn.LayerNorm(config.width)
        self.group = group
        self.pattern = pattern
        self.index = index  # 0-based layer number; sets the LayerScale initial value
        if config.layer_scale:
            self.attn_scale = nn.Parameter(torch.empty(config.width))
            self.ff_scale = nn.Parameter(torch.empty(config.width))
        else:
            self.attn_scale = self.ff_scale = None
        self.reset_scales()

    def reset_scales(self) -> None:
        for scale in (self.attn_scale, self.ff_scale):
            if scale is not None:
                nn.init.constant_(scale, layer_scale_init(self.index + 1))


@dataclass
class ModelOutput:
    loss: torch.Tensor
    text_loss: torch.Tensor
    image_loss: torch.Tensor
    text_logits: torch.Tensor | None = None  # (B, T-1, text_vocab)
    image_logits: torch.Tensor | None = None  # (B, N, image_vocab)


def merge_blank_codes(logits: torch.Tensor, n_colours: int) -> torch.Tensor:
    """Factorised image logits (..., n_masks * n_colours) with the blank patch as one outcome:
    code 0 gets the log-sum of the (mask 0, colour) scores, the other blank codes -inf. With
    additive scores this makes p(code 0) = p(mask 0) and leaves every foreground code's
    probability, p(mask) * p(colour), unchanged."""
    blank = torch.logsumexp(logits[..., :n_colours], dim=-1, keepdim=True)
    rest = torch.full_like(logits[..., 1:n_colours], float("-inf"))
    return torch.cat([blank, rest, logits[..., n_colours:]], dim=-1)


class DalleTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Sharing ids are arbitrary ints; groups are their dense indices in order of first use.
        self.groups = list(dict.fromkeys(config.share_ids))
        group_of_layer = [self.groups.index(s) for s in config.share_ids]
        pattern_of_group = {g: p for g, p in zip(group_of_layer, config.patterns)}

        factors = config.image_code_factors
        # With factorised image codes this holds the text rows and the image-start row only; the
        # image rows are sums of a mask and a colour row (``embedding_weight``).
        self.embedding = nn.Embedding(config.vocab_size if factors is None else config.text_vocab_size + 1,
                                      config.width)
        self.image_factors = None if factors is None else nn.ModuleDict(
            {"mask": nn.Embedding(factors[0], config.width), "colour": nn.Embedding(factors[1], config.width)})
        self.rotary = Rotary(config) if config.rotary else None
        self.pos_embedding = None if config.rotary else nn.Parameter(torch.zeros(config.seq_len, config.width))
        self.attn = nn.ModuleList(Attention(config, pattern_of_group[g], self.rotary) for g in range(len(self.groups)))
        self.ff = nn.ModuleList(FeedForward(config) for _ in self.groups)
        self.layers = nn.ModuleList(
            LayerOwn(config, g, p, i) for i, (g, p) in enumerate(zip(group_of_layer, config.patterns)))
        self.final_norm = nn.LayerNorm(config.width)
        # "auto" picks per layer and sequence length (attention.choose_impl); "efficient" forces
        # the block layouts, "dense" the reference masks (tests and benchmarks compare them).
        self.attention_impl = "auto"
        self.reset_parameters()

    # ---- initialisation -----------------------------------------------------------------
    def reset_parameters(self) -> None:
        std = 0.02
        nn.init.normal_(self.embedding.weight, std=std)
        if self.image_factors is not None:
            for table in self.image_factors.values():  # a code's row is the sum of two: the same std
                nn.init.normal_(table.weight, std=std / 2 ** 0.5)
        if self.pos_embedding is not None:
            nn.init.normal_(self.pos_embedding, std=std)
        # Residual branches are scaled down with depth so the stream's variance stays ~1
        # (GPT-2's rule; every layer, shared or not, adds one attention and one FF branch).
        out_std = std / (2 * self.config.depth) ** 0.5
        for module in list(self.attn) + list(self.ff):
            for name, p in module.named_parameters():
                if p.dim() == 1:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, std=out_std if ("to_out" in name or "w_out" in name) else std)
        for own in self.layers:
            own.reset_scales()

    # ---- helpers ------------------------------------------------------------------------
    def layer_modules(self, i: int) -> tuple[LayerOwn, Attention, FeedForward]:
        norms = self.layers[i]
        return norms, self.attn[norms.group], self.ff[norms.group]

    def text_keep(self, text: torch.Tensor) -> torch.Tensor:
        return text != self.config.text_pad_id

    def _check_inputs(self, text: torch.Tensor, image: torch.Tensor | None) -> None:
        cfg = self.config
        if text.dim() != 2 or text.shape[1] != cfg.text_len:
            raise ValueError(f"text must be (batch, {cfg.text_len}) token ids, got shape {tuple(text.shape)}; "
                             "pad or truncate captions to model.text_len with the text tokenizer")
        if image is not None and (image.dim() != 2 or image.shape[1] != cfg.image_len):
            raise ValueError(f"image must be (batch, {cfg.image_len}) codes of a {cfg.image_height}x"
                             f"{cfg.image_width} grid, got shape {tuple(image.shape)}; encode images with "
                             "the tokenizer the run was configured with")

    def image_code_weight(self) -> torch.Tensor:
        """The tied embedding's (image_vocab_size, width) rows of the image codes."""
        cfg = self.config
        if self.image_factors is None:
            return self.embedding.weight[cfg.text_vocab_size: cfg.text_vocab_size + cfg.image_vocab_size]
        mask, colour = self.image_factors["mask"].weight, self.image_factors["colour"].weight
        return (mask[:, None, :] + colour[None, :, :]).reshape(-1, mask.shape[1])  # code = mask * n_colours + colour

    def embedding_weight(self) -> torch.Tensor:
        """The tied (vocab_size, width) table: text tokens, image codes, the image-start token."""
        w = self.embedding.weight
        if self.image_factors is None:
            return w
        t = self.config.text_vocab_size
        return torch.cat([w[:t], self.image_code_weight(), w[t:]])

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if self.image_factors is None:
            return self.embedding(ids)
        return F.embedding(ids, self.embedding_weight())

    def embed(self, text: torch.Tensor, image_in: torch.Tensor) -> torch.Tensor:
        """Embed text ids and image-stream ids (codes already offset into the joint vocabulary)."""
        x = self.embed_ids(torch.cat([text, image_in], dim=1))
        if self.pos_embedding is not None:
            x = x + self.pos_embedding[: x.shape[1]]
        return x

    def image_stream(self, image: torch.Tensor) -> torch.Tensor:
        """Codes (B, N) -> image-stream input ids: the start token then codes 0..N-2."""
        cfg = self.config
        bos = torch.full_like(image[:, :1], cfg.image_bos_id)
        return torch.cat([bos, image[:, :-1] + cfg.text_vocab_size], dim=1)

    def logits(self, h: torch.Tensor, part: str, *, merge_blank: bool = True) -> torch.Tensor:
        """Text or image logits of final hidden states. Factorised image codes come with the blank
        merged into code 0 (``merge_blank_codes``) unless ``merge_blank=False`` (the raw scores)."""
        cfg = self.config
        # Image logits need only the image rows (with factorised codes, no full table per step).
        w = self.embedding.weight[: cfg.text_vocab_size] if part == "text" else self.image_code_weight()
        logits = h @ w.t().to(h.dtype)
        if merge_blank and part == "image" and self.image_factors is not None:
            logits = merge_blank_codes(logits.float(), cfg.image_code_factors[1])
        return logits

    def image_nll(self, raw_logits: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood of canonical ``codes`` under raw image logits: what
        cross-entropy on the merged logits gives, without a merged (N, vocab) copy to keep for
        the backward pass."""
        cfg = self.config
        logits, codes = raw_logits.reshape(-1, cfg.image_vocab_size), codes.reshape(-1)
        if self.image_factors is None:
            return F.cross_entropy(logits, codes)
        picked = logits.gather(1, codes[:, None]).squeeze(1)
        blank = torch.logsumexp(logits[:, : cfg.image_code_factors[1]], dim=1)
        return (torch.logsumexp(logits, dim=1) - torch.where(codes == 0, blank, picked)).mean()

    def canonical_codes(self, image: torch.Tensor) -> torch.Tensor:
        """Codes with every blank (mask 0, any colour) written as code 0, the one the logits score."""
        if self.image_factors is None:
            return image
        return image.masked_fill(image < self.config.image_code_factors[1], 0)

    # ---- the stack ----------------------------------------------------------------------
    def _branches(self, ctx: AttentionContext):
        shift = None
        if self.config.token_shift:
            def shift(u):
                return shift_tokens(u, 0, self.config, ctx.text_keep, memo=ctx.mask)[0]
        branches = []
        for i in range(self.config.depth):
            own, attn, ff = self.layer_modules(i)
            branches.append((partial(_branch, norm=own.attn_norm, block=partial(attn, ctx=ctx), shift=shift,
                                     scale=own.attn_scale),
                             partial(_branch, norm=own.ff_norm, block=ff, shift=shift, scale=own.ff_scale)))
        return branches

    def run_layers(self, x: torch.Tensor, text_keep: torch.Tensor) -> torch.Tensor:
        """The layers over embedded ``x`` (B, n, d): the whole sequence, or the text plus the first
        whole image rows (a prefix: the uncached sampling baseline runs these, and causality makes
        every position's output the same as in the full sequence)."""
        cfg = self.config
        n = x.shape[1]
        if (n - cfg.text_len) % cfg.image_width or not cfg.text_len < n <= cfg.seq_len:
            raise ValueError(f"run_layers takes the text plus whole image rows (text_len + k * {cfg.image_width}, "
                             f"up to {cfg.seq_len} positions), got {n}")
        if self.attention_impl not in IMPLS:
            raise ValueError(f"model.attention_impl={self.attention_impl!r}; choose from {list(IMPLS)}")
        ctx = AttentionContext(text_keep=text_keep, impl=self.attention_impl)
        branches = self._branches(ctx)
        if self.config.reversible:
            params = [p for m in (self.attn, self.ff, self.layers) for p in m.parameters()]
            return reversible_stack(x, branches, params, recompute=self.training)
        use_checkpoint = self.config.checkpointing and self.training and torch.is_grad_enabled()
        for f, g in branches:
            if use_checkpoint:
                x = checkpoint(partial(_plain_layer, f=f, g=g), x, use_reentrant=False)
            else:
                x = _plain_layer(x, f=f, g=g)
        return x

    def forward(self, text: torch.Tensor, image: torch.Tensor, *, return_logits: bool = False) -> ModelOutput:
        """Training forward: ``text`` (B, T) token ids, ``image`` (B, N) codes -> losses."""
        cfg = self.config
        self._check_inputs(text, image)
        image = self.canonical_codes(image)
        keep = self.text_keep(text)
        h = self.final_norm(self.run_layers(self.embed(text, self.image_stream(image)), keep))
        t = cfg.text_len
        text_logits = self.logits(h[:, : t - 1], "text").float()
        image_logits = self.logits(h[:, t:], "image", merge_blank=False).float()
        # Text: position p predicts token p+1, only where that token is real.
        text_target = text[:, 1:].masked_fill(~keep[:, 1:], -100)
        n_text = (text_target != -100).sum()
        text_loss = F.cross_entropy(text_logits.reshape(-1, cfg.text_vocab_size), text_target.reshape(-1),
                                    ignore_index=-100, reduction="sum") / n_text.clamp(min=1)
        image_loss = self.image_nll(image_logits, image)
        if return_logits and self.image_factors is not None:
            image_logits = merge_blank_codes(image_logits, cfg.image_code_factors[1])
        w = cfg.image_loss_weight
        loss = (text_loss + w * image_loss) / (1 + w)
        return ModelOutput(loss, text_loss, image_loss,
                           text_logits if return_logits else None, image_logits if return_logits else None)

    # ---- incremental decoding -----------------------------------------------------------
    def new_decode_state(self, text: torch.Tensor) -> DecodeState:
        """Per-layer KV caches and, with token shift, what each branch's shift reads back (the
        moving channels of its last ``image_width`` normalized inputs: the previous token and the
        row above), for ``decode_step``."""
        return DecodeState(self.config, self.text_keep(text))

    @torch.no_grad()
    def decode_step(self, ids: torch.Tensor, start: int, state: DecodeState) -> torch.Tensor:
        """Feed ids at positions ``start..start+n-1`` (B, n); returns final hidden states (B, n, d)."""
        n = ids.shape[1]
        x = self.embed_ids(ids)
        if self.pos_embedding is not None:
            x = x + self.pos_embedding[start: start + n]
        # Additive masks in the dtype the projections produce (autocast may differ from x's),
        # built once per step and pattern by the state and shared by that pattern's layers;
        # the rotary tables once per step for all layers.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        tables = decode_tables(self.rotary, start, n, dtype) if self.rotary is not None else None
        reversible, token_shift = self.config.reversible, self.config.token_shift
        x1 = x2 = x
        for i in range(self.config.depth):
            own, attn, ff = self.layer_modules(i)
            keys, mask = state.step_inputs(attn.pattern, start, n, dtype)
            past = state.shift_past[i]
            u = own.attn_norm(x2 if reversible else x1)
            if token_shift:
                u, past[0] = shift_tokens(u, start, self.config, state.text_keep, past[0], memo=state.memo)
            x1 = x1 + _scaled(attn.forward_cached(u, start, state.caches[i], mask, tables, keys), own.attn_scale)
            u = own.ff_norm(x1)
            if token_shift:
                u, past[1] = shift_tokens(u, start, self.config, state.text_keep, past[1], memo=state.memo)
            if reversible:
                x2 = x2 + _scaled(ff(u), own.ff_scale)
            else:
                x1 = x1 + _scaled(ff(u), own.ff_scale)
        out = (x1 + x2) / 2 if self.config.reversible else x1
        return self.final_norm(out)


def _scaled(y: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return y if scale is None else y * scale


def _branch(x: torch.Tensor, *, norm, block, shift, scale) -> torch.Tensor:
    """One residual branch: ``scale * block(shift(norm(x)))`` (shift and scale optional)."""
    u = norm(x)
    return _scaled(block(u if shift is None else shift(u)), scale)


def _plain_layer(x: torch.Tensor, *, f, g) -> torch.Tensor:
    x = x + f(x)
    return x + g(x)
