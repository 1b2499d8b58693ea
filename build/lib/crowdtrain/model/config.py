"""Typed model configuration and the named presets (`tiny`, `demo`, `paper`).

The sequence the model sees is ``[text tokens | image tokens]``: ``text_len`` text positions
followed by an ``image_height x image_width`` grid of VQ codes in raster order. Attention
patterns and weight sharing are data: ``patterns[i]`` names layer i's image-attention pattern
and ``share_ids[i]`` its sharing group (layers with the same id use the same attention and
feed-forward module objects).

The sampling defaults (``DEFAULT_TOP_K``, ``DEFAULT_TOP_P``) live here too, torch-free, so that
every sampler and every CLI flag reads the same ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

PATTERNS = ("full", "axial_row", "axial_col", "conv_like")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the DALL-E-like decoder. Every field has a default that builds and runs."""

    width: int = 64
    depth: int = 4
    heads: int = 4
    head_dim: int = 16
    ff_mult: int = 4  # GEGLU hidden size = ff_mult * width
    text_len: int = 16
    text_vocab_size: int = 256
    text_pad_id: int = 0  # padded text positions are neither attended to nor trained on
    image_height: int = 8
    image_width: int = 8
    image_vocab_size: int = 64
    patterns: tuple[str, ...] = ("axial_row", "axial_col", "axial_row", "conv_like")
    share_ids: tuple[int, ...] = (0, 1, 2, 3)
    conv_kernel: int = 5  # the k of conv_like's causal k x k window (odd)
    rotary: bool = True
    reversible: bool = False
    checkpointing: bool = False  # per-layer activation checkpointing (ignored when reversible)
    image_loss_weight: float = 7.0  # loss = (CE_text + w * CE_image) / (1 + w)
    dropout: float = 0.0
    # Token shift (crowdtrain.model.token_shift): every block's input takes half its channels
    # from the previous text token, or a quarter each from the image cell above and the cell
    # to the left. Needs width divisible by 4. The paper's code uses it; it costs a few copies
    # per block and changes no parameter.
    token_shift: bool = False
    # LayerScale: each layer (never shared, even when its modules are) multiplies its attention
    # and feed-forward outputs by a learned per-channel vector before the residual add,
    # initialised small and smaller with depth (layer_scale_init), so deep stacks start close
    # to the identity and train stably.
    layer_scale: bool = False
    # Factorised image codes (crowdtrain.data.palette_tokenizer): code = mask * n_colours + colour,
    # given as (n_masks, n_colours) with n_masks * n_colours = image_vocab_size. The tied
    # embedding of a code is then a mask embedding plus a colour embedding, so a code's logit is a
    # mask score plus a colour score and a colour-shape pair never seen in training gets both
    # trained halves. Mask 0 is the blank patch, which has no colour: codes 0..n_colours-1 are
    # one outcome (the model scores it as p(mask 0), code 0 stands for it), so the colour score
    # is trained on foreground patches only and is the colour *given* foreground. Otherwise the
    # blank's arbitrary colour leaks into shape edges: where "blank or edge" is uncertain the
    # independent colour draw picks the blank's colour and draws stray shapes in it.
    # None: every code has its own embedding (learned VQ codes).
    image_code_factors: tuple[int, int] | None = None

    def __post_init__(self):
        # Lists from JSON or the CLI become tuples, so configs stay hashable and comparable.
        object.__setattr__(self, "patterns", tuple(self.patterns))
        object.__setattr__(self, "share_ids", tuple(int(i) for i in self.share_ids))
        if self.image_code_factors is not None:
            factors = tuple(int(f) for f in self.image_code_factors)
            object.__setattr__(self, "image_code_factors", factors)
            if len(factors) != 2 or min(factors) <= 0 or factors[0] * factors[1] != self.image_vocab_size:
                raise ValueError(f"model.image_code_factors={list(factors)} must be [n_masks, n_colours] with "
                                 f"n_masks * n_colours = model.image_vocab_size ({self.image_vocab_size}): the image "
                                 "tokenizer's `factors` (set both from it, or image_code_factors=None)")
        for name in ("width", "depth", "heads", "head_dim", "ff_mult", "text_len", "text_vocab_size",
                     "image_height", "image_width", "image_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if len(self.patterns) != self.depth:
            raise ValueError(
                f"model.patterns has {len(self.patterns)} entries but model.depth is {self.depth}: "
                "give one attention pattern per layer")
        if len(self.share_ids) != self.depth:
            raise ValueError(
                f"model.share_ids has {len(self.share_ids)} entries but model.depth is {self.depth}: "
                "give one sharing id per layer (use 0..depth-1 for no sharing)")
        unknown = sorted(set(self.patterns) - set(PATTERNS))
        if unknown:
            raise ValueError(f"unknown attention pattern(s) {unknown}; choose from {list(PATTERNS)}")
        pattern_of_id: dict[int, str] = {}
        for layer, (pattern, share_id) in enumerate(zip(self.patterns, self.share_ids)):
            if pattern_of_id.setdefault(share_id, pattern) != pattern:
                raise ValueError(
                    f"sharing id {share_id} is given pattern {pattern_of_id[share_id]!r} and, at layer "
                    f"{layer}, {pattern!r}: layers that share weights must share a pattern; give layer "
                    f"{layer} its own sharing id or the same pattern")
        if not 0 <= self.text_pad_id < self.text_vocab_size:
            raise ValueError(f"model.text_pad_id={self.text_pad_id} is outside the text vocabulary "
                             f"[0, {self.text_vocab_size})")
        if self.conv_kernel < 1 or self.conv_kernel % 2 == 0:
            raise ValueError(f"model.conv_kernel must be a positive odd number, got {self.conv_kernel}")
        if self.rotary and self.head_dim % 4 != 0:
            raise ValueError(f"rotary embeddings split head_dim into 4 parts (2-D axial, pairs); "
                             f"model.head_dim={self.head_dim} is not a multiple of 4")
        if self.reversible and self.dropout > 0:
            raise ValueError("reversible layers recompute activations in backward, so dropout must be 0 "
                             "(set model.dropout=0 or model.reversible=False)")
        if self.image_loss_weight < 0:
            raise ValueError("model.image_loss_weight must be >= 0")
        if self.token_shift and self.width % 4 != 0:
            raise ValueError(f"token shift moves a quarter of the channels from the cell above and one from the "
                             f"cell to the left; model.width={self.width} is not a multiple of 4 (change "
                             "model.width or set model.token_shift=False)")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def image_len(self) -> int:
        return self.image_height * self.image_width

    @property
    def seq_len(self) -> int:
        return self.text_len + self.image_len

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def vocab_size(self) -> int:
        """Rows of the tied embedding: text tokens, image codes, one image-start token."""
        return self.text_vocab_size + self.image_vocab_size + 1

    @property
    def image_bos_id(self) -> int:
        return self.text_vocab_size + self.image_vocab_size

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["patterns"] = list(self.patterns)
        d["share_ids"] = list(self.share_ids)
        if self.image_code_factors is not None:
            d["image_code_factors"] = list(self.image_code_factors)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    def fingerprint(self) -> str:
        """Stable hash of everything that changes the parameters' meaning or shapes.

        Peers compare fingerprints to refuse training a different model. Options that only
        change how activations are stored (reversible is an architecture change and counts;
        checkpointing does not) are left out.
        """
        d = self.to_dict()
        d.pop("checkpointing")
        if d["image_code_factors"] is None:  # as before the option existed
            d.pop("image_code_factors")
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def layer_scale_init(layer: int) -> float:
    """Initial LayerScale value of 1-based ``layer``, as the paper's code (from CaiT): 0.1 up to
    layer 18, 1e-5 up to 24, 1e-6 beyond. Deeper layers start nearer zero so that the sum of
    many residual branches stays small at initialisation."""
    if layer <= 18:
        return 0.1
    if layer <= 24:
        return 1e-5
    return 1e-6


# ---- sampling defaults ---------------------------------------------------------------------
# The paper found "top-k 256 or top-p 0.75" better than plain sampling: one filter, not both.
# Nucleus sampling is the default because it does not depend on the image vocabulary's size: top-k
# 256 keeps 3% of the paper's 8192 VQGAN codes but half of the shapes tokenizer's 512, where it
# hardly filters (on one 5-minute demo checkpoint, 4 seeds x 16 samples per prompt: seen adherence
# 0.51 with top-k 256, 0.63 with top-p 0.75, 0.64 with 0.6, 0.59 with 0.9; a second checkpoint
# 0.47 against 0.60). Lower top-p trades diversity for adherence, by an amount that depends on the
# model: with the learned VQ codes, at 0.4 the held-out prompts' samples all repeated the colours
# seen in training; with the palette codes (a 30-minute demo checkpoint, 4 seeds), 0.75 scores
# 0.80 seen / 0.63 held-out and 0.4 scores 1.00 / 0.88 (benchmarks/results/bench_sampling_palette_*).
# Every sampler (generate_images, crowdtrain
# generate / eval, the aux peer's gallery, the demo) reads these; for the paper's other choice
# pass top_k=256 and top_p=None (--top-k 256).
DEFAULT_TOP_K: int | None = None
DEFAULT_TOP_P: float | None = 0.75


def sampling_filters(top_k: int | None = None, top_p: float | None = None) -> tuple[int | None, float | None]:
    """The filters a sampler applies, from optional user choices (the CLI's --top-k / --top-p).

    Neither given: the defaults (``DEFAULT_TOP_K``, ``DEFAULT_TOP_P``). Otherwise exactly what
    was given, so ``--top-k 256`` alone is top-k sampling without the default nucleus. Both
    given: top-k first, then the nucleus of what is left (renormalised). ``top_k`` 0 means no
    top-k.
    """
    if top_k is not None and top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0: no top-k filter), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1: no nucleus filter), got {top_p}")
    if top_k is None and top_p is None:
        return DEFAULT_TOP_K, DEFAULT_TOP_P
    return (top_k or None), top_p


