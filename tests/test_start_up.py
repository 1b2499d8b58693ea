"""What a volunteer's process pays at start: bitsandbytes without compiling at import, and no
TorchDynamo (about 1 s of CPU) for an optimizer or the model's fingerprint."""

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

# What a volunteer does that once imported TorchDynamo: the model's fingerprint (from the model it
# built), its 8-bit optimizer's steps, state and zeroing; and its training steps.
NO_DYNAMO = """
import sys, torch
from crowdtrain.model.config import get_preset
from crowdtrain.model.info import architecture_fingerprint
from crowdtrain.runspec.swarm import SwarmConfig
from crowdtrain.swarm.lamb import make_lamb
from crowdtrain.train.task import DalleTask, build_initial_model
config = get_preset("tiny")
model = build_initial_model(DalleTask(config), 1)
fingerprint = architecture_fingerprint(config, model)
optimizer = make_lamb(list(model.parameters()), SwarmConfig())
batches = DalleTask(config, data="pattern").batches(batch_size=2, seed_key="peer")
for _ in range(2):
    model(**next(batches)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
print("torch._dynamo" in sys.modules)
import torch._dynamo  # as a torch.compile would: from now on these functions are kept out of it
optimizer.zero_grad()
disabled = torch.optim.Optimizer.zero_grad.__wrapped__.__dynamo_disable
print(getattr(disabled, "_torchdynamo_disable", False)
      and disabled._torchdynamo_orig_callable is torch.optim.Optimizer.zero_grad.__wrapped__)
print(fingerprint == architecture_fingerprint(config))
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


def test_a_volunteers_fingerprint_and_optimizer_leave_torchdynamo_unimported_until_something_compiles():
    out = subprocess.run([sys.executable, "-c", NO_DYNAMO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    not_loaded, disabled_once_loaded, same_fingerprint = out.stdout.split()[-3:]
    assert not_loaded == "False", "TorchDynamo was imported before anything compiled"
    assert disabled_once_loaded == "True", "once TorchDynamo is loaded, the optimizer's methods are kept out of it"
    assert same_fingerprint == "True", "the fingerprint of a built model is the meta-device build's"
