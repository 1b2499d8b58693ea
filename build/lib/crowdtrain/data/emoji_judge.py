"""The emoji data set's automatic judge: which real picture is a generated one nearest to?

Reference set: one canonical rendering (centred, one size) of EVERY composition of the data set,
seen and held-out: for the default "hands" set, 46 bases x 6 tones = 276 pictures. A
generated 64x64 image and each reference go through the same :func:`normalise`:

1. the content is what is not near-white (min channel below 215); its bounding box is taken
   between the 1st and 99th percentile of the content pixels' rows and columns, so a few stray
   pixels do not stretch it;
2. the box is made square around its centre (white padding) and resized to 24x24: position and
   size, the data set's jitter, are gone;
3. a Gaussian blur (radius 1) forgives the small shifts and the tokenizer's blur.

The distance is the mean squared RGB difference of the normalised pictures (0..1 scale). Per
generated image the judge reports:

- ``top5``: the prompted composition is among the 5 nearest references ("recognisable");
- ``base_right`` / ``tone_right``: the nearest reference has the prompted base / tone;
- ``tone_of_base``: the prompted base's own 6 references, nearest first, give the prompted tone
  (the tone read even when the base is drawn badly);
- ``both_right``: base and tone of the nearest reference are right;
- ``all``: for a seen prompt ``top5`` and ``tone_right`` (recognisable, in the asked tone: with
  six tones per base, the 5 nearest of a picture in the wrong tone are mostly its base's other
  tones, so top-5 alone would pass it); for a held-out prompt ``both_right``.

An image whose nearest reference is further than :data:`REJECT_DISTANCE` (blank, noise, a
smear) passes nothing. The judge's own accuracy on real pictures it never saw (fresh
renderings, and the same passed through the learned tokenizer) is measured in
tests/test_data_emoji.py.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from crowdtrain.data.emoji import TONES, Composition, EmojiFont, EmojiSet, emoji_set_from_record, render

logger = logging.getLogger(__name__)

NORM_SIZE = 24
INK_BELOW = 215  # a pixel whose darkest channel is below this is content (white = 255)
MIN_INK_PIXELS = 24  # fewer content pixels than this: a blank image
BLUR_RADIUS = 1.0
TOP_K = 5
# Nearest-reference distances (hands set): fresh real renderings at most 0.003; the same through
# the demo's learned tokenizer at most 0.0195 (99% below 0.010); uniform noise 0.030 or more.
# Above this the image is no emoji of the set. A blurrier tokenizer (fewer steps) needs it higher.
REJECT_DISTANCE = 0.025
PROMPTS_PER_GROUP = 8


def normalise(image: np.ndarray) -> np.ndarray | None:
    """(64, 64, 3) uint8 -> (NORM_SIZE * NORM_SIZE * 3,) float32 in 0..1, or None when blank."""
    from PIL import Image, ImageFilter

    image = np.asarray(image, dtype=np.uint8)
    ink = image.min(axis=2) < INK_BELOW
    if ink.sum() < MIN_INK_PIXELS:
        return None
    rows, cols = np.nonzero(ink)
    top, bottom = np.percentile(rows, [1, 99])
    left, right = np.percentile(cols, [1, 99])
    side = max(bottom - top, right - left) + 1
    cy, cx = (top + bottom) / 2, (left + right) / 2
    box = (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)
    pil = Image.fromarray(image)
    # Pad with white so a box that runs over the frame's edge reads white there.
    pad = int(math.ceil(side))
    padded = Image.new("RGB", (pil.width + 2 * pad, pil.height + 2 * pad), (255, 255, 255))
    padded.paste(pil, (pad, pad))
    box = tuple(v + pad for v in box)
    small = padded.resize((NORM_SIZE, NORM_SIZE), Image.BILINEAR, box=box, reducing_gap=None)
    small = small.filter(ImageFilter.GaussianBlur(BLUR_RADIUS))
    return np.asarray(small, dtype=np.float32).reshape(-1) / 255.0


class EmojiJudge:
    """Judge for the emoji data set (see the module docstring); ``judge(prompt, images)``."""

    name = "emoji"

    def __init__(self, emoji_set: EmojiSet, font: EmojiFont | None = None, *,
                 prompts_per_group: int = PROMPTS_PER_GROUP):
        self.emoji_set = emoji_set
        self.font = font or EmojiFont()
        self.prompts_per_group = prompts_per_group
        seen, heldout = emoji_set.compositions
        self.seen, self.heldout = seen, heldout
        self.references = [Composition(b, t) for b in emoji_set.bases for t in range(len(TONES))]
        self.by_caption = {c.caption: c for c in self.references}
        self.heldout_set = set(heldout)
        self.ref_vectors = np.stack([normalise(render(self.font, c)) for c in self.references])

    @classmethod
    def from_record(cls, record: dict, font: EmojiFont | None = None, **kwargs) -> "EmojiJudge":
        """The judge of the data set a ``shards.json`` ``dataset`` record describes."""
        return cls(emoji_set_from_record(record), font, **kwargs)

    @classmethod
    def from_shards(cls, directory, font: EmojiFont | None = None, **kwargs) -> "EmojiJudge":
        from crowdtrain.data.shards import read_manifest

        record = (read_manifest(directory) or {}).get("dataset") or {}
        if record.get("name") != "emoji":
            raise ValueError(f"{directory} holds no emoji data set (its shards.json has no dataset record named "
                             "'emoji'): make it with `crowdtrain demo --data emoji`")
        return cls.from_record(record, font, **kwargs)

    # ---- prompts ------------------------------------------------------------------------

    def prompts(self) -> dict[str, list[str]]:
        """``{"seen": [...], "heldout": [...]}``: up to ``prompts_per_group`` captions each, spread
        over the tones (round robin) and, within a tone, evenly over the bases."""
        return {"seen": [c.caption for c in _spread(self.seen, self.prompts_per_group, offset=0.25)],
                "heldout": [c.caption for c in _spread(self.heldout, self.prompts_per_group, offset=0.5)]}

    # ---- judging ------------------------------------------------------------------------

    def composition(self, prompt: str) -> Composition:
        try:
            return self.by_caption[prompt.strip()]
        except KeyError:
            raise ValueError(f"{prompt!r} is no caption of this emoji data set (e.g. "
                             f"{self.references[0].caption!r})") from None

    def reference(self, prompt: str) -> np.ndarray:
        """The real picture of ``prompt`` (its centred rendering, (64, 64, 3) uint8), which the
        demo's grid shows first: for a held-out composition, a picture the model never saw."""
        return render(self.font, self.composition(prompt))

    def distances(self, images) -> np.ndarray:
        """(N, 64, 64, 3) uint8 -> (N, references) distances; a blank image's row is inf."""
        out = np.full((len(images), len(self.references)), np.inf, dtype=np.float32)
        for i, image in enumerate(np.asarray(images)):
            v = normalise(image)
            if v is not None:
                out[i] = ((self.ref_vectors - v[None]) ** 2).mean(axis=1)
        return out

    def judge(self, prompt: str, images) -> list[dict]:
        """One verdict per image of ``images`` ((N, 64, 64, 3) uint8) for ``prompt``."""
        want = self.composition(prompt)
        images = np.asarray(images)
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"images must be (N, H, W, 3) uint8, got shape {images.shape}")
        want_index = self.references.index(want)
        own = [i for i, c in enumerate(self.references) if c.codepoint == want.codepoint]
        heldout = want in self.heldout_set
        verdicts = []
        for row in self.distances(images):
            order = np.argsort(row, kind="stable")
            best = self.references[int(order[0])]
            recognised = bool(np.isfinite(row[order[0]]) and row[order[0]] <= REJECT_DISTANCE)
            base_right = recognised and best.codepoint == want.codepoint
            tone_right = recognised and best.tone == want.tone
            tone_of_base = recognised and self.references[own[int(np.argmin(row[own]))]].tone == want.tone
            top5 = recognised and want_index in order[:TOP_K].tolist()
            v = {"top5": top5, "base_right": base_right, "tone_right": tone_right, "tone_of_base": tone_of_base,
                 "both_right": base_right and tone_right, "nearest": best.caption if recognised else None,
                 "distance": float(row[order[0]])}
            v["all"] = v["both_right"] if heldout else (top5 and tone_right)
            verdicts.append(v)
        return verdicts


