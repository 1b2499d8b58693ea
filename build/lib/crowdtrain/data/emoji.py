"""The emoji data set: real pictures (Noto Color Emoji, rendered with Pillow), Unicode-name captions.

The bundled real-picture demo's data (``crowdtrain demo --data emoji``). Each picture is one
emoji that takes a skin-tone modifier (a hand, a person, ...), in one of six tones (the five
Fitzpatrick modifiers U+1F3FB..U+1F3FF and the default yellow), drawn at a random size and
position on a white 64x64 frame. Captions come from the Unicode names, made readable:
``"waving hand, medium skin tone"``, ``"thumbs up, yellow skin tone"``.

The composition axis is **base x tone**. Splits (all deterministic from ``seed``):

- ``train``: the seen compositions (each base with five of its six tones), ``renderings``
  pictures of each;
- ``valid``: the same compositions, fresh renderings never in ``train`` (the validation loss);
- ``heldout``: for each base the one tone it is never seen with in training. The held-out tone
  rotates over the bases (in an order shuffled by ``seed``), so every tone is held out for some
  bases and seen with all the others: the model has seen every base and every tone, never the
  pair.

The source is Debian's ``fonts-noto-color-emoji`` (:data:`FONT_PATH`, or ``$CROWDTRAIN_EMOJI_FONT``).
Which emoji take a modifier is read from the font itself: a base is a code point for which
the font joins base + modifier into ONE glyph that differs from the base's own (Python's
``unicodedata`` does not carry the Emoji_Modifier_Base property). :data:`GROUPS` sorts the bases
into named groups; ``bases`` picks them ("hands", "hands+people", "all").

``ensure_emoji_shards`` makes the whole organizer's path once and caches it (like
:func:`crowdtrain.data.demo.ensure_demo_shards`): pictures + ``.txt`` captions in a work folder,
a learned VQ image tokenizer trained on the train pictures (``crowdtrain tokenizer train``), a
BPE text tokenizer trained on the captions (``crowdtrain tokenizer train-text``), and
``prepare_shards`` for each split. ``crowdtrain data emoji --out DIR`` writes the pictures only,
for an organizer-style run by hand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FONT_PATH = Path("/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf")
FONT_ENV = "CROWDTRAIN_EMOJI_FONT"
FONT_PACKAGE = "fonts-noto-color-emoji"
FONT_SIZE = 109  # the font's only bitmap strike: Pillow refuses other sizes for this font
IMAGE_SIZE = 64

# (caption words, modifier): the default yellow first, then the five Fitzpatrick modifiers.
TONES: tuple[tuple[str, str], ...] = (
    ("yellow", ""),
    ("light", "\U0001F3FB"),
    ("medium-light", "\U0001F3FC"),
    ("medium", "\U0001F3FD"),
    ("medium-dark", "\U0001F3FE"),
    ("dark", "\U0001F3FF"),
)

# Named groups of modifier bases, by code point. A base the font supports that is in none of
# them belongs to "activities" (sports, couples, bath, ...). The font decides membership: a
# listed code point the font cannot tone is left out with a warning.
HANDS = (  # hands, arms and other body parts: one large area of skin, the clearest tone
    0x261D, 0x270A, 0x270B, 0x270C, 0x270D, 0x1F442, 0x1F443, *range(0x1F446, 0x1F451), 0x1F485, 0x1F4AA,
    0x1F590, 0x1F596, 0x1F64C, 0x1F64F, 0x1F90C, 0x1F90F, *range(0x1F918, 0x1F920), 0x1F932, 0x1F933,
    0x1F9B5, 0x1F9B6, 0x1F9BB, *range(0x1FAF0, 0x1FAF9),
)
PEOPLE = (  # one person, face and upper body: the tone is a smaller area (the face)
    0x1F385, *range(0x1F466, 0x1F46A), 0x1F46E, *range(0x1F470, 0x1F479), 0x1F47C, 0x1F481, 0x1F482, 0x1F486,
    0x1F487, 0x1F575, 0x1F645, 0x1F646, 0x1F647, 0x1F64B, 0x1F64D, 0x1F64E, 0x1F926, 0x1F930, 0x1F934,
    0x1F935, 0x1F936, 0x1F937, 0x1F977, 0x1F9B8, 0x1F9B9, 0x1F9CF, *range(0x1F9D1, 0x1F9D6),
    *range(0x1F9D9, 0x1F9DE), 0x1FAC3, 0x1FAC4, 0x1FAC5,
)
EXCLUDED = (0x1F595,)  # the middle finger: not in a demo
GROUP_NAMES = ("hands", "people", "activities")
DEFAULT_BASES = "hands"
# Pictures per seen composition in train: 200 x 230 seen compositions of "hands" = 46,000
# pictures, chosen by benchmarks/bench_emoji_curve.py. A 30-minute 3-peer demo trains on about
# 150k samples; one process there, on the demo model: with 100 renderings the model memorised
# (validation loss 1.47x the training loss, held-out compositions right in both parts 0.53), with
# 200 it generalised (1.16x, 0.78). If your own run memorises, more pictures help most.
DEFAULT_RENDERINGS = 200
MIN_VALID = 256  # the valid split gets enough fresh renderings of each seen composition for this
HELDOUT_RENDERINGS = 4  # pictures per held-out composition
# Jitter: the emoji's longer side is this share of the frame; it is placed anywhere it fits.
SCALE_RANGE = (0.6, 0.95)
CANONICAL_SCALE = 0.8  # the judge's references: centred, this size
# Names whose Unicode words do not say what the picture shows.
NAME_FIXES = {"ROWBOAT": "person rowing a boat", "BATH": "person taking a bath",
              "SLEEPING ACCOMMODATION": "person in bed", "SLEUTH OR SPY": "detective",
              "WEIGHT LIFTER": "person lifting weights", "FACE PALM": "person facepalming"}

MARKER = "emoji.json"
IMAGE_TOKENIZER_FILE = "image_tokenizer.safetensors"
TEXT_TOKENIZER_FILE = "text_tokenizer.json"
SHARD_SIZE = 5_000


# ---- the font -----------------------------------------------------------------------------

def find_font(path=None) -> Path:
    """The Noto Color Emoji font file, or a FileNotFoundError naming the package to install."""
    path = Path(path or os.environ.get(FONT_ENV) or FONT_PATH)
    if not path.is_file():
        raise FileNotFoundError(
            f"the emoji data set is drawn with the Noto Color Emoji font, which is not at {path}: install it "
            f"with `sudo apt-get install {FONT_PACKAGE}` (or set {FONT_ENV} to a NotoColorEmoji.ttf)")
    return path


def _load_font(path: Path):
    from PIL import ImageFont, features

    if not features.check("raqm"):
        raise ValueError("this Pillow has no raqm text layout (libraqm), so it cannot join an emoji and its "
                         "skin-tone modifier into one picture: install Pillow's wheel from PyPI "
                         "(`pip install --force-reinstall pillow`) or Debian's libraqm0")
    try:
        return ImageFont.truetype(str(path), FONT_SIZE, layout_engine=ImageFont.Layout.RAQM)
    except OSError as e:
        raise ValueError(f"{path} cannot be loaded as the Noto Color Emoji font at size {FONT_SIZE} ({e}); "
                         f"reinstall it with `sudo apt-get install --reinstall {FONT_PACKAGE}`") from e


def font_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


# ---- compositions -------------------------------------------------------------------------

def base_name(codepoint: int) -> str:
    """A base's readable name: 'WAVING HAND SIGN' -> 'waving hand'; 'WHITE UP POINTING INDEX' ->
    'up pointing index' ('white' there means an outline, not a skin colour)."""
    name = unicodedata.name(chr(codepoint))
    if name in NAME_FIXES:
        return NAME_FIXES[name]
    name = name.lower()
    if name.endswith(" sign"):
        name = name[: -len(" sign")]
    if name.startswith("white "):
        name = name[len("white "):]
    return name


def caption(codepoint: int, tone: int) -> str:
    """'waving hand, medium skin tone'."""
    return f"{base_name(codepoint)}, {TONES[tone][0]} skin tone"


@dataclass(frozen=True)
class Composition:
    """One base in one tone: what a caption asks for."""

    codepoint: int
    tone: int  # index into TONES

    @property
    def text(self) -> str:
        return chr(self.codepoint) + TONES[self.tone][1]

    @property
    def caption(self) -> str:
        return caption(self.codepoint, self.tone)


class EmojiFont:
    """The font, its modifier bases and a cache of rendered glyphs (RGB on white, cropped)."""

    def __init__(self, path=None):
        self.path = find_font(path)
        self.font = _load_font(self.path)
        self._glyphs: dict[str, object] = {}
        self._bases: tuple[int, ...] | None = None

    def glyph(self, text: str):
        """The PIL RGB picture of ``text`` on white, cropped to the drawn pixels (cached)."""
        from PIL import Image, ImageDraw

        if text not in self._glyphs:
            canvas = Image.new("RGBA", (2 * FONT_SIZE + 40, FONT_SIZE + 40), (255, 255, 255, 0))
            ImageDraw.Draw(canvas).text((4, 4), text, font=self.font, embedded_color=True)
            box = canvas.getchannel("A").getbbox()
            if box is None:
                raise ValueError(f"the font draws nothing for {text!r}")
            white = Image.new("RGBA", canvas.size, (255, 255, 255, 255))
            self._glyphs[text] = Image.alpha_composite(white, canvas).convert("RGB").crop(box)
        return self._glyphs[text]

    def takes_tones(self, codepoint: int) -> bool:
        """Whether the font draws ``codepoint`` + each modifier as one glyph, unlike the plain base."""
        ch = chr(codepoint)
        width = self.font.getlength(ch)
        if width <= 0:
            return False
        plain = np.asarray(self.glyph(ch))
        for _, modifier in TONES[1:]:
            # Not joined, the modifier draws as a separate colour swatch: twice the advance.
            if abs(self.font.getlength(ch + modifier) - width) > 0.5:
                return False
            toned = np.asarray(self.glyph(ch + modifier))
            if toned.shape == plain.shape and np.array_equal(toned, plain):
                return False
        return True

    def bases(self) -> tuple[int, ...]:
        """Every code point (with a Unicode name) in the emoji blocks that the font tones, sorted."""
        if self._bases is None:
            candidates = [cp for cp in (*range(0x2600, 0x27C0), *range(0x1F300, 0x1FB00))
                          if unicodedata.name(chr(cp), None) and cp not in EXCLUDED]
            # The cheap test first (one glyph's advance), the pictures only for those that pass.
            cheap = [cp for cp in candidates
                     if abs(self.font.getlength(chr(cp) + TONES[3][1]) - self.font.getlength(chr(cp))) <= 0.5
                     and self.font.getlength(chr(cp)) > 0]
            self._bases = tuple(cp for cp in cheap if self.takes_tones(cp))
        return self._bases


def group_of(codepoint: int) -> str:
    return "hands" if codepoint in HANDS else "people" if codepoint in PEOPLE else "activities"


def parse_bases(spec: str) -> tuple[str, ...]:
    """'hands' / 'hands+people' / 'all' -> the group names, or a ValueError naming the choices."""
    if spec == "all":
        return GROUP_NAMES
    groups = tuple(g.strip() for g in spec.split("+"))
    unknown = [g for g in groups if g not in GROUP_NAMES]
    if unknown or not groups:
        raise ValueError(f"--bases {spec!r}: unknown group(s) {unknown}; choose groups from {list(GROUP_NAMES)} "
                         "joined with '+' (e.g. 'hands+people'), or 'all'")
    return groups


def select_bases(font: EmojiFont, spec: str = DEFAULT_BASES, max_bases: int | None = None) -> tuple[int, ...]:
    """The bases of the groups in ``spec`` that the font tones, sorted; ``max_bases`` keeps that
    many spread evenly over them (a smaller data set for the benchmark curve)."""
    groups = parse_bases(spec)
    found = set(font.bases())
    for listed in (*HANDS, *PEOPLE):
        if listed not in found and group_of(listed) in groups and unicodedata.name(chr(listed), None):
            logger.warning("the font at %s cannot tone U+%04X (%s): left out", font.path, listed,
                           unicodedata.name(chr(listed)))
    bases = tuple(cp for cp in sorted(found) if group_of(cp) in groups)
    if not bases:
        raise ValueError(f"the font at {font.path} tones none of the emoji in {spec!r}: is it the colour emoji "
                         f"font of `{FONT_PACKAGE}`?")
    if max_bases is not None:
        if max_bases < 1:
            raise ValueError(f"--max-bases must be >= 1, got {max_bases}")
        if max_bases < len(bases):
            bases = tuple(bases[math.floor(i * len(bases) / max_bases)] for i in range(max_bases))
    return bases


def heldout_tones(bases, seed: int) -> dict[int, int]:
    """base -> the tone it is never trained with: tones rotate over the bases in an order
    shuffled by ``seed``, so each tone is held out for about len(bases) / 6 of them."""
    order = np.random.default_rng([seed, 17]).permutation(len(bases))
    return {bases[int(i)]: rank % len(TONES) for rank, i in enumerate(order)}


def split_compositions(bases, seed: int) -> tuple[list[Composition], list[Composition]]:
    """(seen, held-out) compositions, each in base then tone order."""
    held = heldout_tones(bases, seed)
    seen = [Composition(b, t) for b in bases for t in range(len(TONES)) if held[b] != t]
    return seen, [Composition(b, held[b]) for b in bases]


# ---- pictures -----------------------------------------------------------------------------

def render(font: EmojiFont, comp: Composition, rng: np.random.Generator | None = None) -> np.ndarray:
    """One 64x64 RGB picture of ``comp`` on white: jittered by ``rng`` (size and position), or
    centred at :data:`CANONICAL_SCALE` when ``rng`` is None."""
    from PIL import Image

    glyph = font.glyph(comp.text)
    if rng is None:
        scale = CANONICAL_SCALE
    else:
        scale = float(rng.uniform(*SCALE_RANGE))
    w, h = glyph.size
    factor = scale * IMAGE_SIZE / max(w, h)
    size = (max(1, round(w * factor)), max(1, round(h * factor)))
    small = glyph.resize(size, Image.LANCZOS)
    if rng is None:
        x, y = (IMAGE_SIZE - size[0]) // 2, (IMAGE_SIZE - size[1]) // 2
    else:
        x, y = int(rng.integers(0, IMAGE_SIZE - size[0] + 1)), int(rng.integers(0, IMAGE_SIZE - size[1] + 1))
    frame = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    frame.paste(small, (x, y))
    return np.asarray(frame)


SPLITS = ("train", "valid", "heldout")


@dataclass(frozen=True)
class EmojiSet:
    """What a data set holds: its bases, held-out tones and how many pictures of each split."""

    bases: tuple[int, ...]
    seed: int = 0
    renderings: int = DEFAULT_RENDERINGS
    heldout_renderings: int = HELDOUT_RENDERINGS

    def __post_init__(self):
        if self.renderings < 1 or self.heldout_renderings < 1:
            raise ValueError("--renderings must be >= 1")
        if not self.bases:
            raise ValueError("an emoji set needs at least one base")

    @property
    def compositions(self) -> tuple[list[Composition], list[Composition]]:
        return split_compositions(self.bases, self.seed)

    @property
    def valid_renderings(self) -> int:
        return max(1, math.ceil(MIN_VALID / len(self.compositions[0])))

    def plan(self, split: str) -> list[tuple[Composition, int]]:
        """(composition, rendering index) of each picture of ``split``, in file order: the train
        split shuffled (a shard then holds every composition, as streaming's shuffle buffer needs)."""
        seen, held = self.compositions
        if split == "train":
            plan = [(c, k) for c in seen for k in range(self.renderings)]
            order = np.random.default_rng([self.seed, 23]).permutation(len(plan))
            return [plan[int(i)] for i in order]
        if split == "valid":
            return [(c, k) for c in seen for k in range(self.valid_renderings)]
        if split == "heldout":
            return [(c, k) for c in held for k in range(self.heldout_renderings)]
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")

    def pictures(self, font: EmojiFont, split: str):
        """(image, caption, composition) of each picture of ``split``. A picture's jitter is seeded
        by (seed, split, composition, index): the splits never share a rendering."""
        salt = SPLITS.index(split) + 1
        for comp, k in self.plan(split):
            rng = np.random.default_rng([self.seed, salt, comp.codepoint, comp.tone, k])
            yield render(font, comp, rng), comp.caption, comp

    def record(self, group_spec: str, max_bases: int | None) -> dict:
        """The ``dataset`` entry of ``shards.json``: enough for a judge to rebuild the compositions."""
        held = heldout_tones(self.bases, self.seed)
        seen, heldout = self.compositions
        return {"name": "emoji", "bases_spec": group_spec, "max_bases": max_bases, "seed": self.seed,
                "renderings": self.renderings, "tones": [t for t, _ in TONES],
                "bases": [{"codepoint": f"{cp:04X}", "name": base_name(cp), "group": group_of(cp),
                           "heldout_tone": TONES[held[cp]][0]} for cp in self.bases],
                "compositions": {"seen": len(seen), "heldout": len(heldout)},
                "pictures": {s: len(self.plan(s)) for s in SPLITS}}


def emoji_set_from_record(record: dict) -> EmojiSet:
    """The :class:`EmojiSet` a ``dataset`` record (``shards.json``) describes."""
    try:
        bases = tuple(int(b["codepoint"], 16) for b in record["bases"])
        result = EmojiSet(bases=bases, seed=int(record["seed"]), renderings=int(record.get("renderings", 1)))
        recorded = {int(b["codepoint"], 16): b["heldout_tone"] for b in record["bases"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not an emoji data set record ({type(e).__name__}: {e})") from e
    held = heldout_tones(bases, result.seed)
    if any(TONES[held[cp]][0] != tone for cp, tone in recorded.items()):
        raise ValueError("the emoji record's held-out tones differ from this code's: it was made by another "
                         "version of crowdtrain; make the data set again")
    return result


def make_emoji_set(font: EmojiFont, *, bases: str = DEFAULT_BASES, max_bases: int | None = None,
                   renderings: int = DEFAULT_RENDERINGS, seed: int = 0) -> EmojiSet:
    return EmojiSet(bases=select_bases(font, bases, max_bases), seed=seed, renderings=renderings)


def write_emoji_folder(out, emoji_set: EmojiSet, font: EmojiFont, *, splits=SPLITS, progress: bool = False) -> dict:
    """PNG pictures + ``.txt`` captions under ``out/{split}/``: an organizer's input folder
    (``crowdtrain tokenizer train --data out/train``, ``crowdtrain data prepare --input out/train``).
    Returns the number of pictures per split."""
    from PIL import Image
    from tqdm import tqdm

    out = Path(out)
    counts = {}
    for split in splits:
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        n = len(emoji_set.plan(split))
        digits = max(6, len(str(n)))
        for i, (image, text, _) in enumerate(tqdm(emoji_set.pictures(font, split), total=n, desc=f"draw {split}",
                                                  unit="img", disable=not progress)):
            # File names in plan order: `data prepare` reads a folder in sorted order.
            Image.fromarray(image).save(folder / f"{i:0{digits}d}.png", compress_level=1)
            (folder / f"{i:0{digits}d}.txt").write_text(text + "\n")
        counts[split] = n
    return counts


# ---- the shards, made once ----------------------------------------------------------------

# Steps of the learned VQ tokenizer (crowdtrain tokenizer train); see ensure_emoji_shards.
DEFAULT_VQ_STEPS = 3000
TEXT_VOCAB_SIZE = 1024  # the `demo` preset's text_vocab_size: the tokenizer stops merging well below it
BUILD_FORMAT = 1  # raise when the build changes what it makes: the cache key changes with it
# The build runs torch on one thread: the same tokenizer file whatever the core count (torch's
# results depend on the thread count), and a busy machine does not stall it. Measured on 2 cores, 3000 steps: 0.04 s a
# step on 2 idle threads, 0.05-0.07 on 1 thread beside other work, 0.3-1.6 on 2 threads beside it.
TORCH_THREADS = 1


def emoji_recipe(font: EmojiFont, emoji_set: EmojiSet, *, bases: str, max_bases: int | None, vq_steps: int) -> dict:
    """What makes an emoji shard folder: equal recipes give equal shards (the cache key)."""
    # A change to the font, Pillow's drawing or the jitter changes these first pictures, and so the key.
    h = hashlib.sha256()
    for i, (image, text, _) in enumerate(emoji_set.pictures(font, "train")):
        if i == 8:
            break
        h.update(image.tobytes())
        h.update(text.encode())
    h.update(json.dumps([f"{cp:04X}" for cp in emoji_set.bases]).encode())
    return {"name": "emoji", "format": BUILD_FORMAT, "bases": bases, "max_bases": max_bases,
            "renderings": emoji_set.renderings, "seed": emoji_set.seed, "vq_steps": vq_steps,
            "text_vocab_size": TEXT_VOCAB_SIZE, "shard_size": SHARD_SIZE, "torch_threads": TORCH_THREADS,
            "font": font_digest(font.path),
            "pictures": h.hexdigest()[:16]}


def ensure_emoji_shards(directory, *, bases: str = DEFAULT_BASES, max_bases: int | None = None,
                        renderings: int = DEFAULT_RENDERINGS, seed: int = 0, vq_steps: int = DEFAULT_VQ_STEPS,
                        font_path=None, cache: str | Path | bool = True, progress: bool | None = None) -> Path:
    """Make (if missing) the emoji shards and their tokenizers under ``directory``; return it.

    The folder then holds the ``train``/``valid``/``heldout`` shards, ``shards.json`` (with a
    ``dataset`` record: what the judge needs, the tokenizers' file names and the tokenizer's
    PSNR), ``image_tokenizer.safetensors`` and ``text_tokenizer.json`` (pass them to the
    coordinator as ``--image-tokenizer`` / ``--text-tokenizer``), ``preview.png`` (real
    pictures over their reconstructions) and ``emoji.json`` (the recipe; written last).

    Cost on 2 CPU cores, for the defaults (46,000 train pictures): drawing and encoding the
    shards under a minute each; the tokenizer (``vq_steps``) most of the time, 0.04 s a step on
    idle cores, 0.3 s on busy ones (figures in docs/data.md). Fewer ``vq_steps`` give blurrier
    codes (PSNR on valid: 22.5 dB after 500 steps, 25.3 after 3000); more sharpen fine details
    (finger lines) slowly.

    ``cache``: True = the shared cache (``$CROWDTRAIN_CACHE``, else ``~/.cache/crowdtrain``), a path =
    that cache folder, False = none (made in ``directory``). An interrupt (Ctrl-C) during the
    tokenizer's training keeps its state next to the cache entry: the same call continues it.
    """
    from crowdtrain.data.demo import build_cached, default_cache_dir

    if vq_steps <= 0:
        raise ValueError("--vq-steps must be positive")
    out = Path(directory)
    font = EmojiFont(font_path)
    emoji_set = make_emoji_set(font, bases=bases, max_bases=max_bases, renderings=renderings, seed=seed)
    recipe = emoji_recipe(font, emoji_set, bases=bases, max_bases=max_bases, vq_steps=vq_steps)
    if _is_finished(out, recipe):
        return out
    if progress is None:
        progress = len(emoji_set.plan("train")) >= 2_000
    cache_root = default_cache_dir() if cache is True else Path(cache) if cache else None
    return build_cached(
        out, cache_root=cache_root, entry=f"emoji-{bases.replace('+', '-')}-{len(emoji_set.bases)}x{renderings}",
        recipe=recipe, marker=MARKER, is_finished=lambda folder: _is_finished(folder, recipe), clear=_clear,
        make=lambda folder, entry: _make(folder, recipe, emoji_set, font, progress=progress,
                                         resume=(entry or folder).with_name((entry or folder).name
                                                                            + ".vq-resume.safetensors")),
        what="the emoji data set")


def emoji_tokenizers(directory) -> dict[str, Path]:
    """The run's tokenizers in a finished emoji shard folder: ``{"image": ..., "text": ...}``."""
    directory = Path(directory)
    paths = {"image": directory / IMAGE_TOKENIZER_FILE, "text": directory / TEXT_TOKENIZER_FILE}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{directory} is not a finished emoji data set (missing {missing}); make it with "
                                "`crowdtrain demo --data emoji` or ensure_emoji_shards")
    return paths


def _is_finished(folder: Path, recipe: dict) -> bool:
    from crowdtrain.data.shards import read_manifest

    try:
        if json.loads((folder / MARKER).read_text()) != recipe:
            return False
        manifest = read_manifest(folder)
    except (OSError, ValueError):
        return False
    return bool(manifest and (manifest.get("dataset") or {}).get("name") == "emoji"
                and (folder / IMAGE_TOKENIZER_FILE).is_file() and (folder / TEXT_TOKENIZER_FILE).is_file())


def _clear(out: Path) -> None:
    """Remove what an older recipe (or an interrupted build) left, and nothing else."""
    from crowdtrain.data.shards import MANIFEST

    if out.exists():
        for old in [*out.glob("*.parquet"), *out.glob("skipped-*.txt"), out / MANIFEST, out / MARKER,
                    out / IMAGE_TOKENIZER_FILE, out / TEXT_TOKENIZER_FILE, out / "preview.png"]:
            old.unlink(missing_ok=True)
        shutil.rmtree(out / "pictures", ignore_errors=True)


def _make(out: Path, recipe: dict, emoji_set: EmojiSet, font: EmojiFont, *, progress: bool, resume: Path) -> None:
    """:func:`_build` on ``recipe["torch_threads"]`` torch threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe["torch_threads"])
    try:
        _build(out, recipe, emoji_set, font, progress=progress, resume=resume)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, recipe: dict, emoji_set: EmojiSet, font: EmojiFont, *, progress: bool, resume: Path) -> None:
    """The organizer's path, in one process: pictures, tokenizers, shards, the dataset record."""
    from crowdtrain.data.config import VQTrainConfig
    from crowdtrain.data.image_tokenizer import load_image_tokenizer
    from crowdtrain.data.shards import MANIFEST, _write_json, prepare_shards, read_manifest
    from crowdtrain.data.tokenizers import read_captions, train_text_tokenizer
    from crowdtrain.data.vq_train import load_image_folder, reconstruction_report, train_vq

    out.mkdir(parents=True, exist_ok=True)
    work = out / "pictures"
    seconds = {}
    t0 = time.monotonic()
    counts = write_emoji_folder(work, emoji_set, font, progress=progress)
    seconds["draw"] = time.monotonic() - t0

    t0 = time.monotonic()
    images, _ = load_image_folder(work / "train", IMAGE_SIZE)
    config = VQTrainConfig(steps=recipe["vq_steps"], seed=emoji_set.seed)
    model = train_vq(images, config, progress=progress, resume_path=resume)
    model.save(out / IMAGE_TOKENIZER_FILE, half=True)
    seconds["image_tokenizer"] = time.monotonic() - t0
    del model
    # Reports from the saved file: the codes the shards hold are the ones it gives.
    tokenizer = load_image_tokenizer(out / IMAGE_TOKENIZER_FILE)
    valid, _ = load_image_folder(work / "valid", IMAGE_SIZE)
    report = {"steps": config.steps, "train": reconstruction_report(tokenizer, images[:1000]),
              "valid": reconstruction_report(tokenizer, valid)}
    _write_preview(out / "preview.png", valid[:: max(1, len(valid) // 24)][:24], tokenizer)
    del images

    t0 = time.monotonic()
    text_tokenizer = train_text_tokenizer(read_captions(work / "train"), vocab_size=recipe["text_vocab_size"],
                                          out=out / TEXT_TOKENIZER_FILE)
    lengths = [len(text_tokenizer.tokenizer.encode(c.caption, add_special_tokens=False).ids)
               for c in (*emoji_set.compositions[0], *emoji_set.compositions[1])]
    seconds["text_tokenizer"] = time.monotonic() - t0

    t0 = time.monotonic()
    for split in SPLITS:
        prepare_shards(work / split, out, tokenizer, split=split, shard_size=SHARD_SIZE, progress=progress)
    seconds["shards"] = time.monotonic() - t0

    manifest = read_manifest(out)
    manifest["dataset"] = {
        **emoji_set.record(recipe["bases"], recipe["max_bases"]),
        "image_tokenizer": IMAGE_TOKENIZER_FILE, "text_tokenizer": TEXT_TOKENIZER_FILE,
        "tokenizer_report": {"steps": report["steps"], "psnr_db_train": report["train"]["psnr_db"],
                             "psnr_db_valid": report["valid"]["psnr_db"],
                             "codes_used_valid": report["valid"]["codes_used"]},
        "caption_tokens_max": max(lengths), "build_seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    _write_json(out / MANIFEST, manifest)
    shutil.rmtree(work, ignore_errors=True)
    (out / MARKER).write_text(json.dumps(recipe))
    logger.info("emoji shards ready in %s: %s pictures, tokenizer PSNR %.1f dB on valid, %s", out, counts,
                report["valid"]["psnr_db"], manifest["dataset"]["build_seconds"])


def _write_preview(path: Path, images: np.ndarray, tokenizer) -> None:
    """Real pictures (odd rows) over their reconstructions through ``tokenizer`` (even rows)."""
    import torch

    from crowdtrain.data.generate import make_grid

    per_row = min(8, len(images))
    images = images[: len(images) // per_row * per_row]
    recon = tokenizer.decode(tokenizer.encode(images)).cpu()
    rows = []
    for i in range(0, len(images), per_row):
        rows += [torch.from_numpy(images[i: i + per_row]), recon[i: i + per_row]]
    grid = make_grid(torch.cat(rows), columns=per_row)
    grid.resize((grid.width * 2, grid.height * 2)).save(path)
