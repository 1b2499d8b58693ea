"""What a model config costs: parameters (unique and unshared), FLOPs per token, weight memory.

Counts come from the real module built on the meta device (no memory is allocated), so they
cannot drift from the code. "Unshared" is what the model would have if every layer owned its
attention and feed-forward weights: the paper's "about 1.1B parameters, 8x fewer with sharing".
"""

from __future__ import annotations

import torch

from crowdtrain.model.attention import pattern_mask
from crowdtrain.model.config import ModelConfig
from crowdtrain.model.transformer import DalleTransformer


def build_meta_model(config: ModelConfig) -> DalleTransformer:
    with torch.device("meta"):
        return DalleTransformer(config)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def avg_keys_per_query(config: ModelConfig) -> dict[str, float]:
    """Mean number of keys each query attends to, per pattern used, with all text real."""
    keep = torch.ones(1, config.text_len, dtype=torch.bool)
    return {p: pattern_mask(p, config, keep).sum().item() / config.seq_len for p in dict.fromkeys(config.patterns)}


def model_info(config: ModelConfig) -> dict:
    model = build_meta_model(config)
    unique = _numel(model)
    per_layer = []
    for i in range(config.depth):
        norms, attn, ff = model.layer_modules(i)
        per_layer.append(_numel(norms) + _numel(attn) + _numel(ff))
    embedding = (model.embedding.weight.numel() + (model.pos_embedding.numel() if model.pos_embedding is not None else 0)
                 + (_numel(model.image_factors) if model.image_factors is not None else 0))
    unshared = embedding + sum(per_layer) + _numel(model.final_norm)

    # Forward FLOPs per token: 2 per multiply-add of every dense weight a token passes through
    # (embedding lookups are free), attention scores and weighted sums over the keys each
    # query sees, and the tied output projection onto the text or image vocabulary.
    d, inner, hidden = config.width, config.inner_dim, config.ff_mult * config.width
    dense = 2 * (3 * d * inner + inner * d + d * 2 * hidden + hidden * d)
    keys = avg_keys_per_query(config)
    attention = sum(4 * inner * keys[p] for p in config.patterns)
    t, n = config.text_len, config.image_len
    logits = 2 * d * ((t - 1) * config.text_vocab_size + n * config.image_vocab_size) / config.seq_len
    layers_fwd = config.depth * dense + attention
    forward = layers_fwd + logits
    recompute = layers_fwd if (config.reversible or config.checkpointing) else 0.0
    return {
        "unique_params": unique,
        "unshared_params": unshared,
        "sharing_ratio": unshared / unique,
        "embedding_params": embedding,
        "sharing_groups": len(model.groups),
        "layers": [{"layer": i, "pattern": p, "share_id": s} for i, (p, s) in enumerate(zip(config.patterns, config.share_ids))],
        "sequence": {"text_len": t, "image_grid": [config.image_height, config.image_width], "image_len": n,
                     "seq_len": config.seq_len, "text_vocab_size": config.text_vocab_size,
                     "image_vocab_size": config.image_vocab_size},
        "avg_keys_per_query": keys,
        "flops_per_token": {"forward": forward, "train": 3 * forward + recompute},
        "weights_memory_gb": {"fp32": unique * 4 / 2**30, "fp16": unique * 2 / 2**30},
        "reversible": config.reversible,
        "token_shift": config.token_shift,
        "layer_scale": config.layer_scale,
        "fingerprint": config.fingerprint(),
    }


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _describe_layers(names: list[str]) -> str:
    """Shortest repeating cycle at the start, then the rest: '(a, b) x15, c, d'."""
    for period in range(1, len(names) // 2 + 1):
        cycle = names[:period]
        repeats = 1
        while names[repeats * period:(repeats + 1) * period] == cycle:
            repeats += 1
        if repeats >= 2:
            rest = names[repeats * period:]
            return f"({', '.join(cycle)}) x{repeats}" + "".join(f", {n}" for n in rest)
    return ", ".join(names)


def format_info(info: dict) -> str:
    seq = info["sequence"]
    pattern_text = _describe_layers([f"{l['pattern']}/{l['share_id']}" for l in info["layers"]])
    lines = [
        f"parameters      {_human(info['unique_params'])} unique, {_human(info['unshared_params'])} if unshared "
        f"({info['sharing_ratio']:.1f}x, {info['sharing_groups']} sharing groups)",
        f"sequence        {seq['text_len']} text tokens (vocab {seq['text_vocab_size']}) + "
        f"{seq['image_grid'][0]}x{seq['image_grid'][1]} image tokens (vocab {seq['image_vocab_size']}) = {seq['seq_len']}",
        f"layers          {len(info['layers'])}{' reversible' if info['reversible'] else ''}"
        f"{', token shift' if info.get('token_shift') else ''}{', LayerScale' if info.get('layer_scale') else ''}: "
        f"{pattern_text}  (pattern/share id)",
        "keys per query  " + ", ".join(f"{p} {k:.0f}" for p, k in info["avg_keys_per_query"].items()),
        f"FLOPs per token {_human(info['flops_per_token']['forward'])} forward, {_human(info['flops_per_token']['train'])} train step",
        f"weights         {info['weights_memory_gb']['fp32']:.2f} GiB fp32, {info['weights_memory_gb']['fp16']:.2f} GiB fp16",
        f"fingerprint     {info['fingerprint']}",
    ]
    return "\n".join(lines)


def architecture_fingerprint(config: ModelConfig, model: torch.nn.Module | None = None) -> str:
    """Hash of the config and of every parameter name and shape this code builds for it.

    Two peers agree on it only if their code would train the same tensors: a volunteer running
    a crowdtrain that builds a different model for the same config is refused, not averaged.
    ``model``: the one this process built from ``config`` already (a peer's, the auxiliary
    peer's), read instead of building one on the meta device: initializing meta tensors runs
    torch's Python reference ops, which import TorchDynamo (about 1 s of CPU at every join).
    """
    import hashlib

    model = build_meta_model(config) if model is None else model
    shapes = sorted((name, tuple(t.shape)) for name, t in model.state_dict().items())
    return hashlib.sha256(f"{config.fingerprint()}|{shapes}".encode()).hexdigest()[:16]