def _spread(comps: list[Composition], n: int, *, offset: float) -> list[Composition]:
    """Up to ``n`` of ``comps``: tones in turn, each tone's bases evenly spread."""
    by_tone = [[c for c in comps if c.tone == t] for t in range(len(TONES))]
    by_tone = [lst for lst in by_tone if lst]
    rounds = math.ceil(n / max(1, len(by_tone)))
    picked: list[Composition] = []
    for r in range(rounds):
        for k, lst in enumerate(by_tone):
            # Staggered by tone too, so the tones of one round fall on different bases.
            c = lst[int((r + offset + k / len(by_tone)) * len(lst) / rounds) % len(lst)]
            if c not in picked and len(picked) < n:
                picked.append(c)
    return picked


def sample_prompts(judge: EmojiJudge, per_group: int | None = None) -> list[dict]:
    """The judge's prompts as a run's sample prompts (``crowdtrain.data.sample_prompts``):
    ``per_group`` seen ones tagged ``seen``, then as many held-out ones tagged ``held-out``."""
    prompts = judge.prompts()
    n = per_group or len(prompts["seen"])
    return ([{"prompt": p, "tag": "seen"} for p in prompts["seen"][:n]]
            + [{"prompt": p, "tag": "held-out"} for p in prompts["heldout"][:n]])


def write_prompt_file(judge: EmojiJudge, path, per_group: int | None = None) -> Path:
    """A ``--sample-prompts`` file (``[tag] prompt`` lines) of :func:`sample_prompts`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"[{p['tag']}] {p['prompt']}" for p in sample_prompts(judge, per_group)]
    path.write_text("# the emoji judge's prompts: seen compositions, then held-out ones\n" + "\n".join(lines) + "\n")
    return path
