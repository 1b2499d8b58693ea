"""What a volunteer's process pays at start: bitsandbytes without compiling at import."""

import subprocess
import sys

import torch

from crowdtrain.swarm.lamb import compile_on_first_call

LIGHT_IMPORT = """
import sys, torch
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm.lamb import make_lamb
heavy = [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]
print(heavy)
model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))
optimizer = make_lamb(list(model.parameters()), SwarmConfig())
before = [p.detach().clone() for p in model.parameters()]
model(torch.randn(4, 128)).square().sum().backward()
optimizer.step()
moved = all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
print(moved)
"""


def test_bitsandbytes_imports_without_torchdynamo_or_inductor_and_its_optimizer_steps():
    # bitsandbytes wraps fallback kernels in torch.compile at import (TorchDynamo and Inductor:
    # seconds of imports in every volunteer's process); its 8-bit optimizer never runs them.
    out = subprocess.run([sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:-1] == ["[]", "True"], out.stdout


def test_compile_on_first_call_compiles_at_the_first_call_and_puts_torch_compile_back():
    eager = torch.compile

    def double(x):
        return 2 * x

    with compile_on_first_call():
        wrapped = torch.compile(double, backend="eager")
        decorated = torch.compile(backend="eager")(double)
    assert torch.compile is eager
    assert wrapped.__name__ == decorated.__name__ == "double"
    x = torch.arange(3.0)
    assert torch.equal(wrapped(x), 2 * x) and torch.equal(decorated(x), 2 * x)
    assert "torch._dynamo" in sys.modules  # loaded by now (the first call compiles, if nothing else did)
