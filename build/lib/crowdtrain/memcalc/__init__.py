"""Memory calculator: peak GPU memory and CPU RAM of training under memory-saving options.

Pure Python and importable without torch (the coordinator's web process uses it); only
``calibrate`` and ``validate`` import torch, to count and measure the real implementations.
"""

from crowdtrain.memcalc.architectures import Architecture, get_architecture, names
from crowdtrain.memcalc.estimate import GPU_SIZES_GB, Estimate, Options, Parts, estimate, format_estimate

__all__ = ["Architecture", "get_architecture", "names", "GPU_SIZES_GB", "Estimate", "Options", "Parts",
           "estimate", "format_estimate"]
