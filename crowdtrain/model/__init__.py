"""The DALL-E-like transformer. Imports torch (and einops) only: it knows nothing of the swarm."""

from crowdtrain.model.config import PATTERNS, PRESETS, ModelConfig, get_preset
from crowdtrain.model.sampling import generate_images
from crowdtrain.model.transformer import DalleTransformer, ModelOutput

__all__ = ["PATTERNS", "PRESETS", "ModelConfig", "get_preset", "DalleTransformer", "ModelOutput", "generate_images"]
