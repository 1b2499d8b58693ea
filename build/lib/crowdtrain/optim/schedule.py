"""Learning-rate schedule and weight-decay groups (the paper's LAMB recipe, any optimizer).

The schedule is keyed on an epoch/step counter, not wall time, so a peer that joins late
and reads the global epoch gets exactly the rate everyone else uses.
"""

from __future__ import annotations

import threading

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


class Schedule:
    """The run's learning-rate schedule as a swarm peer's optimizer reads it at every step: warm-up
    over ``warmup_epochs``, then linear decay to zero at ``total_epochs``, keyed on the global
    epoch (:func:`linear_warmup_decay` per epoch in sync mode, :func:`warmup_decay_at` on the
    fractional epoch in DiLoCo mode).

    Unlike the frozen ``SwarmConfig.total_epochs`` (the value the peer joined with), this one moves
    while the peer trains: the organizer extends a live run, or the coordinator sizes the total to
    a time budget, and each volunteer learns it from the coordinator within a poll period
    (``crowdtrain.swarm.schedule_watch``). The rate at an epoch is then the one a run planned with
    the new total from the start uses there: nothing already trained is undone, and every peer,
    newcomers included, computes the same rate from the same two numbers.

    ``total_epochs=None``: the total is not known yet (a time budget still being sized): after the
    warm-up the rate holds at its peak, which the decay of the total fixed later starts from.

    Thread-safe: the watcher updates it from its own thread while optimizers read it.
    """

    def __init__(self, *, warmup_epochs: int, total_epochs: int | None):
        self._lock = threading.Lock()
        self._check(warmup_epochs, total_epochs)
        self._warmup, self._total = int(warmup_epochs), None if total_epochs is None else int(total_epochs)

    @classmethod
    def from_config(cls, config) -> "Schedule":
        """The schedule of a ``SwarmConfig`` (``warmup_epochs``, ``total_epochs``)."""
        return cls(warmup_epochs=config.warmup_epochs, total_epochs=config.total_epochs)

    @staticmethod
    def _check(warmup_epochs: int, total_epochs: int | None) -> None:
        if warmup_epochs < 0 or (total_epochs is not None and total_epochs <= warmup_epochs):
            raise ValueError(f"a schedule needs 0 <= warmup_epochs < total_epochs, got {warmup_epochs} and "
                             f"{total_epochs}")

    @property
    def warmup_epochs(self) -> int:
        return self._warmup

    @property
    def total_epochs(self) -> int | None:
        return self._total

    def update(self, *, warmup_epochs: int, total_epochs: int | None) -> bool:
        """Take a new schedule (checked as at construction); whether it differs from the current one."""
        self._check(warmup_epochs, total_epochs)
        with self._lock:
            changed = (warmup_epochs, total_epochs) != (self._warmup, self._total)
            self._warmup, self._total = int(warmup_epochs), None if total_epochs is None else int(total_epochs)
        return changed

    def factor_at(self, position: float) -> float:
        """Multiplier of the peak rate at a fractional global epoch (DiLoCo's inner steps)."""
        with self._lock:
            warmup, total = self._warmup, self._total
        if total is None:  # the same warm-up; then the peak until a total is fixed
            return max(0.0, position) / warmup if position < warmup else 1.0
        return warmup_decay_at(position, warmup=warmup, total=total)

    def step_factor(self, step: int) -> float:
        """Multiplier of the peak rate for the optimizer step into epoch ``step + 1`` (sync mode's
        scheduler, keyed on the epoch as :func:`linear_warmup_decay`)."""
        with self._lock:
            warmup, total = self._warmup, self._total
        if total is None:
            return (step + 1) / warmup if step < warmup else 1.0
        return linear_warmup_decay(step, warmup_steps=warmup, total_steps=total)

    def finished(self, epoch: int) -> bool:
        """Whether a swarm at global epoch ``epoch`` has reached the end of the schedule."""
        total = self._total
        return total is not None and epoch >= total

    def __repr__(self) -> str:
        return f"Schedule(warmup_epochs={self._warmup}, total_epochs={self._total})"


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