def _cycle(seq: tuple, n: int) -> tuple:
    return tuple(seq[i % len(seq)] for i in range(n))


def _paper() -> ModelConfig:
    depth = 64
    return ModelConfig(
        width=1024, depth=depth, heads=16, head_dim=64, text_len=256, text_vocab_size=32100,
        image_height=32, image_width=32, image_vocab_size=8192,
        patterns=_cycle(("axial_row", "axial_col", "axial_row", "axial_row"), depth - 1) + ("conv_like",),
        share_ids=_cycle((0, 1, 2, 3), depth - 1) + (4,),
        reversible=True, rotary=True, token_shift=True, layer_scale=True,
    )


def _demo() -> ModelConfig:
    depth = 8
    return ModelConfig(
        width=128, depth=depth, heads=4, head_dim=32, text_len=32, text_vocab_size=1024,
        # The shapes data's palette-and-mask codes (crowdtrain.data.palette_tokenizer): 256 masks x 5 colours.
        image_height=8, image_width=8, image_vocab_size=1280, image_code_factors=(256, 5),
        patterns=_cycle(("axial_row", "axial_col", "axial_row", "axial_row"), depth - 1) + ("conv_like",),
        share_ids=_cycle((0, 1, 2, 3), depth - 1) + (4,),
        reversible=False,
        # Token shift: 8% lower held-out loss after 10k samples for 4-8% more time per step
        # (bench_quality's f-token-shift against f-adamw-b32). LayerScale stays off: it is for
        # the stability of deep stacks, and this one has 8 layers.
        token_shift=True,
    )


def _tiny() -> ModelConfig:
    return ModelConfig()  # the dataclass defaults are the tiny preset


PRESETS = {"tiny": _tiny, "demo": _demo, "paper": _paper}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A named preset, optionally with fields replaced (``get_preset("demo", reversible=True)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    config = PRESETS[name]()
    return dataclasses.replace(config, **overrides) if overrides else config
