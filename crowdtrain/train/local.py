"""Training in one process: the reference the swarm is compared with, and `make demo`'s first job.

One dense line per logged step: step, loss (mean since the last line), samples/s, learning
rate. At the end a checkpoint and ``summary.json`` in the output folder.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from crowdtrain.checkpoint import checkpoint_name, save_checkpoint
from crowdtrain.optim import linear_warmup_decay, param_groups
from crowdtrain.train.task import Task

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "lamb8bit")


@dataclass
class LocalTrainConfig:
    batch_size: int = 32
    max_steps: int = 1000  # also the length of the LR schedule, unless schedule_steps is given
    # A schedule longer than the run (as a swarm's ``total_epochs`` that a short run never reaches):
    # the rate is still high when training stops. For measuring what that costs.
    schedule_steps: int | None = None
    # Stop when this much wall time has passed; the LR schedule is then shortened to the steps
    # that fit, estimated from the first steps' speed, so the rate still decays to zero.
    max_minutes: float | None = None
    lr: float = 3e-3
    # "adamw", or "lamb8bit": the swarm's sync-mode optimizer (bitsandbytes), to compare a swarm
    # with one process on equal optimizer settings.
    optimizer: str = "adamw"
    warmup_steps: int = 50
    weight_decay: float = 0.045
    clip_grad_norm: float = 4.0
    device: str = "cpu"
    precision: str = "fp32"  # bf16 / fp16 autocast where the device supports it
    seed: int = 0
    log_every: int = 10
    # Also write a checkpoint every this many steps (for learning curves); None: only at the end.
    save_every_steps: int | None = None
    out_dir: str = "runs/local"

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1 or None, got {self.save_every_steps}")
        if self.schedule_steps is not None and self.schedule_steps <= self.warmup_steps:
            raise ValueError(f"schedule_steps ({self.schedule_steps}) must exceed --warmup-steps ({self.warmup_steps})")
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"--warmup-steps ({self.warmup_steps}) must be below --max-steps ({self.max_steps})")


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("fp16 autocast needs a GPU; use --precision bf16 or fp32 on CPU")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU has no bf16 (it came with Ampere); use --precision fp16, which is loss-scaled")
    return torch.autocast(device.type, dtype=dtype)


def make_optimizer(model: torch.nn.Module, config: LocalTrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, config.weight_decay)
    if config.optimizer == "lamb8bit":
        from crowdtrain.runspec.swarm import SwarmConfig
        from crowdtrain.swarm.lamb import make_lamb

        return make_lamb(groups, SwarmConfig(lr=config.lr, weight_decay=config.weight_decay,
                                             clip_grad_norm=config.clip_grad_norm))
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.96), eps=1e-6)


def train_local(task: Task, config: LocalTrainConfig, *, assets: dict[str, str | Path] | None = None) -> dict:
    """Train ``task`` for ``config.max_steps`` steps (or ``max_minutes``); returns the summary."""
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA device; use --device cpu")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = task.build_model().to(device)
    model.train()
    optimizer = make_optimizer(model, config)
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    batches = task.batches(batch_size=config.batch_size, seed_key=f"local-{config.seed}")
    logger.info("training %s: %s parameters, %s", task.name, f"{sum(p.numel() for p in model.parameters()):,}",
                json.dumps(asdict(config)))

    losses: list[float] = []
    window: list[float] = []
    start = last_log = time.perf_counter()
    samples_since_log = 0
    schedule_steps, warmup_steps = config.schedule_steps or config.max_steps, config.warmup_steps
    for step in range(config.max_steps):
        if config.max_minutes is not None and config.schedule_steps is None and step == 5:
            seconds_per_step = (time.perf_counter() - start) / 5
            fit = int(60 * config.max_minutes / seconds_per_step)
            schedule_steps = max(10, min(config.max_steps, fit))
            warmup_steps = min(config.warmup_steps, schedule_steps // 10)
            logger.info("%.2f s/step: about %d steps fit in %.1f min; LR schedule set to %d steps",
                        seconds_per_step, fit, config.max_minutes, schedule_steps)
        if config.schedule_steps is None and step >= schedule_steps:  # the time-sized schedule has ended
            break
        scale = linear_warmup_decay(step, warmup_steps=warmup_steps, total_steps=schedule_steps)
        for group in optimizer.param_groups:
            group["lr"] = config.lr * scale
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with autocast_context(device, config.precision):
            loss = task.loss(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss became {loss.item()} at step {step}: lower --lr or use --precision fp32")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if config.optimizer == "adamw":  # the LAMB clips the gradient itself, as in the swarm
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        window.append(losses[-1])
        samples_since_log += config.batch_size
        now = time.perf_counter()
        if (step + 1) % config.log_every == 0 or step == 0:
            logger.info("step %5d | loss %.4f | %6.1f samples/s | lr %.2e", step + 1, sum(window) / len(window),
                        samples_since_log / max(now - last_log, 1e-9), config.lr * scale)
            window, samples_since_log, last_log = [], 0, now
        if config.save_every_steps and (step + 1) % config.save_every_steps == 0:
            save_checkpoint(out / "checkpoints" / checkpoint_name(step + 1), model, step=step + 1, loss=losses[-1],
                            run_config={"task": task.describe(), "train": asdict(config),
                                        "samples": (step + 1) * config.batch_size, "seconds": now - start},
                            assets=assets)
        if config.max_minutes is not None and now - start > 60 * config.max_minutes:
            logger.info("time limit of %.1f min reached after %d steps", config.max_minutes, step + 1)
            break

    seconds = time.perf_counter() - start
    steps = len(losses)
    head = losses[: max(1, min(10, steps // 10 or 1))]
    tail = losses[-max(1, min(20, steps // 5 or 1)):]
    summary = {
        "task": task.describe(), "steps": steps, "samples": steps * config.batch_size, "seconds": seconds,
        "samples_per_s": steps * config.batch_size / seconds,
        "loss_start": sum(head) / len(head), "loss_end": sum(tail) / len(tail),
        "losses": losses,
    }
    ckpt = save_checkpoint(out / "checkpoints" / checkpoint_name(steps), model, step=steps, loss=summary["loss_end"],
                           run_config={"task": task.describe(), "train": asdict(config),
                                       "samples": steps * config.batch_size, "seconds": seconds}, assets=assets)
    summary["checkpoint"] = str(ckpt)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if not math.isfinite(summary["loss_end"]):
        raise FloatingPointError("training ended with a non-finite loss")
    return summary
