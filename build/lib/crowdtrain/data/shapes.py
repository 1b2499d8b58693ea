"""The bundled data set: small pictures of one or two coloured shapes, with captions.

Every image is 64x64 RGB on a plain background and shows either one shape ("a large blue
square on the left") or two shapes in a spatial relation ("a small red circle above a large
green square"). A fixed list of colour-shape compositions, :data:`HELDOUT_PAIRS`, never appears
in training data: prompts built from them test the paper's claim that the model composes
concepts it has seen separately (it has seen red things and triangles, never a red triangle).

The same module reads pictures back: :func:`analyse_image` finds the shapes, colours, sizes and
positions in an image (generated or real) and :func:`judge` compares them with a prompt. That is
what ``crowdtrain eval`` uses to score prompt adherence, and what the tokenizer report uses to
check that reconstructions still show what the caption says.

Why these choices: the four shapes (circle, square, triangle, horizontal bar) stay apart under
blur (a bar by its aspect ratio, the others by how they fill their bounding box; a diamond was
tried and blurs into a circle at 8x8 codes), and colours are far apart in RGB, so the analyser
is a few lines of numpy, exact on clean images, and forgiving of a tokenizer's or a small
model's blur. Shapes are drawn on a 4-pixel lattice in two sizes each of small and large, on
white: the 8x8-pixel patches the tokenizer codes then take few distinct contents, and 512 codes
give back what the caption says in ~98% of images (drawn anywhere, on three backgrounds: ~70%),
which is the ceiling of any model trained on the codes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 64

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle", "bar")
# Shapes are drawn on a 4-pixel lattice (box edges at multiples of GRID): an 8x8 patch of the
# image tokenizer then holds one of a few dozen pieces of each shape instead of hundreds, which
# is what lets 512 codes give the shapes back (read-back agreement ~0.7 off-grid). GRID = 1
# draws anywhere, at that cost.
GRID = 4
SIZES: dict[str, tuple[int, int]] = {"small": (20, 24), "large": (32, 36)}  # extent in pixels, multiples of GRID
SIZE_THRESHOLD = 28  # the analyser calls shapes this wide or wider large
# One background: captions never name it, and gray and black ones tripled the patch contents the
# tokenizer must tell apart (read-back 0.88-0.93 on them against 0.98 on white). The analyser
# still takes the background from the image border, so other backgrounds read back as well.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {"white": (250, 250, 250)}
POSITIONS: dict[str, tuple[float, float]] = {  # single-shape anchors: (x, y) of the centre
    "on the left": (16, 32), "on the right": (48, 32), "at the top": (32, 16),
    "at the bottom": (32, 48), "in the middle": (32, 32),
}
RELATIONS = ("to the left of", "to the right of", "above", "below")

# Colour-shape pairs that never appear in training images: every colour and every shape is
# still seen with others, so the held-out prompts test composition, not new words.
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset({
    ("red", "triangle"), ("green", "circle"), ("blue", "bar"), ("yellow", "square"),
})

# The demo's sample grid and `crowdtrain eval` use these fixed prompts.
EVAL_PROMPTS_SEEN: tuple[str, ...] = (
    "a large red circle in the middle",
    "a small blue square on the left",
    "a large green triangle at the bottom",
    "a small purple bar at the top",
    "a large yellow circle on the right",
    "a small red square above a large blue circle",
    "a small green bar to the left of a small purple triangle",
    "a large yellow triangle below a small red bar",
)
EVAL_PROMPTS_HELDOUT: tuple[str, ...] = (
    "a large red triangle in the middle",
    "a small green circle on the left",
    "a large blue bar at the bottom",
    "a small yellow square at the top",
    "a large red triangle on the right",
    "a small green circle above a large purple square",
    "a small blue bar to the left of a small red circle",
    "a large yellow square below a small green triangle",
)
EVAL_PROMPTS: dict[str, tuple[str, ...]] = {"seen": EVAL_PROMPTS_SEEN, "heldout": EVAL_PROMPTS_HELDOUT}


@dataclass(frozen=True)
class ShapeObject:
    color: str
    shape: str
    size: str

    def words(self) -> str:
        return f"{self.size} {self.color} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """What a picture shows. One object has a ``position``; two have a ``relation`` (first to second)."""

    objects: tuple[ShapeObject, ...]
    position: str | None = None
    relation: str | None = None
    background: str = "white"

    def caption(self) -> str:
        if len(self.objects) == 1:
            return f"a {self.objects[0].words()} {self.position}"
        a, b = self.objects
        return f"a {a.words()} {self.relation} a {b.words()}"

    @property
    def is_heldout(self) -> bool:
        return any((o.color, o.shape) in HELDOUT_PAIRS for o in self.objects)


_OBJ = r"an? (small|large) (" + "|".join(COLORS) + r") (" + "|".join(SHAPES) + ")"
_SINGLE_RE = re.compile(rf"^{_OBJ} ({'|'.join(POSITIONS)})$")
_PAIR_RE = re.compile(rf"^{_OBJ} ({'|'.join(RELATIONS)}) {_OBJ}$")


def parse_caption(text: str) -> Scene | None:
    """The scene a shapes caption describes, or None if it is not in the caption grammar."""
    text = " ".join(text.lower().strip().rstrip(".").split())
    if m := _SINGLE_RE.match(text):
        return Scene((ShapeObject(m[2], m[3], m[1]),), position=m[4])
    if m := _PAIR_RE.match(text):
        return Scene((ShapeObject(m[2], m[3], m[1]), ShapeObject(m[6], m[7], m[5])), relation=m[4])
    return None


# ---- generation ---------------------------------------------------------------------------

def random_scene(rng: random.Random, *, heldout: bool | None = False) -> Scene:
    """A random scene. ``heldout``: False = only training compositions, True = at least one
    held-out pair, None = anything."""
    while True:
        background = rng.choice(sorted(BACKGROUNDS))
        if rng.random() < 0.5:
            scene = Scene((_random_object(rng),), position=rng.choice(list(POSITIONS)), background=background)
        else:
            a = _random_object(rng)
            b = _random_object(rng, exclude_color=a.color, allow_large=a.size == "small")
            scene = Scene((a, b), relation=rng.choice(RELATIONS), background=background)
        if heldout is None or scene.is_heldout == heldout:
            return scene


def _random_object(rng: random.Random, *, exclude_color: str | None = None, allow_large: bool = True) -> ShapeObject:
    color = rng.choice([c for c in COLORS if c != exclude_color])
    size = rng.choice(["small", "large"]) if allow_large else "small"
    return ShapeObject(color, rng.choice(SHAPES), size)


def render(scene: Scene, rng: random.Random) -> np.ndarray:
    """Draw a scene as a (64, 64, 3) uint8 array; placement and exact size come from ``rng``.

    Every shape's bounding box (and a bar's band) starts and ends on the :data:`GRID` lattice,
    so the tokenizer's 8x8-pixel patches meet a shape edge only at a patch border or its middle.
    """
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(img)
    extents = [rng.choice(range(SIZES[o.size][0], SIZES[o.size][1] + 1, GRID)) for o in scene.objects]
    if len(scene.objects) == 1:
        (cx, cy), e = POSITIONS[scene.position], extents[0]
        jitter = 1 if scene.objects[0].size == "small" else 0  # in grid steps
        corners = [(_snap(cx - e / 2 + GRID * rng.randint(-jitter, jitter), e),
                    _snap(cy - e / 2 + GRID * rng.randint(-jitter, jitter), e))]
    else:
        corners = _place_pair(scene.relation, extents, rng)
    for obj, e, (x0, y0) in zip(scene.objects, extents, corners):
        _draw_shape(draw, obj.shape, COLORS[obj.color], x0, y0, e)
    return np.asarray(img, dtype=np.uint8)


def _snap(start: float, extent: int) -> int:
    """The grid point nearest ``start`` that keeps a box of ``extent`` inside the image (a margin
    of one grid step where the box leaves room for it)."""
    margin = GRID if extent + 2 * GRID <= IMAGE_SIZE else 0
    snapped = GRID * round(start / GRID)
    return min(max(snapped, margin), IMAGE_SIZE - extent - margin)


def _place_pair(relation: str, extents: list[int], rng: random.Random) -> list[tuple[int, int]]:
    """Top-left corners (grid points) for (first, second) so that first is `relation` of second:
    boxes at least one grid step apart along the relation's axis, centres offset at most half as
    much across it (unambiguous). Drawn uniformly from every such layout, with a one-step margin
    to the image border where the two boxes leave room for it."""
    ea, eb = extents
    axis = 0 if relation in ("to the left of", "to the right of") else 1
    first_is_lower = relation in ("to the left of", "above")  # smaller x or y
    e_lo, e_hi = (ea, eb) if first_is_lower else (eb, ea)
    margin = GRID if e_lo + e_hi + 3 * GRID <= IMAGE_SIZE else 0
    assert e_lo + e_hi + GRID <= IMAGE_SIZE, (extents, relation)  # SIZES keep two shapes inside
    starts = range(margin, IMAGE_SIZE - margin + 1, GRID)
    along = [(lo, hi) for lo in starts for hi in starts
             if hi >= lo + e_lo + GRID and hi + e_hi <= IMAGE_SIZE - margin]
    lo, hi = rng.choice(along)
    along_a, along_b = (lo, hi) if first_is_lower else (hi, lo)
    limit = 0.5 * ((hi + e_hi / 2) - (lo + e_lo / 2))
    across = [(a, b) for a in starts if a + ea <= IMAGE_SIZE - margin for b in starts
              if b + eb <= IMAGE_SIZE - margin and abs((a + ea / 2) - (b + eb / 2)) <= limit]
    across_a, across_b = rng.choice(across)
    ca, cb = [0, 0], [0, 0]
    ca[axis], cb[axis], ca[1 - axis], cb[1 - axis] = along_a, along_b, across_a, across_b
    return [tuple(ca), tuple(cb)]


def _draw_shape(draw, shape: str, color, x0: int, y0: int, extent: int) -> None:
    """One shape in the box [x0, x0 + extent) x [y0, y0 + extent)."""
    x1, y1 = x0 + extent - 1, y0 + extent - 1
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=color)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=color)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)
    elif shape == "bar":  # a horizontal band about half as tall as wide, on the grid
        height = GRID * ((extent // 2 + GRID // 2) // GRID)
        top = y0 + GRID * round((extent - height) / (2 * GRID))
        draw.rectangle([x0, top, x1, top + height - 1], fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")


def generate_samples(num: int, *, seed: int, heldout: bool | None = False):
    """Yield ``(image (64,64,3) uint8, caption, scene)`` for ``num`` samples, the same for the same seed."""
    rng = random.Random(f"crowdtrain-shapes/{seed}")
    for _ in range(num):
        scene = random_scene(rng, heldout=heldout)
        yield render(scene, rng), scene.caption(), scene


def write_shapes_folder(out_dir, *, num: int, seed: int, heldout: bool | None = False, progress: bool = True) -> int:
    """Write ``num`` images as ``NNNNNN.png`` with ``NNNNNN.txt`` captions (the `data prepare` folder layout)."""
    from pathlib import Path

    from PIL import Image
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = generate_samples(num, seed=seed, heldout=heldout)
    for i, (image, caption, _) in enumerate(tqdm(samples, total=num, desc="shapes", unit="img", disable=not progress)):
        Image.fromarray(image).save(out / f"{i:06d}.png")
        (out / f"{i:06d}.txt").write_text(caption + "\n")
    return num


# ---- analysis -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Detection:
    color: str
    shape: str
    size: str
    centre: tuple[float, float]  # (x, y) of the bounding box centre, in pixels
    pixels: int


_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_PALETTE_NAMES = list(COLORS)
MIN_OBJECT_PIXELS = 40  # a small triangle covers ~160 px; fewer than this is noise


def analyse_image(image) -> list[Detection]:
    """The shapes in an image (PIL image or (H, W, 3) uint8 array of any size), largest first.

    Background = median colour of the border; a pixel belongs to a shape when it is far from the
    background and near one palette colour. Each palette colour with enough pixels is one shape
    (the generator never draws two shapes of the same colour).
    """
    arr = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    if arr.shape[:2] != (IMAGE_SIZE, IMAGE_SIZE):
        from PIL import Image
        arr = np.asarray(Image.fromarray(arr).resize((IMAGE_SIZE, IMAGE_SIZE), Image.NEAREST))
    px = arr.astype(np.float32)
    border = np.concatenate([px[0], px[-1], px[:, 0], px[:, -1]])
    background = np.median(border, axis=0)
    foreground = np.linalg.norm(px - background, axis=-1) > 60
    dist = np.linalg.norm(px[:, :, None, :] - _PALETTE[None, None], axis=-1)  # (H, W, colours)
    nearest = dist.argmin(-1)
    close = dist.min(-1) < 90
    detections = []
    for k, name in enumerate(_PALETTE_NAMES):
        mask = foreground & close & (nearest == k)
        n = int(mask.sum())
        if n < MIN_OBJECT_PIXELS:
            continue
        detections.append(_describe(name, mask))
    return sorted(detections, key=lambda d: -d.pixels)


def _describe(color: str, mask: np.ndarray) -> Detection:
    # Drop stray pixels (fewer than 3 of their 8 neighbours in the mask) so they do not stretch the box.
    padded = np.pad(mask, 1)
    neighbours = sum(np.roll(np.roll(padded, dy, 0), dx, 1) for dy in (-1, 0, 1) for dx in (-1, 0, 1)
                     if (dy, dx) != (0, 0))[1:-1, 1:-1]
    core = mask & (neighbours >= 3)
    if core.sum() >= MIN_OBJECT_PIXELS // 2:
        mask = core
    ys, xs = np.nonzero(mask)
    x0, x1, y0, y1 = xs.min(), xs.max(), ys.min(), ys.max()
    extent = max(x1 - x0 + 1, y1 - y0 + 1)
    shape = _best_template(mask, x0, y0, x1, y1)
    size = "small" if extent < SIZE_THRESHOLD else "large"
    # The box centre, not the pixel centroid: a triangle's centroid sits low in its box.
    return Detection(color, shape, size, (float(x0 + x1 + 1) / 2, float(y0 + y1 + 1) / 2), int(mask.sum()))


def _best_template(mask: np.ndarray, x0, y0, x1, y1) -> str:
    """A box at least 1.5x wider than tall is a bar; otherwise the shape whose ideal drawing in
    the same box overlaps the mask best (intersection over union). Both survive the blur of a
    tokenizer or a small model, which rounds corners: a blurred square still fills its box's
    corners more than a circle does, a triangle still leaves the top corners empty."""
    w, h = x1 - x0 + 1, y1 - y0 + 1
    if w >= 1.5 * h:
        return "bar"
    hh, ww = mask.shape
    yy, xx = np.mgrid[0:hh, 0:ww].astype(np.float32) + 0.5
    cx, cy = (x0 + x1 + 1) / 2, (y0 + y1 + 1) / 2
    u, v = (xx - cx) / max(w / 2, 1.0), (yy - cy) / max(h / 2, 1.0)  # the box mapped to [-1, 1]^2
    templates = {
        "square": (np.abs(u) <= 1) & (np.abs(v) <= 1),
        "circle": u ** 2 + v ** 2 <= 1,
        "triangle": (v <= 1) & (np.abs(u) <= (v + 1) / 2),  # apex at the top
    }

    def iou(t):
        return (t & mask).sum() / max((t | mask).sum(), 1)
    return max(templates, key=lambda name: iou(templates[name]))


def _relation(a: Detection, b: Detection) -> str:
    dx, dy = a.centre[0] - b.centre[0], a.centre[1] - b.centre[1]
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


def _position(d: Detection) -> str:
    return min(POSITIONS, key=lambda p: (POSITIONS[p][0] - d.centre[0]) ** 2 + (POSITIONS[p][1] - d.centre[1]) ** 2)


def judge(prompt: str | Scene, detections: list[Detection]) -> dict[str, bool]:
    """Compare an analysed image with a prompt.

    ``objects``: exactly the prompt's colour-shape pairs are drawn; ``size``: and their sizes;
    ``layout``: and the position (one shape) or the relation (two); ``all``: every check.
    """
    scene = parse_caption(prompt) if isinstance(prompt, str) else prompt
    if scene is None:
        raise ValueError(f"prompt {prompt!r} is not a shapes caption; write e.g. "
                         "'a small red circle above a large blue square'")
    by_color = {d.color: d for d in detections}
    wanted = [by_color.get(o.color) for o in scene.objects]
    objects = (len(detections) == len(scene.objects)
               and all(d is not None and d.shape == o.shape for d, o in zip(wanted, scene.objects)))
    size = objects and all(d.size == o.size for d, o in zip(wanted, scene.objects))
    if not objects:
        layout = False
    elif len(scene.objects) == 1:
        layout = _position(wanted[0]) == scene.position
    else:
        layout = _relation(wanted[0], wanted[1]) == scene.relation
    return {"objects": objects, "size": size, "layout": layout, "all": objects and size and layout}


def analyse_scene(image) -> Scene | None:
    """The analysed image as a :class:`Scene` (None when it shows no shape or more than two)."""
    ds = analyse_image(image)
    if not 1 <= len(ds) <= 2:
        return None
    objs = tuple(ShapeObject(d.color, d.shape, d.size) for d in ds)
    if len(ds) == 1:
        return Scene(objs, position=_position(ds[0]))
    return Scene(objs, relation=_relation(ds[0], ds[1]))
