"""Learning-rate schedule and weight-decay groups (the paper's LAMB recipe, any optimizer).

The schedule is keyed on an epoch/step counter, not wall time, so a peer that joins late
and reads the global epoch gets exactly the rate everyone else uses.
"""

from __future__ import annotations

from torch import nn


def linear_warmup_decay(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak rate for the optimizer step ``step`` (0, 1, 2...): linear 1/warmup -> 1
    over warm-up (the first step is not wasted at rate 0), then linear 1 -> 0 at total_steps."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    remaining = total_steps - warmup_steps
    return max(0.0, 1.0 - (step - warmup_steps) / max(1, remaining))


def warmup_decay_at(position: float, *, warmup: float, total: float) -> float:
    """The same shape on a continuous position, for a rate that moves within an epoch (DiLoCo's
    inner steps, keyed on the global epoch plus the share of its batch done): 0 at position 0,
    1 at ``warmup``, 0 at ``total``.

    Warm-up here must start from zero, not from ``1/warmup`` as the stepwise form does: with
    ``warmup`` = 2 epochs of ~16 inner AdamW steps, starting at half the peak rate left the demo
    swarm at 0.84 held-out loss after 11.5k samples against 0.65 starting from zero
    (``benchmarks/bench_diloco_outer.py``, one process; no warm-up at all: 1.51).
    """
    if total <= 0:
        raise ValueError(f"total must be positive, got {total}")
    if position < warmup:
        return max(0.0, position) / warmup
    return max(0.0, 1.0 - (position - warmup) / max(1e-9, total - warmup))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms, biases (1-D tensors) are not decayed, as in the paper.

    The tied embedding is a matrix and is decayed. Shared parameters appear once.
    """
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() de-duplicates shared tensors
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
