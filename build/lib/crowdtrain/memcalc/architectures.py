"""The models the calculator knows: parameter shapes and activation coefficients, as data.

Pure Python (no torch), so the coordinator's web process can import it.

- Parameters: every family lists its tensors' shapes (``base`` outside the layers, one
  shareable layer per stack, and per-layer tensors that are never shared). From the shapes we
  get the count, the largest tensor, the elements a factorized optimizer keeps (rows + columns
  of a matrix, all of a vector) and the elements too small for 8-bit states. Tests rebuild
  every Hugging Face model on the meta device and compare counts.
- Activations: bytes autograd saves per token, a linear function of the dimensions whose
  coefficients were counted on the real implementation by
  :mod:`crowdtrain.memcalc.calibrate` (the tests re-count them). Features: ``h`` width,
  ``a`` attention inner size (heads x head dim), ``f`` feed-forward size, ``hs`` heads x
  sequence (eager attention keeps score rows), ``s`` sequence, ``heads``, ``V`` vocabulary
  (head only), ``1``. Keys ``4`` and ``2``: 32-bit and 16-bit activations.
- Our presets: counted from ``DalleTransformer`` itself (``presets.json``, written and checked
  by ``calibrate``), per attention pattern and per sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PRESETS_JSON = Path(__file__).with_name("presets.json")
MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit states for tensors smaller than this
Shape = tuple[int, ...]

# Saved bytes per token (calibrate.fit_family on transformers 5.x, sdpa attention where the
# model supports it, dropout 0). Comments name the tensors behind the big coefficients.
ACTIVATION_COEFFS: dict[str, dict] = {
    # GPT-2 block: LN in, qkv in, qkv out (3h), q copy, attn out, proj in, LN in, fc in = 10h;
    # gelu_new (tanh formula in Python) keeps fc out + 3 intermediates + its output = 5f;
    # 4 LayerNorm statistics; one fp32 log-sum-exp per head (sdpa).
    "gpt2": {
        "layer": {"4": {"h": 40.0, "f": 20.0, "heads": 4.0, "1": 16.0},
                  "2": {"h": 20.0, "f": 10.0, "heads": 4.0, "1": 8.0}},
        "head": {"4": {"h": 8.0, "V": 4.0, "1": 28.0}, "2": {"h": 4.0, "V": 4.0, "1": 24.0}},
    },
    # BERT (post-LN, exact GELU kernel): 8h + 2f per layer; the MLM head keeps 10h.
    "bert": {
        "layer": {"4": {"h": 32.0, "f": 8.0, "heads": 4.0, "1": 16.0},
                  "2": {"h": 16.0, "f": 4.0, "heads": 4.0, "1": 8.0}},
        "head": {"4": {"h": 20.0, "V": 4.0, "1": 28.0}, "2": {"h": 10.0, "V": 2.0, "1": 20.0}},
    },
    # GPT-J: eager attention keeps the fp32 softmax (4 B per head and key) and, in 16-bit, its
    # cast (2 B more); q and k are upcast to fp32 in 16-bit runs.
    "gptj": {
        "layer": {"4": {"h": 24.0, "f": 20.0, "hs": 4.0, "1": 72.0},
                  "2": {"h": 16.0, "f": 10.0, "hs": 6.0, "1": 36.0}},
        "head": {"4": {"h": 8.0, "V": 4.0, "1": 24.0}, "2": {"h": 4.0, "V": 4.0, "1": 20.0}},
    },
    # T5: eager attention with the relative-position bias added in fp32.
    "t5": {
        "encoder": {"4": {"h": 24.0, "a": 16.0, "f": 4.0, "hs": 4.0, "1": 8.0},
                    "2": {"h": 20.0, "a": 14.0, "f": 2.0, "hs": 4.0, "1": 8.0}},
        "decoder": {"4": {"h": 36.0, "a": 32.0, "f": 4.0, "hs": 4.0, "s": 0.5, "heads": 4.0, "1": 12.0},
                    "2": {"h": 30.0, "a": 22.0, "f": 2.0, "hs": 4.0, "s": 0.5, "heads": 4.0, "1": 12.0}},
        "head": {"4": {"h": 24.0, "V": 4.0, "hs": 2.0, "s": 8.0, "1": 24.0},
                 "2": {"h": 20.0, "V": 2.0, "hs": 1.0, "s": 8.0, "1": 24.0}},
    },
}


@dataclass(frozen=True)
class ParamStats:
    """Aggregates of a list of parameter tensors."""

    numel: int = 0
    factored: int = 0  # elements of a factorized second moment: rows + cols per matrix, all of a vector
    small: int = 0  # elements in tensors below MIN_8BIT_SIZE (kept in 32-bit by 8-bit optimizers)
    largest: int = 0

    @classmethod
    def of(cls, shapes: list[Shape]) -> "ParamStats":
        numel = factored = small = largest = 0
        for shape in shapes:
            n = 1
            for d in shape:
                n *= d
            numel += n
            factored += shape[0] + shape[1] if len(shape) == 2 else n
            small += n if n < MIN_8BIT_SIZE else 0
            largest = max(largest, n)
        return cls(numel, factored, small, largest)

    def __add__(self, other: "ParamStats") -> "ParamStats":
        return ParamStats(self.numel + other.numel, self.factored + other.factored, self.small + other.small,
                          max(self.largest, other.largest))

    def times(self, k: int) -> "ParamStats":
        return ParamStats(self.numel * k, self.factored * k, self.small * k, self.largest if k else 0)

    @classmethod
    def from_dict(cls, d: dict) -> "ParamStats":
        return cls(d["numel"], d["factored"], d["small"], d["largest"])


@dataclass(frozen=True)
class Stack:
    """A run of identical layers (a decoder, or T5's encoder and decoder)."""

    name: str
    layers: int
    shareable: ParamStats  # one layer's tensors that parameter sharing may share
    own: ParamStats = ParamStats()  # one layer's tensors that are never shared (our norms)


@dataclass(frozen=True)
class Architecture:
    name: str
    title: str
    family: str  # gpt2, bert, gptj, t5 (Hugging Face implementations) or crowdtrain
    width: int
    heads: int
    d_head: int
    ff: int
    vocab_size: int
    seq_len: int  # default (and, for our presets, the only) sequence length
    base: ParamStats
    stacks: tuple[Stack, ...]
    head_tensor: int  # elements of the output projection: its gradient is the first one allocated
    logits_per_token: int  # logits per output position
    default_groups: int | None = None  # sharing groups built into the model (our presets)
    buffer_elems: int = 0  # fp32 buffers (rotary tables)
    fixed_seq_len: bool = False
    preset: dict = field(default_factory=dict, compare=False, repr=False)  # counts of our presets
    note: str = ""

    @property
    def layers(self) -> int:
        return sum(s.layers for s in self.stacks)

    def params(self, groups: int | None = None) -> ParamStats:
        """Unique parameters when each stack keeps ``groups`` distinct layers (None: no sharing)."""
        groups = groups or self.default_groups
        total = self.base
        for stack in self.stacks:
            unique = stack.layers if groups is None else min(groups, stack.layers)
            total = total + stack.shareable.times(unique) + stack.own.times(stack.layers)
        return total


# ---- Hugging Face families: tensor shapes ----------------------------------------------------
def _ln(h: int, bias: bool = True) -> list[Shape]:
    return [(h,), (h,)] if bias else [(h,)]


def _linear(n_in: int, n_out: int, bias: bool = True) -> list[Shape]:
    return [(n_out, n_in)] + ([(n_out,)] if bias else [])


def _gpt2_layer(h: int, f: int) -> list[Shape]:
    return _ln(h) + _linear(h, 3 * h) + _linear(h, h) + _ln(h) + _linear(h, f) + _linear(f, h)


def gpt2_like(name: str, title: str, *, layers: int, h: int, heads: int, vocab: int = 50257,
              positions: int = 1024, ff: int | None = None, note: str = "") -> Architecture:
    f = ff or 4 * h
    return Architecture(
        name=name, title=title, family="gpt2", width=h, heads=heads, d_head=h // heads, ff=f,
        vocab_size=vocab, seq_len=positions,
        base=ParamStats.of([(vocab, h), (positions, h)] + _ln(h)),  # lm_head is tied to wte
        stacks=(Stack("layer", layers, ParamStats.of(_gpt2_layer(h, f))),),
        head_tensor=vocab * h, logits_per_token=vocab, note=note)


def bert(name: str, title: str, *, layers: int, h: int, heads: int, vocab: int = 30522, positions: int = 512,
         seq_len: int = 512) -> Architecture:
    f = 4 * h
    layer = (_linear(h, h) * 3 + _linear(h, h) + _ln(h) + _linear(h, f) + _linear(f, h) + _ln(h))
    base = [(vocab, h), (positions, h), (2, h)] + _ln(h) + _linear(h, h) + _ln(h) + [(vocab,)]  # MLM head, tied decoder
    return Architecture(
        name=name, title=title, family="bert", width=h, heads=heads, d_head=h // heads, ff=f, vocab_size=vocab,
        seq_len=seq_len, base=ParamStats.of(base), stacks=(Stack("layer", layers, ParamStats.of(layer)),),
        head_tensor=vocab * h, logits_per_token=vocab, note="BertForMaskedLM (no pooler), loss on every position")


def t5(name: str, title: str, *, layers: int, h: int, heads: int, d_head: int, ff: int, vocab: int = 32128,
       seq_len: int = 512) -> Architecture:
    a = heads * d_head
    attn = _linear(h, a, False) * 3 + _linear(a, h, False)
    ffn = _linear(h, ff, False) + _linear(ff, h, False)
    encoder = attn + _ln(h, False) + ffn + _ln(h, False)
    decoder = attn + _ln(h, False) + attn + _ln(h, False) + ffn + _ln(h, False)
    base = [(vocab, h)] + _ln(h, False) * 2 + [(32, heads)] * 2  # tied lm_head, final norms, relative bias
    return Architecture(
        name=name, title=title, family="t5", width=h, heads=heads, d_head=d_head, ff=ff, vocab_size=vocab,
        seq_len=seq_len, base=ParamStats.of(base),
        stacks=(Stack("encoder", layers, ParamStats.of(encoder)), Stack("decoder", layers, ParamStats.of(decoder))),
        head_tensor=vocab * h, logits_per_token=vocab,
        note="T5ForConditionalGeneration; input and target both seq_len tokens")


def gptj(name: str, title: str, *, layers: int = 28, h: int = 4096, heads: int = 16, ff: int = 16384,
         vocab: int = 50400, positions: int = 2048) -> Architecture:
    layer = _ln(h) + _linear(h, h, False) * 4 + _linear(h, ff) + _linear(ff, h)
    base = [(vocab, h)] + _ln(h) + _linear(h, vocab)  # untied lm_head with bias
    return Architecture(
        name=name, title=title, family="gptj", width=h, heads=heads, d_head=h // heads, ff=ff, vocab_size=vocab,
        seq_len=positions, base=ParamStats.of(base), stacks=(Stack("layer", layers, ParamStats.of(layer)),),
        head_tensor=vocab * h, logits_per_token=vocab)


def dalle_12b() -> Architecture:
    """OpenAI's DALL-E (Ramesh et al. 2021): 64 GPT-style layers of width 3968, 62 heads of 64,
    256 text tokens (16384-word BPE plus 256 per-position padding tokens) then a 32x32 grid of
    8192 image codes. Reconstructed from the paper; activations use our GPT-2 coefficients."""
    h, text_vocab, image_vocab, text_len, grid = 3968, 16384, 8192, 256, 32
    base = ([(text_vocab + text_len, h), (image_vocab, h), (text_len, h), (grid, h), (grid, h)] + _ln(h)
            + [(text_vocab + image_vocab, h)])  # untied output over both vocabularies
    return Architecture(
        name="dall-e-12b", title="DALL-E 12B (OpenAI)", family="gpt2", width=h, heads=62, d_head=64, ff=4 * h,
        vocab_size=text_vocab + image_vocab, seq_len=text_len + grid * grid, base=ParamStats.of(base),
        stacks=(Stack("layer", 64, ParamStats.of(_gpt2_layer(h, 4 * h))),),
        head_tensor=(text_vocab + image_vocab) * h, logits_per_token=text_vocab + image_vocab,
        note="reconstructed from the paper (sparse attention priced like dense flash attention)")


def _gpt3(name: str, layers: int, h: int, heads: int) -> Architecture:
    return gpt2_like(name, f"GPT-3 {name.split('-')[1].upper()}", layers=layers, h=h, heads=heads,
                     positions=2048, note="GPT-3 shapes (Brown et al. 2020, table 2.1) in GPT-2's layer")


# GPT-3 table 2.1; 13B's width 5140 is as printed in the paper.
_EXTERNAL = [
    bert("bert-base", "BERT base", layers=12, h=768, heads=12),
    bert("bert-large", "BERT large", layers=24, h=1024, heads=16),
    t5("t5-3b", "T5 3B", layers=24, h=1024, heads=32, d_head=128, ff=16384),
    t5("t5-11b", "T5 11B", layers=24, h=1024, heads=128, d_head=128, ff=65536),
    gpt2_like("gpt2", "GPT-2 small", layers=12, h=768, heads=12),
    gpt2_like("gpt2-medium", "GPT-2 medium", layers=24, h=1024, heads=16),
    gpt2_like("gpt2-large", "GPT-2 large", layers=36, h=1280, heads=20),
    gpt2_like("gpt2-xl", "GPT-2 XL", layers=48, h=1600, heads=25),
    _gpt3("gpt3-125m", 12, 768, 12), _gpt3("gpt3-350m", 24, 1024, 16), _gpt3("gpt3-760m", 24, 1536, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16), _gpt3("gpt3-2.7b", 32, 2560, 32), _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5140, 40), _gpt3("gpt3-175b", 96, 12288, 96),
    gptj("gpt-j-6b", "GPT-J 6B"),
    dalle_12b(),
]
EXTERNAL = {a.name: a for a in _EXTERNAL}
OUR_PRESETS = ("tiny", "demo", "paper")


