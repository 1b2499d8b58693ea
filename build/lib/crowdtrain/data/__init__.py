"""Data: the shapes and emoji data sets, image and text tokenizers, shards, streaming, generation.

Imports are lazy (``crowdtrain.data.batch_stream`` loads torch and datasets on first use), so
the CLI stays fast and the coordinator can import the HTTP server without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ensure_demo_shards": "crowdtrain.data.demo",
    "ensure_emoji_shards": "crowdtrain.data.emoji",
    "batch_stream": "crowdtrain.data.streaming",
    "open_stream": "crowdtrain.data.streaming",
    "stable_seed": "crowdtrain.data.streaming",
    "default_text_tokenizer": "crowdtrain.data.tokenizers",
    "default_image_tokenizer": "crowdtrain.data.tokenizers",
    "load_text_tokenizer": "crowdtrain.data.tokenizers",
    "default_asset_paths": "crowdtrain.data.tokenizers",
    "load_image_tokenizer": "crowdtrain.data.image_tokenizer",
    "serve_directory": "crowdtrain.data.http_server",
    "prepare_shards": "crowdtrain.data.shards",
    "EVAL_PROMPTS": "crowdtrain.data.shapes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'crowdtrain.data' has no attribute {name!r}")
