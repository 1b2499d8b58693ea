"""Autoregressive sampling of image codes with a KV cache, top-k / top-p and temperature.

The paper found top-k 256 *or* top-p 0.75 improve quality over plain sampling: one filter at a
time. The default (nucleus 0.75: it does not depend on the vocabulary's size) is ``DEFAULT_TOP_K`` / ``DEFAULT_TOP_P`` (from ``crowdtrain.model.config``,
torch-free, so the CLI flags read the same values); ``sampling_filters`` turns optional user
choices into the filters to apply. Filters look at the model's raw logits; the temperature then
reshapes what survived (so temperature never changes which tokens the nucleus keeps). With the cache,
each image token costs one layer pass for one position plus one pass over the cached keys its
layer's pattern can allow (the text and the token's row, column or band);
``use_cache=False`` re-runs the model's normal forward over the prefix instead (the text and the
image rows up to the token's row) for every token, the baseline of ``benchmarks/bench_model.py``.
"""

from __future__ import annotations

import torch

from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P, sampling_filters
from crowdtrain.model.transformer import DalleTransformer

__all__ = ["DEFAULT_TOP_K", "DEFAULT_TOP_P", "sampling_filters", "filter_logits", "sample_next", "generate_images",
           "uncached_logits"]


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (keeps at least one).

    With both, top-k goes first and the nucleus is taken of the renormalised top-k survivors."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,). temperature 0 means greedy.

    The filters choose the candidates on the raw logits; the temperature then sharpens (<1) or
    flattens (>1) the distribution among them only, never letting a filtered token back in."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float(), top_k=top_k, top_p=top_p) / temperature
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def uncached_logits(model: DalleTransformer, text: torch.Tensor, keep: torch.Tensor, codes: torch.Tensor,
                    k: int) -> torch.Tensor:
    """Image logits (B, image_vocab) for code ``k`` without a cache: the normal forward over the
    text and image rows 0..k // image_width (causality makes the later rows irrelevant)."""
    cfg = model.config
    rows = k // cfg.image_width + 1
    x = model.embed(text, model.image_stream(codes)[:, : rows * cfg.image_width])
    h = model.final_norm(model.run_layers(x, keep))
    return model.logits(h[:, cfg.text_len + k], "image").float()


@torch.no_grad()
def generate_images(model: DalleTransformer, text: torch.Tensor, *, temperature: float = 1.0,
                    top_k: int | None = DEFAULT_TOP_K, top_p: float | None = DEFAULT_TOP_P, seed: int | None = None,
                    use_cache: bool = True, return_logits: bool = False):
    """Sample image codes for a batch of tokenized prompts.

    ``text`` is (B, text_len) token ids (padded with ``text_pad_id``). Returns codes of shape
    (B, image_height, image_width), and with ``return_logits`` also the (B, N, image_vocab)
    logits each code was drawn from. Same ``seed``, same device and same inputs give the same
    codes.
    """
    cfg = model.config
    model._check_inputs(text, None)
    was_training = model.training
    model.eval()
    generator = None
    if seed is not None:
        generator = torch.Generator(device=text.device)
        generator.manual_seed(seed)
    b, t, n = text.shape[0], cfg.text_len, cfg.image_len
    keep = model.text_keep(text)
    codes = torch.zeros(b, n, dtype=torch.long, device=text.device)
    all_logits = []
    try:
        # Inference mode skips autograd's bookkeeping on each of the many small decoding ops
        # (~10% per step on CPU). ``codes`` was made outside it, so callers can train on it;
        # the logits are stacked outside it for the same reason.
        with torch.inference_mode():
            if use_cache:
                state = model.new_decode_state(text)
                # Prefill: the text and the image-start token in one pass.
                bos = torch.full((b, 1), cfg.image_bos_id, dtype=torch.long, device=text.device)
                h = model.decode_step(torch.cat([text, bos], dim=1), 0, state)[:, -1]
                for k in range(n):
                    logits = model.logits(h, "image").float()
                    codes[:, k] = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                              generator=generator)
                    if return_logits:
                        all_logits.append(logits)
                    if k + 1 < n:
                        h = model.decode_step((codes[:, k] + cfg.text_vocab_size)[:, None], t + 1 + k, state)[:, -1]
            else:
                for k in range(n):
                    logits = uncached_logits(model, text, keep, codes, k)
                    codes[:, k] = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                              generator=generator)
                    if return_logits:
                        all_logits.append(logits)
    finally:
        model.train(was_training)
    codes = codes.view(b, cfg.image_height, cfg.image_width)
    if return_logits:
        return codes, torch.stack(all_logits, dim=1)
    return codes
