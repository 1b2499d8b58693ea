"""Held-out loss and prompt adherence of a model: the two numbers that say whether training worked.

``valid_loss`` runs the model over fixed rows of a shard folder's split (no shuffling between
calls, no sampling), so two models are compared on exactly the same rows and the figure does not
move between calls. :class:`HeldOutSet` holds such rows for every split of a run's data but
``train``, loaded once: the coordinator's auxiliary peer computes the losses at every checkpoint
with it (``crowdtrain.runspec.validation`` says what is done with them). ``evaluate_quality``
(``crowdtrain eval``) reports the loss of each held-out split of a checkpoint and, only for data
with a judge (:mod:`crowdtrain.data.judges`), prompt adherence.

What the figures mean: a ``valid`` split holds pictures drawn like the training ones but never
trained on, so a falling training loss with a flat or rising valid loss means the model
memorises; a ``heldout`` split (the shapes demo's: compositions kept out of training) measures
what the model must compose. Adherence is what a person looking at the samples sees.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

logger = logging.getLogger(__name__)

# Rows per split the auxiliary peer evaluates at each checkpoint (``crowdtrain coordinator
# --valid-rows``). Time grows linearly with the rows: the demo preset takes 3.5 s of CPU per 512
# rows on one thread (6-9 s of wall time on a 2-core machine busy with three trainers): lower it
# if checkpoints hold up the run. The standard error of the mean loss is the rows' spread over
# sqrt(rows), 1/22 of it at 512: raise it if the figure jumps between checkpoints by more than the
# 5% rises the memorising rule looks for.
DEFAULT_MAX_ROWS = 512
LOAD_ATTEMPTS = 3  # a split that fails to load this many times (at as many checkpoints) is given up


def held_out_splits(data, *, timeout_s: float = 30.0) -> list[str]:
    """Every split of the shards at ``data`` but ``train`` (valid first, then by name); [] for
    generated data. ValueError when the source does not answer."""
    from crowdtrain.data.streaming import source_splits

    splits = [s for s in source_splits(data, timeout_s=timeout_s) if s != "train"]
    return sorted(splits, key=lambda s: (s != "valid", s))


def valid_rows(data: str | Path, *, text_tokenizer, model_config, split: str = "valid",
               max_rows: int | None = None, config=None) -> dict[str, torch.Tensor]:
    """Every row of ``split`` (at most ``max_rows``) as one batch ``{"text", "image"}``, in one fixed
    order. ``config``: a ``crowdtrain.data.config.StreamConfig`` (how long to wait out an outage);
    its shuffle settings decide which rows the first ``max_rows`` are, so keep the default's."""
    from crowdtrain.data.config import StreamConfig
    from crowdtrain.data.streaming import batch_stream

    # One pass of the stream in its own order: the stream shuffles by ``seed_key``, and a fixed
    # key gives every caller the same rows in the same order.
    stream = batch_stream(data, text_tokenizer=text_tokenizer, model_config=model_config, batch_size=1,
                          seed_key="crowdtrain-valid", split=split, config=config or StreamConfig())
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


