"""Dynamic loss scaling for fp16 autocast under an optimizer that is not torch's.

fp16 holds nothing below ~6e-8, so small gradients of a deep model flush to zero in backward.
Scaling the loss by ``scale`` before backward lifts them into range; dividing the gradients by
``scale`` before the optimizer sees them undoes it. ``torch.amp.GradScaler`` cannot do this for
the swarm: its ``unscale_`` and ``step`` work on the optimizer's own parameters, and hivemind's
optimizer steps offloaded copies of them (on the CPU, in another thread when the update is
delayed), so the model's gradients must already be unscaled when ``optimizer.step()`` is called.

The scale halves whenever a gradient overflows (that batch is dropped, as any non-finite batch
is) and doubles after ``growth_interval`` finite steps. If many batches are dropped at the start
of a run, lower ``init_scale``; if the scale keeps halving late in a run, the model itself is
overflowing in fp16: use bf16 where the GPU has it.
"""

from __future__ import annotations

import torch


class LossScale:
    """Scale the loss up, the gradients back down, and adapt the scale to overflows.

    Disabled (``enabled=False``: fp32 and bf16) it is the identity and never changes.
    """

    def __init__(self, *, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 backoff_factor: float = 0.5, growth_factor: float = 2.0, min_scale: float = 1.0):
        if init_scale <= 0 or growth_interval < 1 or not 0 < backoff_factor < 1 or growth_factor <= 1:
            raise ValueError("loss scaling needs init_scale > 0, growth_interval >= 1, 0 < backoff_factor < 1 "
                             "and growth_factor > 1")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval, self.backoff_factor = growth_interval, backoff_factor
        self.growth_factor, self.min_scale = growth_factor, min_scale
        self._finite_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, grads) -> None:
        """Divide the gradients (the model's ``p.grad``; None entries skipped) by the scale, in place."""
        grads = [g for g in grads if g is not None]
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, *, finite: bool) -> None:
        """After each backward: ``finite`` says whether the (scaled) gradients were all finite."""
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self._finite_steps = 0
            return
        self._finite_steps += 1
        if self._finite_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._finite_steps = 0