def ours(name: str, counts: dict) -> Architecture:
    """Architecture of one of our presets from its counted ``presets.json`` entry."""
    layer_own = counts["layer_own_params"]
    return Architecture(
        name=f"crowdtrain-{name}", title=f"crowdtrain {name} preset", family="crowdtrain", width=counts["width"],
        heads=counts["heads"], d_head=0, ff=0, vocab_size=counts["vocab_size"], seq_len=counts["seq_len"],
        base=ParamStats.from_dict(counts["base"]),
        stacks=(Stack("layer", counts["depth"], ParamStats.from_dict(counts["group"]),
                      ParamStats.from_dict(counts["own"]) if layer_own else ParamStats()),),
        head_tensor=counts["vocab_size"] * counts["width"],
        logits_per_token=0, default_groups=counts["groups"],
        buffer_elems=counts["buffer_bytes_fp32"] // 4, fixed_seq_len=True, preset=counts,
        note="counted from DalleTransformer (presets.json)")


def crowdtrain_param_count(config) -> int:
    """Parameters ``DalleTransformer`` builds for a ``ModelConfig`` (any object with its fields),
    from its layer shapes and without torch: a volunteer sizes a run's model before building it.
    Tests check it against the model's own count. Shared layers (``share_ids``) count once."""
    w, inner, hidden = config.width, config.heads * config.head_dim, config.ff_mult * config.width
    factors = getattr(config, "image_code_factors", None)  # factorised codes: a mask and a colour table
    image_rows = sum(factors) if factors else config.image_vocab_size
    base = (config.text_vocab_size + image_rows + 1) * w + 2 * w  # tied embedding, final norm
    if not config.rotary:
        base += (config.text_len + config.image_height * config.image_width) * w  # learned positions
    attention = w * 3 * inner + inner * w + w  # to_qkv (no bias), to_out
    feed_forward = w * 2 * hidden + 2 * hidden + hidden * w + w  # GEGLU w_in, w_out
    own = 4 * w + (2 * w if config.layer_scale else 0)  # two pre-norms (+ LayerScale vectors)
    return base + len(set(config.share_ids)) * (attention + feed_forward) + len(config.share_ids) * own


@lru_cache(maxsize=1)
def _preset_counts() -> dict:
    if not PRESETS_JSON.exists():
        raise FileNotFoundError(f"{PRESETS_JSON} is missing; run `python -m crowdtrain.memcalc.calibrate presets`")
    return json.loads(PRESETS_JSON.read_text())


def names() -> list[str]:
    return list(EXTERNAL) + [f"crowdtrain-{p}" for p in OUR_PRESETS]


def get_architecture(name: str) -> Architecture:
    """Look a model up by name (``gpt2-large``, ``crowdtrain-paper``; ``paper`` works too)."""
    if name in EXTERNAL:
        return EXTERNAL[name]
    preset = name.removeprefix("crowdtrain-")
    if preset in OUR_PRESETS:
        return ours(preset, _preset_counts()[preset])
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(names())}")