class HeldOutSet:
    """Fixed rows of every held-out split of a run's data, loaded once and reused, so the losses
    of successive checkpoints are comparable (the same rows, in the same order).

    Made for a process that must not fail because of it (the coordinator's auxiliary peer, the
    run's first DHT peer): a split that cannot be read is logged once and retried at the next
    :meth:`losses`, at most ``LOAD_ATTEMPTS`` times; data without splits (generated ``pattern``
    data) gives no losses and one INFO line. ``max_rows`` per split bounds the time and memory
    (rows x (text_len + image_len) int64s: 512 rows of the demo preset's 96 tokens take 0.4 MB).
    """

    def __init__(self, data, *, text_tokenizer, model_config, max_rows: int = DEFAULT_MAX_ROWS,
                 timeout_s: float = 10.0):
        from crowdtrain.data.config import StreamConfig

        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (got {max_rows}); to measure nothing, make no HeldOutSet")
        self.data, self.text_tokenizer, self.model_config = data, text_tokenizer, model_config
        self.max_rows, self.timeout_s = max_rows, timeout_s
        # No replay and no patience: a source that is down fails this checkpoint's evaluation at
        # once (retried at the next), rather than holding up the checkpointer or repeating rows.
        self.stream_config = StreamConfig(http_timeout_s=timeout_s, outage_patience_s=0.0, replay_rows=0)
        self.splits: list[str] | None = None
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.failures: dict[str, int] = {}

    def _failed(self, what: str, error: Exception) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1
        n = self.failures[what]
        level = logging.WARNING if n == 1 else logging.DEBUG
        more = "; retried at the next checkpoint" if n < LOAD_ATTEMPTS else "; given up: no loss for it in this run"
        logger.log(level, "held-out evaluation: cannot read %s of %s (%s)%s", what, self.data,
                   str(error).splitlines()[0][:300] if str(error) else type(error).__name__, more)
        if n == LOAD_ATTEMPTS and level == logging.DEBUG:
            logger.warning("held-out evaluation: gave up on %s of %s after %d attempts", what, self.data, n)

    def load(self) -> dict[str, dict[str, torch.Tensor]]:
        """The rows of each split, reading those not yet read; what fails is left out."""
        if self.splits is None:
            if self.failures.get("the split list", 0) >= LOAD_ATTEMPTS:
                return self.rows
            try:
                self.splits = held_out_splits(self.data, timeout_s=self.timeout_s)
            except Exception as e:
                self._failed("the split list", e)
                return self.rows
            if not self.splits:
                logger.info("held-out evaluation: %s has no split but train, so checkpoints carry no "
                            "validation loss (add one with `crowdtrain data prepare ... --split valid`)", self.data)
        for split in self.splits:
            if split in self.rows or self.failures.get(f"split {split!r}", 0) >= LOAD_ATTEMPTS:
                continue
            try:
                self.rows[split] = valid_rows(self.data, text_tokenizer=self.text_tokenizer,
                                              model_config=self.model_config, split=split, max_rows=self.max_rows,
                                              config=self.stream_config)
                logger.info("held-out evaluation: %d rows of split %r", len(self.rows[split]["text"]), split)
            except Exception as e:
                self._failed(f"split {split!r}", e)
        return self.rows

    def losses(self, model) -> tuple[dict[str, float], dict[str, int]]:
        """``({split: mean loss}, {split: rows})`` of ``model``, for the splits that could be read."""
        losses, rows = {}, {}
        for split, batch in self.load().items():
            try:
                losses[split] = valid_loss(model, batch)
                rows[split] = len(batch["text"])
            except FloatingPointError as e:
                logger.warning("held-out evaluation of split %r: %s", split, e)
        return losses, rows


def run_data(checkpoint, meta: dict, data=None) -> str:
    """The data to evaluate a checkpoint on: ``data`` (``--data``), else what its run recorded."""
    if data is not None:
        return str(data)
    recorded = ((meta.get("run") or {}).get("task") or {}).get("data")
    if not recorded:
        raise ValueError(f"{checkpoint} does not record the data of its run: pass the shards to evaluate on with "
                         "--data (a shard folder made by `crowdtrain data prepare`, or its URL)")
    return str(recorded)


def check_data_tokenizer(checkpoint, data) -> None:
    """TokenizerMismatch when the shards at ``data`` were coded by another image tokenizer than the
    one the checkpoint carries (its model learnt other codes: every figure would be meaningless)."""
    from crowdtrain.data.generate import TokenizerMismatch
    from crowdtrain.data.image_tokenizer import load_image_tokenizer, tokenizer_digest
    from crowdtrain.data.streaming import read_source_json

    path = Path(checkpoint) / "image_tokenizer.safetensors"
    recorded = ((read_source_json(data) or {}).get("image_tokenizer") or {}).get("digest")
    if not path.is_file() or not recorded:
        return  # nothing to compare
    mine = tokenizer_digest(load_image_tokenizer(path))
    if mine != recorded:
        raise TokenizerMismatch(
            f"the shards at {data} were coded with image tokenizer {recorded}, but {checkpoint} carries {mine}: "
            "the model was trained on other data. Pass that run's shards with --data")


