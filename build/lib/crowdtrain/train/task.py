"""The task interface: what a trainer needs from a model, so another model is a new task, not a fork.

A task builds its model, streams batches for a peer, and computes the loss of a batch. The
trainer (local or in the swarm) knows nothing else about DALL-E.
"""

from __future__ import annotations

import abc
import hashlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from crowdtrain.model.config import ModelConfig
from crowdtrain.model.transformer import DalleTransformer

Batch = dict[str, torch.Tensor]


class Task(abc.ABC):
    """Build a model, stream its batches, compute a batch's loss."""

    name: str = "task"

    @abc.abstractmethod
    def build_model(self) -> nn.Module: ...

    @abc.abstractmethod
    def batches(self, *, batch_size: int, seed_key: str) -> Iterator[Batch]:
        """An endless stream of batches; ``seed_key`` (a peer's identity) decides the shuffle."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(**batch).loss

    def describe(self) -> dict:
        """JSON that another process turns back into the same task (see ``task_from_description``)."""
        return {"name": self.name}


def stable_seed(key: str) -> int:
    """A 63-bit seed from a string that is the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def build_initial_model(task: Task, seed: int) -> nn.Module:
    """The run's initial model, the same bits in every process: built on the CPU from ``seed``
    (``stable_seed(run_id)``), so a peer that joins before the swarm's first step already holds
    the run's state and need not download it (minutes on a home link)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.build_model()


def model_digest(model: nn.Module) -> str:
    """A short digest of every parameter and buffer, by name (any dtype, any device)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class DalleTask(Task):
    """Text-to-image: captions and VQ codes from shards, or synthetic random codes.

    ``data`` is a shard folder, an http(s) base URL or a hub id; or ``"synthetic"`` for uniformly
    random tokens (throughput measurements only: there is nothing to learn in them); or
    ``"pattern"`` for random captions whose image codes are a fixed function of the caption
    (learnable in seconds: the swarm tests use it to see the loss fall without data files).
    """

    name = "dalle"

    def __init__(self, model_config: ModelConfig, *, data: str | Path = "synthetic",
                 text_tokenizer: str | Path | None = None, stream_config=None):
        self.model_config = model_config
        self.data = str(data)
        self.text_tokenizer_path = None if text_tokenizer is None else str(text_tokenizer)
        self.stream_config = stream_config  # a crowdtrain.data.config.StreamConfig; None: its defaults

    def build_model(self) -> DalleTransformer:
        return DalleTransformer(self.model_config)

    def batches(self, *, batch_size: int, seed_key: str) -> Iterator[Batch]:
        if self.data in ("synthetic", "pattern"):
            return self._synthetic(batch_size, seed_key, learnable=self.data == "pattern")
        from crowdtrain.data import batch_stream, default_text_tokenizer, load_text_tokenizer

        tokenizer = (load_text_tokenizer(self.text_tokenizer_path) if self.text_tokenizer_path
                     else default_text_tokenizer())
        extra = {} if self.stream_config is None else {"config": self.stream_config}
        return batch_stream(self.data, text_tokenizer=tokenizer, model_config=self.model_config,
                            batch_size=batch_size, seed_key=seed_key, **extra)

    def _synthetic(self, batch_size: int, seed_key: str, *, learnable: bool) -> Iterator[Batch]:
        cfg = self.model_config
        g = torch.Generator().manual_seed(stable_seed(seed_key))
        cells = torch.arange(cfg.image_len)
        while True:
            if not learnable:
                text = torch.randint(1, cfg.text_vocab_size, (batch_size, cfg.text_len), generator=g)
                image = torch.randint(0, cfg.image_vocab_size, (batch_size, cfg.image_len), generator=g)
            else:  # two caption words decide a striped image; the rest of the caption repeats them
                words = torch.randint(1, min(16, cfg.text_vocab_size), (batch_size, 2), generator=g)
                text = words.repeat(1, (cfg.text_len + 1) // 2)[:, : cfg.text_len]
                image = (words[:, :1] * 7 + words[:, 1:] * (cells[None] % cfg.image_width)) % cfg.image_vocab_size
            yield {"text": text, "image": image}

    def describe(self) -> dict:
        return {"name": self.name, "model": self.model_config.to_dict(), "data": self.data,
                "text_tokenizer": self.text_tokenizer_path}


def task_from_description(d: dict) -> Task:
    if d.get("name") != DalleTask.name:
        raise ValueError(f"unknown task {d.get('name')!r}; this crowdtrain knows: {DalleTask.name!r}")
    return DalleTask(ModelConfig.from_dict(d["model"]), data=d.get("data", "synthetic"),
                     text_tokenizer=d.get("text_tokenizer"))
