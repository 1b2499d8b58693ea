"""Mixed precision on a GPU, where the CPU can show it: fp16 loss scaling for the swarm peer,
whose optimizer (hivemind's) steps copies of the parameters, so torch's GradScaler cannot unscale
for it (crowdtrain.optim.loss_scale); and bf16 refused, with the fix, on a GPU that lacks it."""

from unittest import mock

import pytest
import torch

from crowdtrain.optim.loss_scale import LossScale
from crowdtrain.swarm.optimizer import all_finite
from crowdtrain.swarm.peer import backward_checked
from crowdtrain.train.local import autocast_context


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
    with mock.patch("torch.cuda.is_bf16_supported", return_value=False), \
            pytest.raises(ValueError, match="precision fp16"):
        autocast_context(torch.device("cuda"), "bf16")


class HalfChain(torch.nn.Module):
    """A loss whose gradient (1e-8 per weight) passes through fp16, as under fp16 autocast."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, factor: float = 1.0) -> torch.Tensor:
        small = torch.tensor(1e-4, dtype=torch.float16)
        return ((self.w.half() * small) * small).float().sum() * factor


def test_the_peers_backward_keeps_small_fp16_gradients_and_drops_an_overflow():
    """The swarm peer's step (crowdtrain.swarm.peer.backward_checked) with --precision fp16:
    the gradient the optimizer sees is the true one, and an overflowing batch is refused and
    halves the scale instead of reaching the optimizer."""
    # 2**14: the default 2**16 would overflow fp16 (max 65504) at this loss itself, and the
    # scale would halve twice before the first kept batch.
    model, scale = HalfChain(), LossScale(enabled=True, init_scale=2.0**14)
    assert backward_checked(model(), model, scale, all_finite)
    torch.testing.assert_close(model.w.grad, torch.full((3,), 1e-8), rtol=1e-2, atol=0)
    model.w.grad = None
    assert not backward_checked(model(float("inf")), model, scale, all_finite)
    assert scale.scale == 2.0**13
    # Unscaled: fp16 flushes the same gradient to zero.
    model.w.grad = None
    assert backward_checked(model(), model, LossScale(enabled=False), all_finite)
    assert torch.equal(model.w.grad, torch.zeros(3))
