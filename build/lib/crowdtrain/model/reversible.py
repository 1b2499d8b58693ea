"""Reversible residual stack (RevNet coupling) that recomputes activations in backward.

Each layer maps two streams ``(x1, x2) -> (y1, y2)`` with ``y1 = x1 + f(x2)`` and
``y2 = x2 + g(y1)``; the inputs are recovered exactly from the outputs (``x2 = y2 - g(y1)``,
``x1 = y1 - f(x2)``), so the forward pass keeps only the last layer's output and activation
memory does not grow with depth. The price is one extra forward of every layer in backward.

Parameter gradients are accumulated into ``.grad`` by the inner backward calls (as
``loss.backward()`` does); ``torch.autograd.grad(loss, params)`` cannot see them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

# A coupling function: maps a stream tensor to its residual branch.
Branch = Callable[[torch.Tensor], torch.Tensor]


def _autocast_state(x: torch.Tensor):
    device_type = x.device.type
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, branches, *params):
        ctx.branches = branches
        ctx.autocast = _autocast_state(x1)
        with torch.no_grad():
            for f, g in branches:
                x1 = x1 + f(x2)
                x2 = x2 + g(x1)
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        for f, g in reversed(ctx.branches):
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                y1_ = y1.detach().requires_grad_(True)
                g_y1 = g(y1_)
            torch.autograd.backward(g_y1, dy2)
            with torch.no_grad():
                x2 = y2 - g_y1
                dx1 = dy1 + y1_.grad
            del g_y1, y1_
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                x2_ = x2.detach().requires_grad_(True)
                f_x2 = f(x2_)
            torch.autograd.backward(f_x2, dx1)
            with torch.no_grad():
                x1 = y1 - f_x2
                dx2 = dy2 + x2_.grad
            del f_x2, x2_
            y1, y2, dy1, dy2 = x1, x2, dx1, dx2
        return (dy1, dy2, None) + (None,) * len(ctx.needs_input_grad[3:])


def reversible_stack(x: torch.Tensor, branches: Sequence[tuple[Branch, Branch]],
                     params: Sequence[torch.Tensor], *, recompute: bool = True) -> torch.Tensor:
    """Run ``x`` through reversible layers; returns the mean of the two output streams.

    ``params`` are all parameters the branches use; passing them lets autograd know the
    function depends on them (so ``loss.backward()`` reaches it even when ``x`` needs no grad).
    ``recompute=False`` runs the same coupling with plain autograd, storing activations: the
    reference that tests compare against.
    """
    x1 = x2 = x
    if recompute and torch.is_grad_enabled():
        x1, x2 = _ReversibleFunction.apply(x1, x2, list(branches), *params)
    else:
        for f, g in branches:
            x1 = x1 + f(x2)
            x2 = x2 + g(x1)
    return (x1 + x2) / 2
