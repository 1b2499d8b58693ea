"""Mixed precision on a GPU, where the CPU can show it: fp16 loss scaling for the swarm peer,
whose optimizer (hivemind's) steps copies of the parameters, so torch's GradScaler cannot unscale
for it (crowdtrain.optim.loss_scale); and bf16 refused, with the fix, on a GPU that lacks it."""

from unittest import mock

import pytest
import torch

from crowdtrain.optim.loss_scale import LossScale
from crowdtrain.train.local import autocast_context


def half_chain_grad(loss_scale: LossScale) -> torch.Tensor:
    """The gradient of w through fp16 ops whose true value, 1e-8, is below fp16's smallest number."""
    w = torch.ones(3, requires_grad=True)
    small = torch.tensor(1e-4, dtype=torch.float16)
    loss = ((w.half() * small) * small).float().sum()
    loss_scale.scale_loss(loss).backward()
    loss_scale.unscale_([w.grad])
    return w.grad


def test_scaling_keeps_fp16_gradients_that_underflow_without_it():
    assert torch.equal(half_chain_grad(LossScale(enabled=False)), torch.zeros(3))  # flushed to zero
    # 2**14, not the default 2**16: that would overflow fp16 (max 65504) at the loss itself here,
    # and the scale would halve twice before the first kept step.
    grad = half_chain_grad(LossScale(enabled=True, init_scale=2.0**14))
    torch.testing.assert_close(grad, torch.full((3,), 1e-8), rtol=1e-2, atol=0)


def test_scale_halves_on_overflow_and_grows_after_a_run_of_finite_steps():
    scale = LossScale(enabled=True, init_scale=1024.0, growth_interval=3)
    scale.update(finite=False)
    assert scale.scale == 512.0
    for _ in range(2):
        scale.update(finite=True)
    scale.update(finite=False)  # an overflow halves the scale and restarts the count
    assert scale.scale == 256.0
    for expected in (256.0, 256.0, 512.0, 512.0):
        scale.update(finite=True)
        assert scale.scale == expected


def test_disabled_scaling_is_the_identity():
    scale = LossScale(enabled=False)
    loss = torch.tensor(3.0)
    grad = torch.ones(2)
    scale.update(finite=False)
    scale.unscale_([grad, None])
    assert scale.scale_loss(loss) is loss and torch.equal(grad, torch.ones(2)) and scale.scale == 1.0


def test_bf16_on_a_gpu_without_it_is_refused_with_the_fix():
    # Checked before torch.autocast("cuda") is built, so a CPU-only torch reaches the check too.
    with mock.patch("torch.cuda.is_bf16_supported", return_value=False):
        with pytest.raises(ValueError, match="precision fp16"):
            autocast_context(torch.device("cuda"), "bf16")
