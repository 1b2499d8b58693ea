"""The swarm's 8-bit LAMB: the inner optimizer of sync mode, and of DiLoCo mode with
``inner_optimizer="lamb8bit"``; also what ``train/local.py`` compares a swarm against.

Both optimizer modes build it from here (``crowdtrain.swarm.optimizer`` for sync mode,
``crowdtrain.swarm.diloco`` for DiLoCo), so neither imports the other for it. It needs
bitsandbytes, not hivemind.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from crowdtrain.runspec.swarm import SwarmConfig


@contextlib.contextmanager
def compile_on_first_call():
    """``torch.compile`` that compiles a function on its first call, not when it is wrapped.

    bitsandbytes wraps its pure-PyTorch fallback kernels in ``torch.compile`` at import, and
    ``torch.compile`` imports TorchDynamo and Inductor whole. The 8-bit optimizer never calls
    those fallbacks (the CPU and CUDA libraries have their own kernels), so deferring the compile
    to a first call costs nothing and saves every volunteer's process about 1.5 s of CPU at start
    (importing this module and building the optimizer: 3.5 s before, 2.1 s after, on a 2-core
    CPU; the rest is the part of TorchDynamo that torch's ``Optimizer`` imports when built). A
    failed compile still raises at the call, where bitsandbytes' wrapper falls back to the plain
    function, as it does at import.
    """
    eager = torch.compile

    def deferred(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = eager(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = eager


def _caches_its_disabled_function() -> bool:
    """Whether this torch's ``_disable_dynamo`` wrapper keeps what it calls in the wrapped
    function's ``__dynamo_disable`` attribute (the hook :func:`dynamo_on_first_compile` uses)."""
    disable = getattr(torch._compile, "_disable_dynamo", None)
    nested = [c for c in getattr(getattr(disable, "__code__", None), "co_consts", ()) if hasattr(c, "co_names")]
    return any("__dynamo_disable" in c.co_names for c in nested)


def _disabled_once_loaded(fn, recursive: bool):
    """What ``fn``'s ``_disable_dynamo`` wrapper calls: ``fn`` itself while TorchDynamo is not
    loaded (nothing can be compiling then, so there is nothing to disable), and once it is,
    ``torch._dynamo.disable(fn)`` as torch would have built it, kept in its place."""

    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = disabled
        return disabled(*args, **kwargs)

    return call


@contextlib.contextmanager
def dynamo_on_first_compile():
    """Functions that torch keeps TorchDynamo out of (``torch._disable_dynamo``) import it on
    their first call, about 1 s of CPU: every ``torch.optim.Optimizer`` (its ``add_param_group``,
    ``zero_grad``, ``state_dict``) and each of bitsandbytes' kernels, registered as torch custom
    ops, so every volunteer's and auxiliary peer's process paid it at its first optimizer.
    Nothing in these processes compiles: the import is deferred until something loads TorchDynamo
    (a ``torch.compile``'s first call), and from then on the functions are disabled as torch
    would. Within the block, functions wrapped by ``torch._disable_dynamo`` (bitsandbytes'
    kernels, registered at its import) defer too; torch's optimizer methods always do from the
    first use of this. A torch whose wrapper works otherwise is left as it is (slower, not wrong)."""
    if not _caches_its_disabled_function():
        yield
        return
    eager = torch._disable_dynamo

    def defer(fn=None, recursive: bool = True):
        if fn is None:  # used as @torch._disable_dynamo(recursive=...)
            return functools.partial(defer, recursive=recursive)
        if getattr(fn, "__dynamo_disable", None) is None:
            fn.__dynamo_disable = _disabled_once_loaded(fn, recursive)
        return eager(fn, recursive)

    for method in vars(torch.optim.Optimizer).values():  # wrapped when torch was imported
        inner = getattr(method, "__wrapped__", None)
        if getattr(getattr(method, "__code__", None), "co_filename", None) == torch._compile.__file__ and inner:
            defer(inner)
    torch._disable_dynamo = defer
    try:
        yield
    finally:
        torch._disable_dynamo = eager


with compile_on_first_call(), dynamo_on_first_compile():
    import bitsandbytes as bnb


class ClippedLAMB8bit(bnb.optim.AdamW8bit):
    """LAMB with bitsandbytes' 8-bit Adam statistics, that first clips the (averaged) gradient's
    global norm.

    Its statistics exist from construction (zeros, step 0), as they would before a first step.
    hivemind runs one optimizer step on zero gradients to create the state of an optimizer that
    has none; for Adam-like rules that step counts in the bias correction, so every real step
    after it was corrected as one step later: the first update came out 0.74x as large, and
    the swarm stopped matching one process with the same settings (tests/test_equivalence.py).
    """

    def __init__(self, params, *, clip_grad_norm: float, **kwargs):
        # Not bitsandbytes' LAMB8bit: its 8-bit kernels (tensors of 4096+ elements) ignore the
        # trust ratio, so the big matrices take plain Adam steps (50-140% of a weight's norm in
        # one step at lr 0.01, where LAMB moves it by lr = 1%), and its 32-bit path clips the
        # update to the weight's norm, so zero-initialised biases never move. bitsandbytes' AdamW
        # computes u = adam + weight_decay * w here, ``update_step`` scales it by the trust ratio.
        super().__init__(params, **kwargs)
        self.clip_grad_norm = clip_grad_norm
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if len(self.state[p]) == 0:
                    self.init_state(group, p, gindex, pindex)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        """bitsandbytes' Adam step (with decoupled weight decay), scaled per matrix by LAMB's trust
        ratio ||w|| / ||u||: the step moves a matrix by ``lr`` times its norm (a matrix or update of
        norm zero takes the plain step). Vectors (biases, norms' gains, LayerScale) take the plain
        AdamW step: the layer-wise ratio would pin a zero-initialised bias at zero and move a
        gain of ones by ``lr`` times sqrt(width) at once."""
        if p.dim() < 2:  # biases, norms, LayerScale: plain AdamW steps, as BERT's LAMB excludes them
            return super().update_step(group, p, gindex, pindex)
        before = p.detach().clone()
        super().update_step(group, p, gindex, pindex)
        step = p.detach() - before
        weight_norm, step_norm = before.float().norm(), step.float().norm()
        if weight_norm > 0 and step_norm > 0:
            trust = (group["lr"] * weight_norm / step_norm).item()  # ||step|| = lr * ||u||
            p.copy_(before.add_(step, alpha=trust))

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if self.clip_grad_norm and params:
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        return super().step(closure)


def make_lamb(params, config: SwarmConfig) -> ClippedLAMB8bit:
    return ClippedLAMB8bit(params, lr=config.lr, betas=config.betas, eps=config.eps,
                           weight_decay=config.weight_decay, clip_grad_norm=config.clip_grad_norm)