def evaluate_quality(checkpoint, *, data: str | Path | None = None, samples_per_prompt: int = 8,
                     max_rows: int | None = None, adherence: bool = True, seed: int = 0,
                     top_k: int | None = DEFAULT_TOP_K, top_p: float | None = DEFAULT_TOP_P,
                     temperature: float = 1.0, device: str = "cpu") -> dict:
    """A checkpoint's held-out loss on each split of ``data`` but train, and prompt adherence where
    the data has a judge.

    ``data``: a shard folder or URL; default the data the checkpoint's run recorded
    (``config.json``'s ``run.task.data``). Returns ``{"losses": {split: {"loss", "rows"}},
    "valid_loss"`` (the ``valid`` split's, else the first one's), ``"judge"``, ``"adherence"``
    (``crowdtrain.data.evaluate.evaluate_generator``'s result, or None), ``"adherence_note"`` (why
    there is none), and flat ``adherence_seen`` / ``adherence_heldout`` / ``objects_*`` (None when
    not measured) for the demo and the benchmarks.
    """
    import re

    from crowdtrain.checkpoint import load_checkpoint, read_meta
    from crowdtrain.data.judges import judge_for_data
    from crowdtrain.data.streaming import HUB_ID

    meta = read_meta(checkpoint)
    data = run_data(checkpoint, meta, data)
    if data not in ("pattern", "synthetic") and not data.startswith(("http://", "https://")) \
            and not Path(data).is_dir() and not re.fullmatch(HUB_ID, data):
        raise FileNotFoundError(f"the data {data} is not a folder here: pass the run's shards with --data "
                                "(a shard folder made by `crowdtrain data prepare`, or its URL)")
    try:
        splits = held_out_splits(data)
    except ValueError as e:
        raise ValueError(f"{e}; pass the run's shards with --data (a local shard folder or a URL that answers)") from e
    check_data_tokenizer(checkpoint, data)
    model, _ = load_checkpoint(checkpoint, device=device)
    text_tokenizer = _checkpoint_text_tokenizer(checkpoint)
    losses = {}
    for split in splits:
        rows = valid_rows(data, text_tokenizer=text_tokenizer, model_config=model.config, split=split,
                          max_rows=max_rows)
        losses[split] = {"loss": valid_loss(model, rows), "rows": len(rows["text"])}
    first = losses.get("valid") or next(iter(losses.values()), None)
    out = {"checkpoint": str(checkpoint), "step": meta.get("step"), "data": data, "losses": losses,
           "valid_loss": first["loss"] if first else None, "valid_rows": first["rows"] if first else None,
           "judge": None, "adherence": None, "adherence_note": None,
           "adherence_seen": None, "adherence_heldout": None, "objects_seen": None, "objects_heldout": None}
    if not splits:
        out["losses_note"] = (f"{data} has no split but train: no held-out loss (add one with "
                              "`crowdtrain data prepare ... --split valid`)")
    judge = judge_for_data(data)
    if judge is None:
        out["adherence_note"] = (f"no prompt adherence: the data at {data} has no judge to read its pictures "
                                 "(only data sets registered in crowdtrain.data.judges have one, e.g. the shapes)")
        return out
    out["judge"] = judge.name
    if not adherence:
        out["adherence_note"] = "prompt adherence not asked for"
        return out
    from crowdtrain.data.evaluate import evaluate_generator
    from crowdtrain.data.generate import Generator, TokenizerMismatch

    del model  # the generator loads its own copy, with the image tokenizer it is checked against
    try:
        gen = Generator.from_checkpoint(checkpoint, device=device)  # before any sampling
    except TokenizerMismatch as e:
        out["adherence_note"] = f"no prompt adherence: the checkpoint cannot draw pictures to judge ({e})"
        return out
    result = evaluate_generator(gen, judge=judge, samples_per_prompt=samples_per_prompt, seed=seed, top_k=top_k,
                                top_p=top_p, temperature=temperature)
    out["adherence"] = result
    groups = result["groups"]
    for group, key in (("seen", "seen"), ("heldout", "heldout")):
        if group in groups:
            out[f"adherence_{key}"] = groups[group]["adherence"]
            out[f"objects_{key}"] = groups[group].get("objects")
    out["per_prompt"] = result["prompts"]
    return out


def format_quality(result: dict) -> str:
    """``crowdtrain eval``'s report: one line per held-out split, then adherence or why there is none."""
    from crowdtrain.data.evaluate import format_adherence

    lines = [f"checkpoint {result['checkpoint']} (step {result.get('step')}), data {result['data']}"]
    if result["losses"]:
        lines.append(f"{'split':12s} {'rows':>6s} {'loss':>8s}")
        lines += [f"{split:12s} {v['rows']:6d} {v['loss']:8.4f}" for split, v in result["losses"].items()]
    else:
        lines.append(result.get("losses_note") or "no held-out split")
    lines.append(format_adherence(result["adherence"]) if result["adherence"] else result["adherence_note"])
    return "\n".join(lines)


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
