"""The shapes data set: captions, generation, held-out compositions, the analyser."""

import random

import numpy as np
import pytest

from crowdtrain.data import shapes
from crowdtrain.data.shapes import (EVAL_PROMPTS, HELDOUT_PAIRS, Scene, ShapeObject, analyse_image, generate_samples,
                                    judge, parse_caption)

pytestmark = pytest.mark.timeout(60)


def test_caption_roundtrip_and_grammar():
    rng = random.Random(0)
    for _ in range(300):
        scene = shapes.random_scene(rng, heldout=None)
        parsed = parse_caption(scene.caption())
        assert parsed == Scene(scene.objects, scene.position, scene.relation)
    assert parse_caption("a small red circle above a large blue square") == Scene(
        (ShapeObject("red", "circle", "small"), ShapeObject("blue", "square", "large")), relation="above")
    assert parse_caption("a photo of a cat") is None
    assert parse_caption("a small pink circle on the left") is None  # pink is not a colour of the set


def test_generation_is_deterministic_and_varied():
    a = list(generate_samples(50, seed=3))
    b = list(generate_samples(50, seed=3))
    c = list(generate_samples(50, seed=4))
    assert all(np.array_equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(a, b))
    assert [x[1] for x in a] != [x[1] for x in c]
    img = a[0][0]
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    captions = [x[1] for x in generate_samples(400, seed=0)]
    words = " ".join(captions)
    for word in [*shapes.COLORS, *shapes.SHAPES, "small", "large", "above", "below", "left", "right", "middle"]:
        assert word in words, word
    assert sum(" of a " in c or " above a " in c or " below a " in c for c in captions) > 100  # pairs
    assert sum(len(parse_caption(c).objects) == 1 for c in captions) > 100  # singles


def test_heldout_compositions_never_in_training():
    for _, caption, scene in generate_samples(1500, seed=0):
        assert not scene.is_heldout
        assert not any((o.color, o.shape) in HELDOUT_PAIRS for o in parse_caption(caption).objects)
    held = [s for _, _, s in generate_samples(50, seed=0, heldout=True)]
    assert all(s.is_heldout for s in held)
    # Every held-out prompt uses a held-out pair; no seen prompt does; each colour and shape of a
    # held-out pair is still seen in training with something else.
    assert all(parse_caption(p).is_heldout for p in EVAL_PROMPTS["heldout"])
    assert not any(parse_caption(p).is_heldout for p in EVAL_PROMPTS["seen"])
    train_objects = {(o.color, o.shape) for _, _, s in generate_samples(500, seed=1) for o in s.objects}
    for color, shape in HELDOUT_PAIRS:
        assert any(c == color for c, _ in train_objects) and any(s == shape for _, s in train_objects)


def test_analyser_reads_back_clean_images():
    """The analyser is the judge of the tokenizer and of the model: exact on clean pictures of
    every kind (seen and held-out compositions, one shape and two)."""
    for heldout in (False, True):
        hits: dict[int, list[bool]] = {1: [], 2: []}
        for image, caption, scene in generate_samples(600, seed=7, heldout=heldout):
            hits[len(scene.objects)].append(judge(caption, analyse_image(image))["all"])
        for count, verdicts in hits.items():
            assert len(verdicts) > 150 and np.mean(verdicts) >= 0.995, (heldout, count, np.mean(verdicts))


def test_shapes_are_drawn_on_the_grid():
    """Every shape's bounding box starts and ends on the GRID lattice (what keeps the tokenizer's
    patches few), and sizes stay apart from the analyser's small/large threshold."""
    for image, _, scene in generate_samples(200, seed=8, heldout=None):
        background = image[0, 0]
        for obj in scene.objects:
            mask = np.all(image == np.array(shapes.COLORS[obj.color], dtype=np.uint8), axis=-1)
            ys, xs = np.nonzero(mask)
            x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
            assert x0 % shapes.GRID == 0 and x1 % shapes.GRID == 0, (scene, x0, x1)
            assert y0 % shapes.GRID == 0 and y1 % shapes.GRID == 0, (scene, y0, y1)
            extent = x1 - x0
            assert abs(extent - shapes.SIZE_THRESHOLD) >= 4, (scene, extent)
            assert (extent >= shapes.SIZE_THRESHOLD) == (obj.size == "large")
        assert np.array_equal(image[0, 0], background)


def test_judge_rejects_wrong_images():
    image, caption, scene = next(generate_samples(1, seed=11))
    detections = analyse_image(image)
    assert judge(caption, detections)["all"]
    # Another colour, another shape, another layout: each check must fail on its own.
    obj = scene.objects[0]
    other_color = next(c for c in shapes.COLORS if c not in {o.color for o in scene.objects})
    wrong_color = Scene((ShapeObject(other_color, obj.shape, obj.size),) + scene.objects[1:], scene.position,
                        scene.relation)
    assert not judge(wrong_color, detections)["objects"]
    blank = np.full((64, 64, 3), 250, dtype=np.uint8)
    assert analyse_image(blank) == []
    assert not judge(caption, [])["all"]
    with pytest.raises(ValueError, match="not a shapes caption"):
        judge("a photo of a cat", detections)


def test_analyser_positions_and_relations():
    rng = random.Random(5)
    for position in shapes.POSITIONS:
        scene = Scene((ShapeObject("red", "square", "small"),), position=position)
        assert judge(scene, analyse_image(shapes.render(scene, rng)))["layout"], position
    for relation in shapes.RELATIONS:
        scene = Scene((ShapeObject("blue", "circle", "small"), ShapeObject("yellow", "triangle", "small")),
                      relation=relation)
        assert judge(scene, analyse_image(shapes.render(scene, rng)))["layout"], relation
        flipped = {"above": "below", "below": "above", "to the left of": "to the right of",
                   "to the right of": "to the left of"}[relation]
        wrong = Scene(scene.objects, relation=flipped)
        assert not judge(wrong, analyse_image(shapes.render(scene, rng)))["layout"]


def test_cli_writes_folder(tmp_path):
    from crowdtrain.cli import main

    assert main(["data", "shapes", "--out", str(tmp_path / "s"), "--num", "12", "--seed", "2"]) == 0
    pngs = sorted((tmp_path / "s").glob("*.png"))
    assert len(pngs) == 12
    for p in pngs:
        assert parse_caption(p.with_suffix(".txt").read_text()) is not None
    assert main(["data", "shapes", "--out", str(tmp_path / "h"), "--num", "5", "--heldout", "only"]) == 0
    assert all(parse_caption(t.read_text()).is_heldout for t in (tmp_path / "h").glob("*.txt"))
