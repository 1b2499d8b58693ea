"""Attacks to test robust aggregation against: a peer that sends crafted tensors.

A volunteer started with ``--inject-fault attack=NAME`` replaces what it sends in every gradient
(sync mode) or pseudo-gradient (DiLoCo mode) averaging round by a crafted version of its honest
tensor ``g``, and still applies the group's result itself, as an attacker that wants to stay in
the swarm would. Magnitudes are relative to each tensor's RMS, so one attack works on gradients
and on pseudo-gradients alike:

- ``scale``: ``1000 g``;
- ``sign_flip``: ``-g``;
- ``noise``: Gaussian noise of 100 times ``g``'s RMS instead of ``g``;
- ``nan``: NaN in the first half of every tensor, +inf in the second;
- ``bias``: ``g + 10 rms(g)`` in every element (a constant push in one direction);
- ``weight``: the ``bias`` push, sent with 1000 times the peer's weight (its sample count) so that
  a weighted rule follows it.

Testing aid only: honest peers never send non-finite values (``crowdtrain.swarm.peer`` drops
such batches), and every reducer drops non-finite parts whatever the aggregation rule.
"""

from __future__ import annotations

import torch


class Attack:
    name = "base"
    weight_factor = 1.0  # the weight sent, in times the honest one

    def craft(self, honest: torch.Tensor) -> torch.Tensor:
        """The tensor to send instead of ``honest`` (may modify and return it)."""
        raise NotImplementedError


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.float().pow(2).mean().sqrt()


class ScaleAttack(Attack):
    name = "scale"
    factor = 1000.0

    def craft(self, honest):
        return honest.mul_(self.factor)


class SignFlipAttack(Attack):
    name = "sign_flip"

    def craft(self, honest):
        return honest.neg_()


class NoiseAttack(Attack):
    name = "noise"
    relative_std = 100.0

    def craft(self, honest):
        return torch.randn_like(honest) * (self.relative_std * _rms(honest))


class NanAttack(Attack):
    name = "nan"

    def craft(self, honest):
        flat = honest.view(-1)
        half = (flat.numel() + 1) // 2
        flat[:half] = float("nan")
        flat[half:] = float("inf")
        return honest


class BiasAttack(Attack):
    name = "bias"
    relative_bias = 10.0

    def craft(self, honest):
        return honest.add_(self.relative_bias * _rms(honest))


class WeightAttack(BiasAttack):
    name = "weight"
    weight_factor = 1000.0  # times the weight it should send


ATTACKS = {cls.name: cls for cls in (ScaleAttack, SignFlipAttack, NoiseAttack, NanAttack, BiasAttack, WeightAttack)}


def parse_fault(fault: str | None) -> None:
    """Check an ``--inject-fault`` value: ``nan-every=K``, ``attack=NAME`` or ``slow-upload=S``."""
    if fault is None:
        return
    kind, _, value = fault.partition("=")
    if kind == "nan-every" and value.isdigit() and int(value) > 0:
        return
    if kind == "slow-upload" and upload_delay_from_fault(fault) > 0:
        return
    if kind == "attack" and value in ATTACKS:
        return
    raise ValueError(f"--inject-fault takes nan-every=K with K >= 1, attack=NAME with NAME one of "
                     f"{sorted(ATTACKS)}, or slow-upload=S with 0 < S <= 600 seconds, got {fault!r}")


def upload_delay_from_fault(fault: str | None) -> float:
    """``slow-upload=S``: this peer holds every state it sends S seconds (a slow uplink); else 0.
    A downloader gives up on a donor silent for longer than its chunk timeout (a quarter of
    ``averaging_timeout_s``): keep S below that to test slowness rather than failure."""
    kind, _, value = (fault or "").partition("=")
    if kind != "slow-upload":
        return 0.0
    try:
        delay = float(value)
    except ValueError:
        return 0.0
    return delay if 0 < delay <= 600 else 0.0


def attack_from_fault(fault: str | None) -> Attack | None:
    parse_fault(fault)
    if fault and fault.startswith("attack="):
        return ATTACKS[fault.partition("=")[2]]()
    return None
