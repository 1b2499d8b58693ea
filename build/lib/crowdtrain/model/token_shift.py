"""Token shift: each attention and feed-forward block sees some channels of its neighbours.

With ``ModelConfig.token_shift`` every block's normalized input is rewritten before the block
(as in the paper's code, DALLE-pytorch's ``PreShiftToken``); the rest of the channels pass
through unchanged:

- a text position takes its first half of the channels from the previous text position
  (zeros at position 0, and zeros where the previous position is padding, so real text never
  reads a padded slot whatever side the padding is on);
- an image cell at grid position (r, c) takes its first quarter of the channels from the cell
  above, (r-1, c), and its second quarter from the cell to the left, (r, c-1); zeros in the
  first row and in the first column.

Image cells are the sequence positions ``text_len + r * image_width + c`` (the grid that the
attention patterns and the rotary embeddings use), and cell k holds the image-start token (k=0)
or code k-1. The above and left neighbours of a cell are at positions ``image_width`` and 1
earlier, so a cell only ever reads strictly earlier positions and the model stays causal. The
first cell, the image-start token, is in the first row and the first column: it gets zeros in
both shifted quarters and reads nothing from the text (the last text position may be padding).

The shift is cheap (a few copies of the block input) and gives every block a local 2-D
neighbourhood without attending to it; the paper's authors report it speeds up training.

``shift_tokens`` serves the whole sequence (training) and incremental decoding alike: it takes
the moving half of the channels of the ``image_width`` positions before the new ones (``past``)
and returns those of the last ``image_width`` positions for the next call, which is all a later
position can reach back to.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from crowdtrain.model.config import ModelConfig


def _multipliers(start: int, n: int, config: ModelConfig, text_keep: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0/1 multipliers of positions start..start+n-1, (batch, positions, 1): for the channels taken
    from the previous position (text: is it real text; image: is there a cell to the left), for
    the first quarter of the text positions (is the previous position real text) and for the
    first quarter of the image positions (is there a row above)."""
    t, w = config.text_len, config.image_width
    n_text = min(max(t - start, 0), n)
    text_prev = F.pad(text_keep, (1, 0))[:, start: start + n_text, None].to(dtype)
    cells = torch.arange(start + n_text - t, start + n - t, device=text_keep.device)
    has_left = (cells % w != 0).to(dtype)[None, :, None]
    has_above = (cells >= w).to(dtype)[None, :, None]
    prev = torch.cat([text_prev, has_left.expand(text_keep.shape[0], -1, -1)], dim=1)
    return prev, text_prev, has_above


def shift_tokens(x: torch.Tensor, start: int, config: ModelConfig, text_keep: torch.Tensor,
                 past: torch.Tensor | None = None,
                 memo: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift normalized inputs ``x`` (B, n, d) at positions ``start..start+n-1``.

    ``past`` (B, image_width, d/2) holds the first half of the channels (the only ones that
    move) at positions ``start-image_width..start-1`` (None: zeros, only for ``start == 0``).
    Returns the shifted inputs and the ``past`` for the positions that follow.
    ``memo(key, build)`` caches the 0/1 multipliers across the layers of one forward or
    decoding step (``AttentionContext.mask``, ``DecodeState.memo``).
    """
    b, n, d = x.shape
    t, w = config.text_len, config.image_width
    half, q = d // 2, d // 4
    if past is None:
        if start != 0:
            raise ValueError(f"token shift at position {start} needs the inputs of the {w} positions before it")
        past = x.new_zeros(b, w, half)
    lead = torch.cat([past, x[..., :half].to(past.dtype)], dim=1)  # moving channels of start-w .. start+n-1
    n_text = min(max(t - start, 0), n)

    def build():
        return _multipliers(start, n, config, text_keep, lead.dtype)

    prev_ok, text_prev_ok, has_above = memo(("token_shift", start, n, lead.dtype), build) if memo else build()
    prev = lead[:, w - 1: w - 1 + n]  # position p-1
    # Channels q..d/2 come from the previous position everywhere (text: previous token; image:
    # the cell to the left); channels 0..q from the previous token (text) or the row above (image).
    first = [prev[:, :n_text, :q] * text_prev_ok] if n_text else []
    if n_text < n:
        first.append(lead[:, n_text: n, :q] * has_above)  # position p-w
    first = first[0] if len(first) == 1 else torch.cat(first, dim=1)
    out = torch.cat([first, prev[..., q:] * prev_ok, x[..., half:]], dim=-1)
    return out, lead[:, n:]
