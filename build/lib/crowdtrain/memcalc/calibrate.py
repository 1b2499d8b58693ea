"""Count the activation bytes a real implementation saves for backward (needs torch).

The calculator in :mod:`crowdtrain.memcalc.estimate` is pure arithmetic; its activation
coefficients come from here. Autograd keeps exactly the tensors that ops save for backward, so
we run one training forward under ``torch.autograd.graph.saved_tensors_hooks`` and add up the
distinct storages that are not parameters. That number is linear in the batch, and per token it
is a linear function of the model's dimensions, so a handful of tiny models pins down the exact
coefficients:

- Hugging Face models (``fit_family``): bytes per token per layer and for the non-repeated
  part (embeddings, final norm, logits, loss), as a linear function of width ``h``, attention
  inner size ``a``, feed-forward size ``f``, ``heads * seq`` (eager attention keeps a row of
  the score matrix per token and head), ``heads``, the vocabulary ``V`` (head only) and 1,
  once for 32-bit and once for 16-bit activations. The fit must be exact (residual < 1 byte)
  or it raises: a non-linear term means the formula needs a new feature.
- Our own presets (``count_preset``): counted directly on the preset's geometry, one layer per
  attention pattern, so they follow the code with nothing to fit. Any other ``ModelConfig`` (a
  run's tuned preset) is counted the same way on the meta device (``model_architecture``).

``python -m crowdtrain.memcalc.calibrate`` prints the fitted tables and rewrites
``crowdtrain/memcalc/presets.json`` (our presets' counts); the tests re-run both and compare
with what is checked in, so the calculator cannot drift from the code it describes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PRESETS_JSON = Path(__file__).with_name("presets.json")
DTYPES = {4: torch.float32, 2: torch.bfloat16}


def saved_activation_bytes(model: torch.nn.Module, forward) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``forward()``."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    buffers = {b.untyped_storage()._cdata for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in buffers:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


# ---- Hugging Face families -------------------------------------------------------------------
def build_hf(family: str, *, layers: int, h: int, heads: int, d_head: int, f: int, s: int, V: int,
             decoder_layers: int | None = None):
    """A randomly initialised, dropout-free Hugging Face model of ``family`` (CPU, fp32)."""
    import transformers as tf

    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=layers, n_embd=h, n_head=heads, n_inner=f, n_positions=s, vocab_size=V,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if family == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(
            num_hidden_layers=layers, hidden_size=h, num_attention_heads=heads, intermediate_size=f,
            vocab_size=V, max_position_embeddings=s, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if family == "gptj":
        return tf.GPTJForCausalLM(tf.GPTJConfig(
            n_layer=layers, n_embd=h, n_head=heads, n_inner=f, n_positions=s, vocab_size=V, rotary_dim=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if family == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            num_layers=layers, num_decoder_layers=layers if decoder_layers is None else decoder_layers,
            d_model=h, d_kv=d_head, num_heads=heads, d_ff=f, vocab_size=V, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    raise ValueError(f"unknown family {family!r}; choose gpt2, bert, gptj or t5")


# Features of the per-token linear model; families whose attention inner size is the width
# leave out "a" (it would be collinear with "h").
LAYER_FEATURES = {"gpt2": ("h", "f", "hs", "heads", "1"), "bert": ("h", "f", "hs", "heads", "1"),
                  "gptj": ("h", "f", "hs", "heads", "1"), "t5": ("h", "a", "f", "hs", "s", "heads", "1")}
HEAD_FEATURES = ("h", "a", "f", "V", "hs", "s", "heads", "1")
STACKS = {"gpt2": ("layer",), "bert": ("layer",), "gptj": ("layer",), "t5": ("encoder", "decoder")}
_BATCH = 2


def _feature_value(name: str, dims: dict) -> float:
    return {"h": dims["h"], "a": dims["heads"] * dims["d_head"], "f": dims["f"], "V": dims["V"],
            "hs": dims["heads"] * dims["s"], "s": dims["s"], "heads": dims["heads"], "1": 1}[name]


def _count_hf(family: str, dims: dict, dtype: torch.dtype, **layers) -> float:
    model = build_hf(family, **dims, **layers).to(dtype).train()
    ids = torch.randint(2, dims["V"], (_BATCH, dims["s"]))
    return saved_activation_bytes(model, lambda: model(input_ids=ids, labels=ids)) / (_BATCH * dims["s"])


def _design(family: str) -> list[dict]:
    base = dict(h=32, heads=2, d_head=16, f=64, s=16, V=96)
    variants = [{}, dict(h=64, heads=4), dict(f=160), dict(s=40), dict(V=200), dict(h=48, heads=3, s=24),
                dict(h=64, heads=2, d_head=32, f=96), dict(s=32, V=150)]
    if family == "t5":  # a = heads * d_head varies on its own
        variants += [dict(d_head=24), dict(heads=3, d_head=8, s=24)]
    out = []
    for v in variants:
        dims = {**base, **v}
        if family != "t5":
            dims["d_head"] = dims["h"] // dims["heads"]
        out.append(dims)
    return out


def _solve(rows: list[list[float]], ys: list[float], names: tuple[str, ...], what: str) -> dict[str, float]:
    import numpy as np

    a, y = np.array(rows, dtype=float), np.array(ys)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    residual = float(np.abs(a @ coef - y).max())
    if residual > max(2.0, 1e-3 * float(np.abs(y).max())):
        raise RuntimeError(f"{what}: saved bytes are not linear in {names} (residual {residual:.1f} B/token); "
                           "the implementation changed: add the missing feature")
    return {n: round(float(c), 3) for n, c in zip(names, coef) if abs(c) > 1e-6}


def fit_family(family: str) -> dict:
    """Exact per-token coefficients {stack: {bytes: {feature: coef}}, "head": ...} for 4- and 2-byte activations."""
    result: dict = {}
    for nbytes, dtype in DTYPES.items():
        per_stack_rows: dict[str, tuple[list, list]] = {s: ([], []) for s in STACKS[family]}
        head_rows, head_ys = [], []
        for dims in _design(family):
            torch.manual_seed(0)
            if family == "t5":
                one = _count_hf(family, dims, dtype, layers=1, decoder_layers=1)
                enc = _count_hf(family, dims, dtype, layers=2, decoder_layers=1) - one
                dec = _count_hf(family, dims, dtype, layers=1, decoder_layers=2) - one
                per_layer = {"encoder": enc, "decoder": dec}
                head = one - enc - dec
            else:
                one = _count_hf(family, dims, dtype, layers=1)
                per_layer = {"layer": _count_hf(family, dims, dtype, layers=2) - one}
                head = one - per_layer["layer"]
            for stack, value in per_layer.items():
                per_stack_rows[stack][0].append([_feature_value(n, dims) for n in LAYER_FEATURES[family]])
                per_stack_rows[stack][1].append(value)
            head_rows.append([_feature_value(n, dims) for n in HEAD_FEATURES])
            head_ys.append(head)
        for stack, (rows, ys) in per_stack_rows.items():
            result.setdefault(stack, {})[nbytes] = _solve(rows, ys, LAYER_FEATURES[family], f"{family}/{stack}")
        result.setdefault("head", {})[nbytes] = _solve(head_rows, head_ys, HEAD_FEATURES, f"{family}/head")
    return result


# ---- our presets -------------------------------------------------------------------------------
def count_params_meta(config) -> dict:
    """Parameter statistics of ``DalleTransformer(config)`` built on the meta device (no memory)."""
    from crowdtrain.memcalc.architectures import ParamStats
    from crowdtrain.model.transformer import DalleTransformer

    with torch.device("meta"):
        model = DalleTransformer(config)
    shapes = lambda module: [tuple(p.shape) for p in module.parameters()]
    group = ParamStats.of(shapes(model.attn[0]) + shapes(model.ff[0]))
    assert all(ParamStats.of(shapes(a) + shapes(f)) == group for a, f in zip(model.attn, model.ff))
    own = ParamStats.of(shapes(model.layers[0]))
    in_layers = {id(p) for m in (model.attn, model.ff, model.layers) for p in m.parameters()}
    base = ParamStats.of([tuple(p.shape) for p in model.parameters() if id(p) not in in_layers])
    return {"unique_params": sum(p.numel() for p in model.parameters()), "base": dataclasses.asdict(base),
            "group": dataclasses.asdict(group), "own": dataclasses.asdict(own), "layer_own_params": own.numel,
            "groups": len(model.groups), "buffer_bytes_fp32": sum(b.numel() * 4 for b in model.buffers()),
            "logits_per_sample": (config.text_len - 1) * config.text_vocab_size
                                 + config.image_len * config.image_vocab_size}


def count_model(config, *, device: str = "cpu") -> dict:
    """Counts of ``DalleTransformer(config)`` in the form of a ``presets.json`` entry: parameters
    and saved activation bytes per sample, per attention pattern and for the non-repeated part.

    ``device="meta"`` counts without memory or arithmetic (about a second for the paper preset),
    for a run's model that is no preset. Attention then takes torch's math path, which saves the
    score matrix that the fused kernels of a real CPU or GPU do not: small models' layers come
    out above the real count (the tiny preset's by 9%), the paper preset's as counted. An upper
    bound is what a batch size that must fit needs."""
    from crowdtrain.model.transformer import DalleTransformer

    out = {"width": config.width, "depth": config.depth, "heads": config.heads,
           "seq_len": config.seq_len, "vocab_size": config.vocab_size, "text_len": config.text_len,
           "text_vocab_size": config.text_vocab_size, "image_len": config.image_len,
           "image_vocab_size": config.image_vocab_size, "share_ids": list(config.share_ids),
           "patterns": list(config.patterns), "reversible_default": config.reversible,
           **count_params_meta(config), "layer_bytes": {}, "head_bytes": {}}

    def saved(cfg, dtype) -> int:
        """Bytes saved per sample: a batch of two less a batch of one, so what a forward saves once
        per batch (a factorised embedding's table, used by the logits) is not counted per sample."""
        torch.manual_seed(0)
        with torch.device(device):
            model = DalleTransformer(cfg).to(dtype).train()
            text = torch.randint(1, cfg.text_vocab_size, (2, cfg.text_len))
            image = torch.randint(0, cfg.image_vocab_size, (2, cfg.image_len))
        one = saved_activation_bytes(model, lambda: model(text[:1], image[:1]).loss)
        return saved_activation_bytes(model, lambda: model(text, image).loss) - one

    for nbytes, dtype in DTYPES.items():
        heads_seen = []
        for pattern in dict.fromkeys(config.patterns):
            one = dataclasses.replace(config, depth=1, patterns=(pattern,), share_ids=(0,), reversible=False,
                                      checkpointing=False)
            two = dataclasses.replace(one, depth=2, patterns=(pattern,) * 2, share_ids=(0, 1))
            s1, s2 = saved(one, dtype), saved(two, dtype)
            out["layer_bytes"].setdefault(pattern, {})[str(nbytes)] = s2 - s1
            heads_seen.append(2 * s1 - s2)
        # The non-repeated part (embedding, final norm, logits, loss): the same for every pattern
        # up to the pattern's cached mask; keep the largest.
        out["head_bytes"][str(nbytes)] = max(heads_seen)
    return out


def count_preset(name: str) -> dict:
    """Exact counts for one of our presets: parameters and saved activation bytes per sample."""
    from crowdtrain.model.config import get_preset

    return {"preset": name, **count_model(get_preset(name))}


def model_architecture(config):
    """The calculator's :class:`~crowdtrain.memcalc.architectures.Architecture` of a run's
    ``ModelConfig``: its preset's checked-in counts when it is one (whatever its ``reversible``
    and ``checkpointing``, which the estimate's options apply), else counted on the meta device.
    Tuning a preset (another tokenizer's vocabulary, ``--model width=...``) makes it no preset."""
    from crowdtrain.memcalc.architectures import OUR_PRESETS, get_architecture, ours
    from crowdtrain.model.config import get_preset

    for name in OUR_PRESETS:
        preset = get_preset(name)
        if dataclasses.replace(config, reversible=preset.reversible, checkpointing=preset.checkpointing) == preset:
            return get_architecture(name)
    return ours("run", count_model(config, device="meta"))


def write_presets_json(names=("tiny", "demo", "paper"), path: Path = PRESETS_JSON) -> dict:
    data = {name: count_preset(name) for name in names}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


if __name__ == "__main__":
    import sys

    for fam in (sys.argv[1:] or ["gpt2", "bert", "gptj", "t5"]):
        if fam == "presets":
            print(json.dumps(write_presets_json(), indent=1))
            continue
        print(fam, json.dumps(fit_family(fam)))
