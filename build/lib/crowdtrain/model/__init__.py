"""The DALL-E-like transformer. Imports torch (and einops) only: it knows nothing of the swarm.

Exports load lazily, so ``crowdtrain.model.config`` (plain dataclasses) can be read by processes
that must not import torch, such as the coordinator's web service.
"""

import importlib

_EXPORTS = {
    "PATTERNS": "crowdtrain.model.config", "PRESETS": "crowdtrain.model.config",
    "ModelConfig": "crowdtrain.model.config", "get_preset": "crowdtrain.model.config",
    "DalleTransformer": "crowdtrain.model.transformer", "ModelOutput": "crowdtrain.model.transformer",
    "generate_images": "crowdtrain.model.sampling",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'crowdtrain.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
