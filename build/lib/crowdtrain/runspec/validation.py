"""Held-out losses at checkpoints: which split picks the best checkpoint, and when a run memorises.

The auxiliary peer computes, at every checkpoint, the model's mean loss on fixed rows of each
split of the run's shards but ``train`` (``crowdtrain.train.validate.HeldOutSet``) and stores them
next to the training loss of that moment (the mean of the live peers' reported losses): in the
checkpoint's ``config.json`` (``valid_loss``), in the database and so in ``/api/checkpoints`` and
``/api/history``. Both sides of the coordinator read the rules here: the auxiliary peer keeps the
best checkpoint by :func:`selection_loss` besides the last ``--keep-checkpoints``, and the web
side lists :func:`memorising_problem` in ``/api/status``. No torch, no hivemind.
"""

from __future__ import annotations

import math

SELECTION_SPLIT = "valid"  # the split whose loss picks the best checkpoint (else the first other split)
# The memorising rule: the held-out loss has stayed more than MEMORISING_RISE above its best for
# the last MEMORISING_CHECKPOINTS checkpoints, all taken after the best one, while the training
# loss is lower than it was at the best one. Three checkpoints and 5% keep one noisy figure (the
# peers' reported training loss moves by a few % between checkpoints) from raising the alarm; on
# a run that checkpoints rarely, the warning comes that many checkpoints late.
MEMORISING_RISE = 0.05
MEMORISING_CHECKPOINTS = 3


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def clean_losses(value) -> dict[str, float] | None:
    """``{split: loss}`` with only finite numbers under string keys (the value comes from a file or a
    database row: read it as untrusted); None when nothing is left."""
    if not isinstance(value, dict):
        return None
    out = {k: _finite(v) for k, v in value.items() if isinstance(k, str)}
    out = {k: v for k, v in out.items() if v is not None}
    return out or None


def selection_split(losses: dict[str, float] | None) -> str | None:
    """The split that ranks checkpoints: ``valid`` when measured, else the first other split by name."""
    losses = clean_losses(losses)
    if not losses:
        return None
    return SELECTION_SPLIT if SELECTION_SPLIT in losses else sorted(losses)[0]


def selection_loss(losses: dict[str, float] | None, split: str | None = None) -> float | None:
    """The loss that ranks a checkpoint (lower is better), on ``split`` or :func:`selection_split`'s."""
    losses = clean_losses(losses) or {}
    return losses.get(split or selection_split(losses) or "")


def memorising(checkpoints: list[dict], *, rise: float = MEMORISING_RISE,
               window: int = MEMORISING_CHECKPOINTS) -> dict | None:
    """The evidence that the model memorises its training data, or None.

    ``checkpoints``: oldest first, each with ``loss`` (the training loss at the checkpoint),
    ``valid_loss`` ({split: loss}) and ``epoch``/``name``. Only checkpoints with both figures count.
    Memorising: the best held-out loss was reached at least ``window`` checkpoints ago, each of the
    last ``window`` is more than ``rise`` (a fraction) above it, and the training loss at the latest
    is below the training loss at the best.
    """
    split = next((selection_split(c.get("valid_loss")) for c in reversed(checkpoints)
                  if selection_split(c.get("valid_loss"))), None)
    if split is None:
        return None
    series = [(c, _finite(c.get("loss")), selection_loss(c.get("valid_loss"), split)) for c in checkpoints]
    series = [s for s in series if s[1] is not None and s[2] is not None]
    if len(series) <= window:
        return None
    best = min(range(len(series)), key=lambda i: series[i][2])  # the first of equals
    best_ckpt, train_at_best, valid_best = series[best]
    latest_ckpt, train_now, valid_now = series[-1]
    if len(series) - 1 - best < window:
        return None
    if not all(v > valid_best * (1 + rise) for _, _, v in series[-window:]):
        return None
    if not train_now < train_at_best:
        return None
    return {"split": split, "best_valid_loss": valid_best, "valid_loss": valid_now, "train_loss_at_best": train_at_best,
            "train_loss": train_now, "best_epoch": best_ckpt.get("epoch"), "best_name": best_ckpt.get("name"),
            "epoch": latest_ckpt.get("epoch"), "checkpoints": window}


def memorising_problem(checkpoints: list[dict]) -> str | None:
    """:func:`memorising` as the line ``/api/status`` lists under ``problems`` (None: no sign of it)."""
    m = memorising(checkpoints)
    if m is None:
        return None
    up = 100 * (m["valid_loss"] / m["best_valid_loss"] - 1) if m["best_valid_loss"] > 0 else float("inf")
    best = f" ({m['best_name']}, kept)" if m.get("best_name") else ""
    return (f"the model is memorising its training data: the held-out loss on the {m['split']!r} split rose "
            f"from its best {m['best_valid_loss']:.4f} at epoch {m['best_epoch']}{best} to {m['valid_loss']:.4f} "
            f"(+{up:.0f}%, above +{100 * MEMORISING_RISE:.0f}% for the last {m['checkpoints']} checkpoints) while "
            f"the training loss fell from {m['train_loss_at_best']:.4f} to {m['train_loss']:.4f}. More training "
            "makes it worse on pictures it has not seen. Stop here (the best checkpoint is kept, marked on "
            "/checkpoints) and give the next run more data (more images in the train split), fewer passes over it "
            "(a smaller --swarm total_epochs=N) or a smaller model (--preset tiny, or --model width=N / depth=N).")
