"""Learning-rate schedule and weight-decay groups (the paper's LAMB recipe, any optimizer).

The schedule is keyed on an epoch/step counter, not wall time, so a peer that joins late
and reads the global epoch gets exactly the rate everyone else uses.
"""

from __future__ import annotations

from torch import nn


def linear_warmup_decay(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak rate: linear 0 -> 1 over warm-up, then linear 1 -> 0 at total_steps."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if step < warmup_steps:  # fractional steps (DiLoCo's inner rate, keyed on epoch progress) stay <= 1
        return min(1.0, (step + 1) / warmup_steps)
    remaining = total_steps - warmup_steps
    return max(0.0, 1.0 - (step - warmup_steps) / max(1, remaining))


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
