"""The run's collaboration settings, shared by every peer (the coordinator hands them out as JSON).

Tuning by symptom:
- "Averaging gradients failed ... could not find a group" or rounds with fewer peers than are
  alive: raise ``matchmaking_time_s`` (3-5 s on one machine or a LAN, 10-15 s over the Internet).
- Rounds that time out while data is still flowing: raise ``averaging_timeout_s`` to about twice
  the measured all-reduce time (slow uplinks need more).
- Peers spending much of their time waiting on averaging: raise ``target_batch_size`` so each
  epoch holds more compute per round of communication.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SwarmConfig:
    run_id: str = "crowdtrain"
    # One global epoch = one optimizer step, taken when the swarm together has accumulated
    # this many samples, however they are spread over peers.
    target_batch_size: int = 4096
    matchmaking_time_s: float = 5.0
    averaging_timeout_s: float = 60.0
    load_state_timeout_s: float = 120.0
    average_state_every: int = 1  # epochs between parameter/optimizer-state averaging rounds
    # Wire compression: 8-bit quantization for tensors with at least this many elements,
    # fp16 for smaller float tensors, integer tensors (8-bit optimizer codes) as they are.
    compression_threshold: int = 2**16
    # Optimizer: LAMB with 8-bit states (bitsandbytes), the paper's hyper-parameters.
    lr: float = 2.5e-3
    betas: tuple[float, float] = (0.9, 0.96)
    eps: float = 1e-6
    weight_decay: float = 0.045
    clip_grad_norm: float = 4.0
    warmup_epochs: int = 100  # linear warm-up, then linear decay to zero at total_epochs
    total_epochs: int = 1000
    delay_optimizer_step: bool = True  # the optimizer step overlaps the next step's compute
    offload_optimizer: bool = True  # optimizer state lives on the CPU on GPU peers
    checkpoint_every_epochs: int = 10  # the coordinator's auxiliary peer saves this often

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        if not self.run_id or not self.run_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--run-id must be letters, digits, '-' or '_', got {self.run_id!r}")
        if self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be >= 1, got {self.target_batch_size}")
        if self.matchmaking_time_s <= 0 or self.averaging_timeout_s <= self.matchmaking_time_s:
            raise ValueError("averaging_timeout_s must exceed matchmaking_time_s > 0 "
                             f"(got {self.averaging_timeout_s} and {self.matchmaking_time_s})")
        if not 0 <= self.warmup_epochs < self.total_epochs:
            raise ValueError(f"warmup_epochs ({self.warmup_epochs}) must be below total_epochs ({self.total_epochs})")
        if self.compression_threshold < 1:
            raise ValueError("compression_threshold must be >= 1")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SwarmConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown swarm setting(s) {unknown}; this crowdtrain knows {sorted(known)}: "
                             "upgrade crowdtrain to join this run")
        return cls(**d)


def demo_swarm_config(run_id: str = "demo") -> SwarmConfig:
    """Settings for a swarm on one small machine: short epochs so the loss moves in minutes."""
    # Epochs of a few seconds (several matchmaking windows, so rounds do not miss each other);
    # a higher LAMB rate than the paper's because the demo takes tens of steps, not thousands.
    return SwarmConfig(run_id=run_id, target_batch_size=256, matchmaking_time_s=3.0, averaging_timeout_s=30.0,
                       lr=0.01, warmup_epochs=5, total_epochs=150, checkpoint_every_epochs=5)
