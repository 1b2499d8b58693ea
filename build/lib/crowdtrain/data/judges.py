"""Judges: automatic readers of generated pictures, one per data set that has one.

Prompt adherence (``crowdtrain eval``, the demo's summary) is only meaningful where something can
tell whether a picture shows what its prompt asks: the bundled shapes data has an exact analyser
(:mod:`crowdtrain.data.shapes`); a folder of an organizer's own photos has none, and then no
adherence is reported at all, never a score from another data set's analyser.

A judge is any object with

- ``name``: a short label for reports;
- ``prompts() -> {group: [prompt, ...]}``: the fixed evaluation prompts, in groups such as
  ``"seen"`` (compositions in the training data) and ``"heldout"`` (kept out of it);
- ``judge(prompt, images) -> [{"all": bool, check: bool, ...}, ...]``: one verdict per picture
  of ``images`` (a numpy uint8 array ``(N, H, W, 3)``), ``"all"`` when everything the prompt asks
  is there, plus any named partial checks (the shapes judge: ``objects``, ``size``, ``layout``).

Which judge applies is decided from the shards' own metadata, so ``crowdtrain eval --data DIR``
needs no flag for it: a data set names itself with ``"dataset": {"name": NAME}`` in its
``shards.json`` (``crowdtrain.data.shards.prepare_shards(dataset={"name": NAME})``), and NAME is
looked up in :data:`JUDGES`. Shard folders made by the shapes demo before that field existed are
recognised by their ``demo.json`` (``crowdtrain.data.demo.MARKER``). A new data set with a judge
is one entry in :data:`JUDGES`: its name and where its judge class lives (imported only when a
run's data names it), or a :func:`register_judge` call at run time.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)


@runtime_checkable
class Judge(Protocol):
    name: str

    def prompts(self) -> dict[str, list[str]]: ...

    def judge(self, prompt: str, images: np.ndarray) -> list[dict]: ...


class ShapesJudge:
    """The shapes data's analyser (:func:`crowdtrain.data.shapes.analyse_image`): colours, shapes,
    sizes and position or relation read back from the pixels and compared with the prompt."""

    name = "shapes"
    checks = ("all", "objects", "size", "layout")

    def prompts(self) -> dict[str, list[str]]:
        from crowdtrain.data.shapes import EVAL_PROMPTS

        return {group: list(prompts) for group, prompts in EVAL_PROMPTS.items()}

    def judge(self, prompt: str, images: np.ndarray) -> list[dict]:
        from crowdtrain.data import shapes

        return [shapes.judge(prompt, shapes.analyse_image(im)) for im in np.asarray(images)]

    @classmethod
    def from_record(cls, record: dict) -> "ShapesJudge":
        return cls()  # the shapes prompts and analyser are fixed: nothing in the record changes them


# Data set name (``shards.json``'s ``dataset.name``) -> what builds its judge from that ``dataset``
# record (a data set's judge may need to know what the set holds, e.g. which compositions were held
# out): "module:attribute" (imported on first use) or the function itself.
JUDGES: dict[str, str | Callable[[dict], Judge]] = {"shapes": "crowdtrain.data.judges:ShapesJudge.from_record",
                                                    "emoji": "crowdtrain.data.emoji_judge:EmojiJudge.from_record"}
SHAPES_MARKER = "demo.json"  # the shapes demo's recipe file (crowdtrain.data.demo.MARKER)


def register_judge(name: str, factory: Callable[[dict], Judge]) -> None:
    """Make ``factory(record)`` the judge of shards whose ``shards.json`` says ``"dataset": {"name":
    name, ...}`` (``record`` is that whole ``dataset`` entry)."""
    if not name or not isinstance(name, str):
        raise ValueError("a judge is registered under its data set's name, a non-empty string")
    JUDGES[name] = factory


def dataset_record(source, *, timeout_s: float = 30.0) -> dict | None:
    """The ``dataset`` record a shard source (local folder or http(s) base URL) carries
    (``{"name": ..., ...}``), ``{"name": "shapes"}`` for a shapes folder from before the record
    existed, or None."""
    from crowdtrain.data.streaming import read_source_json

    manifest = read_source_json(source, timeout_s=timeout_s) or {}
    declared = manifest.get("dataset")
    if isinstance(declared, dict) and isinstance(declared.get("name"), str):
        return declared
    if read_source_json(source, SHAPES_MARKER, timeout_s=timeout_s) is not None:
        return {"name": "shapes"}
    return None


def dataset_name(source, *, timeout_s: float = 30.0) -> str | None:
    """The data set a shard source says it is, or None."""
    record = dataset_record(source, timeout_s=timeout_s)
    return record["name"] if record is not None else None


def judge_for_data(source, *, timeout_s: float = 30.0) -> Judge | None:
    """The judge of the data at ``source``, or None when it has none (an organizer's own pictures,
    generated ``pattern`` data, a name no module registered)."""
    if str(source) in ("pattern", "synthetic"):
        return None
    record = dataset_record(source, timeout_s=timeout_s)
    if record is None:
        return None
    name = record["name"]
    if name not in JUDGES:
        logger.info("data set %r has no judge registered (known: %s)", name, sorted(JUDGES))
        return None
    factory = JUDGES[name]
    if isinstance(factory, str):
        import importlib

        module, _, path = factory.partition(":")
        factory = importlib.import_module(module)
        for attr in path.split("."):
            factory = getattr(factory, attr)
    return factory(record)
