"""Optimizer pieces shared by the local trainer and the swarm: parameter groups and schedules."""

from crowdtrain.optim.schedule import Schedule, linear_warmup_decay, param_groups, warmup_decay_at

__all__ = ["Schedule", "linear_warmup_decay", "param_groups", "warmup_decay_at"]
