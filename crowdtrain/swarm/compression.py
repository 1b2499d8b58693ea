"""What goes on the wire: the paper's size-adaptive compression, safe for every tensor dtype.

Float tensors of ``threshold`` (2^16) elements or more are sent as 8-bit uniform quantization,
smaller float tensors as fp16; integer tensors (the 8-bit optimizer's codes and step counters)
are sent as they are, since quantizing them would corrupt them. Optimizer statistics (in a state
download) are sent exactly too: the 8-bit LAMB's per-block scales of its second moment are around
1e-8, below fp16's range, and a newcomer that got them as fp16 read its second moment as zero and
took steps of ``m / eps`` in a few weights (seen: weights of 0.1 jumping to 1.7 in one step). They
are small beside the model (one float per 256 one-byte codes), so exactness costs little.
hivemind serializes tensors into protobuf messages: data, never pickled code.
"""

from __future__ import annotations

from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  TensorRole, Uniform8BitQuantization)
from hivemind.compression.adaptive import AdaptiveCompressionBase


class PaperCompression(AdaptiveCompressionBase):
    def __init__(self, threshold: int = 2**16):
        self.threshold = threshold
        self.small, self.large, self.exact = Float16Compression(), Uniform8BitQuantization(), NoCompression()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        if not info.descriptor.dtype.is_floating_point or info.role == TensorRole.OPTIMIZER:
            return self.exact
        return self.large if info.descriptor.numel() >= self.threshold else self.small


def wire_bytes(numels: list[int], threshold: int = 2**16) -> int:
    """Bytes one copy of float tensors of these sizes takes on the wire (payload only).

    8-bit quantization sends one byte per element plus a 256-entry fp32 codebook per tensor.
    """
    total = 0
    for n in numels:
        total += n + 256 * 4 if n >= threshold else 2 * n
    return total
