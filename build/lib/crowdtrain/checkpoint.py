"""Checkpoints as data only: safetensors tensors plus JSON, never pickle.

A checkpoint is a directory::

    config.json                  {"model": ModelConfig dict, "fingerprint", "step", "loss", "run": {...},
                                  "valid_loss": {split: loss}, "valid_rows": {split: rows}}
    model.safetensors            the model's state dict
    optimizer.safetensors        optional: optimizer tensors (flat names), JSON meta in its metadata
    text_tokenizer.json          optional assets copied in, so a checkpoint decodes on its own
    image_tokenizer.safetensors

``loss`` is the training loss when it was taken (a run's: the mean of the live peers' reported
losses); ``valid_loss`` the mean loss on fixed rows of each held-out split of the run's data
(``crowdtrain.train.validate.HeldOutSet``), absent in checkpoints written without one.

It is written to a temporary sibling and renamed into place, so a crash mid-write never leaves
a half checkpoint under the final name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from crowdtrain.model.config import ModelConfig
from crowdtrain.model.transformer import DalleTransformer

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def save_checkpoint(directory: str | Path, model: DalleTransformer, *, step: int, loss: float | None = None,
                    run_config: dict | None = None, optimizer_state: dict[str, torch.Tensor] | None = None,
                    optimizer_meta: dict | None = None, assets: dict[str, str | Path] | None = None,
                    valid_loss: dict[str, float] | None = None, valid_rows: dict[str, int] | None = None) -> Path:
    """Write a checkpoint directory atomically and return its path."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(state, tmp / MODEL_FILE)
        if optimizer_state is not None:
            tensors = {k: v.detach().contiguous().cpu() for k, v in optimizer_state.items()}
            save_file(tensors, tmp / OPTIMIZER_FILE, metadata={"meta": json.dumps(optimizer_meta or {})})
        for name, src in (assets or {}).items():
            shutil.copyfile(src, tmp / name)
        meta = {"model": model.config.to_dict(), "fingerprint": model.config.fingerprint(), "step": int(step),
                "loss": None if loss is None else float(loss), "time": time.time(), "run": run_config or {}}
        if valid_loss:
            meta["valid_loss"] = {k: float(v) for k, v in valid_loss.items()}
            meta["valid_rows"] = {k: int(v) for k, v in (valid_rows or {}).items()}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            directory.rename(old)
            tmp.rename(directory)
            shutil.rmtree(old)
        else:
            tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_meta(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a crowdtrain checkpoint: it has no {CONFIG_FILE} "
                                "(pass the checkpoint directory, e.g. runs/demo/checkpoints/step-000100)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is damaged, use an earlier one") from e


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu") -> tuple[DalleTransformer, dict]:
    """Build the model a checkpoint describes and load its weights; returns (model, meta)."""
    directory = Path(directory)
    meta = read_meta(directory)
    config = ModelConfig.from_dict(meta["model"])
    model = DalleTransformer(config)
    try:
        state = load_file(directory / MODEL_FILE, device=str(device))
    except (SafetensorError, FileNotFoundError, OSError) as e:
        raise ValueError(f"cannot read {directory / MODEL_FILE} ({e}); the checkpoint is incomplete or "
                         "damaged, use an earlier one") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory / MODEL_FILE} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(device), meta


def load_optimizer_state(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """Optimizer tensors and their JSON meta, or None if the checkpoint has none."""
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, meta


_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / CONFIG_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def best_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint with the lowest held-out loss (its ``valid_loss`` on the ``valid`` split, see
    ``crowdtrain.runspec.validation.selection_loss``); the earliest of equals; None when no
    checkpoint has one. Read from the files, so a restarted checkpointer keeps the same one."""
    from crowdtrain.runspec.validation import selection_loss, selection_split

    scored = []
    for path in list_checkpoints(root):
        try:
            scored.append((path, json.loads((path / CONFIG_FILE).read_text()).get("valid_loss")))
        except (OSError, ValueError, AttributeError):
            continue  # a damaged config: not a candidate
    split = next((selection_split(v) for _, v in reversed(scored) if selection_split(v)), None)
    ranked = [(selection_loss(v, split), i, p) for i, (p, v) in enumerate(scored)]
    ranked = [r for r in ranked if r[0] is not None]
    return min(ranked)[2] if ranked else None


def prune_checkpoints(root: str | Path, keep: int, *, keep_best: bool = False) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (and, with ``keep_best``, the one of
    :func:`best_checkpoint`); returns what was deleted. The newest stays the newest, so resuming
    (:func:`latest_checkpoint`) never picks the best one over a later one."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep}): the newest checkpoint is never deleted")
    best = best_checkpoint(root) if keep_best else None
    doomed = [p for p in list_checkpoints(root)[:-keep] if p != best]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into named tensors and JSON, for safetensors checkpoints."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            name = "/".join(path)
            tensors[name] = obj
            return {"__tensor__": name}
        if isinstance(obj, dict):
            return {"__dict__": [[k, walk(v, path + [str(k)])] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return {"__list__": [walk(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(f"cannot store optimizer state entry {'/'.join(path)} of type {type(obj).__name__}")

    return tensors, {"structure": walk(state_dict, [])}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    def build(node):
        if isinstance(node, dict) and "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if isinstance(node, dict) and "__dict__" in node:
            return {k: build(v) for k, v in node["__dict__"]}
        if isinstance(node, dict) and "__list__" in node:
            return [build(v) for v in node["__list__"]]
        return node

    return build(meta["structure"])
