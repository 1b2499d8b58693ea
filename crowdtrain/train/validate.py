"""Held-out loss and prompt adherence of a model: the two numbers that say whether training worked.

``valid_loss`` runs the model over every row of a shard folder's ``valid`` split once (no
shuffling, no sampling), so two models are compared on exactly the same rows and the figure does
not move between calls. ``evaluate_quality`` adds prompt adherence on the shapes prompts
(``crowdtrain eval``) when the model draws the shapes tokenizer's grid.

What the figures mean on the bundled shapes data: the valid split holds captions and
compositions drawn like the training ones but never trained on, so a falling training loss with
a flat valid loss means the model memorises; adherence is what a person looking at the samples
sees (``crowdtrain.data.evaluate``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def valid_rows(data: str | Path, *, text_tokenizer, model_config, split: str = "valid",
               max_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Every row of ``split`` (at most ``max_rows``) as one batch ``{"text", "image"}``, in one fixed order."""
    from crowdtrain.data.streaming import batch_stream

    # One pass of the stream in its own order: the stream shuffles by ``seed_key``, and a fixed
    # key gives every caller the same rows in the same order.
    stream = batch_stream(data, text_tokenizer=text_tokenizer, model_config=model_config, batch_size=1,
                          seed_key="crowdtrain-valid", split=split)
    texts, images = [], []
    for batch in stream:
        if stream.epoch > 0 or (max_rows is not None and len(texts) >= max_rows):
            break
        texts.append(batch["text"])
        images.append(batch["image"])
    if not texts:
        raise ValueError(f"{data} has no rows in its {split!r} split: prepare one with "
                         f"`crowdtrain data prepare ... --split {split}`")
    return {"text": torch.cat(texts), "image": torch.cat(images)}


@torch.no_grad()
def valid_loss(model, rows: dict[str, torch.Tensor], *, batch_size: int = 64) -> float:
    """Mean loss of ``model`` over ``rows`` (weighted by rows), in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, n = 0.0, len(rows["text"])
    try:
        for start in range(0, n, batch_size):
            batch = {k: v[start:start + batch_size].to(device) for k, v in rows.items()}
            total += model(**batch).loss.item() * len(batch["text"])
    finally:
        model.train(was_training)
    loss = total / n
    if not math.isfinite(loss):
        raise FloatingPointError(f"the held-out loss is {loss}: the model's parameters are not finite")
    return loss


def evaluate_quality(checkpoint, *, data: str | Path, samples_per_prompt: int = 8, max_rows: int | None = None,
                     adherence: bool = True, seed: int = 0) -> dict:
    """``{"valid_loss", "adherence_seen", "adherence_heldout", "step"}`` of a checkpoint.

    Adherence is left out (None) when the checkpoint's model does not draw the shapes tokenizer's
    grid (another data set), or when ``adherence`` is False.
    """
    from crowdtrain.data.generate import Generator, TokenizerMismatch

    try:
        gen = Generator.from_checkpoint(checkpoint)
    except TokenizerMismatch:
        gen = None
    from crowdtrain.checkpoint import load_checkpoint

    model, meta = (gen.model, gen.meta) if gen is not None else load_checkpoint(checkpoint)
    text_tokenizer = gen.text_tokenizer if gen is not None else _checkpoint_text_tokenizer(checkpoint)
    rows = valid_rows(data, text_tokenizer=text_tokenizer, model_config=model.config, max_rows=max_rows)
    out = {"checkpoint": str(checkpoint), "step": meta.get("step"), "valid_loss": valid_loss(model, rows),
           "valid_rows": len(rows["text"]), "adherence_seen": None, "adherence_heldout": None}
    if adherence and gen is not None:
        from crowdtrain.data.evaluate import evaluate_generator

        result = evaluate_generator(gen, samples_per_prompt=samples_per_prompt, seed=seed)
        out["adherence_seen"] = result["groups"]["seen"]["adherence"]
        out["adherence_heldout"] = result["groups"]["heldout"]["adherence"]
        out["objects_seen"] = result["groups"]["seen"]["objects"]
        out["objects_heldout"] = result["groups"]["heldout"]["objects"]
        out["per_prompt"] = result["prompts"]
    return out


def _checkpoint_text_tokenizer(checkpoint):
    from crowdtrain.data.tokenizers import default_text_tokenizer, load_text_tokenizer

    path = Path(checkpoint) / "text_tokenizer.json"
    return load_text_tokenizer(path) if path.is_file() else default_text_tokenizer()


def pattern_loss(weights_path: str | Path | None = None, *, preset: str = "tiny") -> float:
    """Loss of ``preset`` on one fixed held-out batch (128 rows) of the learnable ``pattern`` data:
    of the weights saved at ``weights_path`` (``join --save-final``), or of the model initialised
    from seed 0 when None. What the swarm tests and benchmarks compare peers' final weights by."""
    from safetensors.torch import load_file

    from crowdtrain.model import DalleTransformer, get_preset
    from crowdtrain.train.task import DalleTask

    config = get_preset(preset)
    if weights_path is None:
        torch.manual_seed(0)
    batch = next(DalleTask(config, data="pattern").batches(batch_size=128, seed_key="held-out eval"))
    model = DalleTransformer(config)
    if weights_path is not None:
        model.load_state_dict(load_file(str(weights_path)))
    with torch.no_grad():
        return model.eval()(**batch).loss.item()
