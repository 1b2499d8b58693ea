"""What goes on the wire: the paper's size-adaptive compression, safe for every tensor dtype.

Float tensors of ``threshold`` (2^16) elements or more are sent as 8-bit uniform quantization,
smaller float tensors as fp16; integer tensors (the 8-bit optimizer's codes and step counters)
are sent as they are, since quantizing them would corrupt them. Optimizer statistics (in a state
download) are sent exactly too: the 8-bit LAMB's per-block scales of its second moment are around
1e-8, below fp16's range, and a newcomer that got them as fp16 read its second moment as zero and
took steps of ``m / eps`` in a few weights (seen: weights of 0.1 jumping to 1.7 in one step). They
are small beside the model (one float per 256 one-byte codes), so exactness costs little.
hivemind serializes tensors into protobuf messages: data, never pickled code.

The 8-bit codec is crowdtrain's own (:class:`Uniform8Bit`): hivemind's UNIFORM_8BIT wire format
and algorithm, 20% faster to encode and 3x faster to decode, the decoder installed at import
into hivemind's table so that every averager uses it (`benchmarks/bench_allreduce.py`).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  TensorRole, Uniform8BitQuantization)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.proto import runtime_pb2

from crowdtrain.swarm.hivemind_seam.p2p import replace_decoder

logger = logging.getLogger(__name__)


class Uniform8Bit(Uniform8BitQuantization):
    """hivemind's UNIFORM_8BIT: codes = round((x - mean) / scale) + 128 clamped to a byte, with
    ``scale = 6 std / 256``, and a 256-entry codebook of each code's mean value.

    Encoding: the codes are rounded with plain tensor ops (hivemind uses
    ``torch.quantize_per_tensor``, deprecated in PyTorch 2.13: a warning in every averager and a
    removal to come), and each code's sum and count are two ``bincount`` passes on the one-byte
    codes instead of widening them to int64 for a ``scatter_add``. Decoding is a NumPy gather on
    the one-byte codes (hivemind widens them to int64 and indexes with torch: 1.2 ms per 512 KiB
    part against 0.4 ms here); the decoded values are bit-identical to hivemind's."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        values = tensor.detach().float().reshape(-1)
        shift = values.mean()
        centered = values - shift
        scale = self.RANGE_IN_SIGMAS * centered.norm() / math.sqrt(max(1, centered.numel() - 1)) / self.n_bins
        offset = self.n_bins // 2
        # A constant tensor gets one code. So does one with NaN or inf; its codebook entry is then
        # NaN or inf too, so it decodes as non-finite and reducers drop it.
        if torch.isfinite(scale) and scale > 0:
            codes = centered.mul_(1.0 / scale).round_().add_(offset).clamp_(0, self.n_bins - 1).to(torch.uint8)
        else:
            codes = torch.full_like(values, offset, dtype=torch.uint8)
        counts = torch.bincount(codes, minlength=self.n_bins).clamp_min_(1)
        codebook = (torch.bincount(codes, weights=values, minlength=self.n_bins) / counts).to(torch.float32)
        return codes.numpy(), codebook.numpy()

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        if serialized_tensor.dtype == "bfloat16":  # NumPy has no bfloat16
            return super().extract(serialized_tensor)
        buffer = serialized_tensor.buffer
        size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=size, dtype=self.codebook_dtype)
        codes = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        values = np.take(codebook.astype(serialized_tensor.dtype, copy=False), codes)  # IndexError if a code >= size
        return torch.from_numpy(values).reshape(tuple(serialized_tensor.size)).requires_grad_(
            serialized_tensor.requires_grad)


def install_fast_decoder() -> bool:
    """Make hivemind decode UNIFORM_8BIT messages with :class:`Uniform8Bit` (same values, faster).
    If a hivemind release changes its decoder table, its own decoder stays and this says so."""
    if not replace_decoder("UNIFORM_8BIT", Uniform8Bit(), replaces=(Uniform8BitQuantization, Uniform8Bit)):
        logger.warning("hivemind's decoder table changed: 8-bit messages are decoded by hivemind's slower codec")
        return False
    return True


install_fast_decoder()


class PaperCompression(AdaptiveCompressionBase):
    """Gradients (and DiLoCo's pseudo-gradients) of ``threshold`` elements or more: 8-bit, the
    paper's choice; smaller ones fp16. Parameters (state averaging, state downloads): always fp16.

    An 8-bit round trip moves each weight by about 1/100 of the tensor's spread. For a gradient
    that is noise on one update; for the parameters themselves it is noise of the size of one
    to three whole LAMB steps at lr 0.01 (measured on the demo model: rms error 2-3e-3 against
    steps of 1e-3), added to every weight at every state round (every ``average_state_every``
    epochs), and more at the paper's lr 2.5e-3. fp16 moves them by 1-2% of a step, for one more
    byte per parameter in rounds that come every few epochs."""

    def __init__(self, threshold: int = 2**16):
        self.threshold = threshold
        self.small, self.large, self.exact = Float16Compression(), Uniform8Bit(), NoCompression()

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        if not info.descriptor.dtype.is_floating_point or info.role == TensorRole.OPTIMIZER:
            return self.exact
        if info.role == TensorRole.PARAMETER:
            return self.small
        return self.large if info.descriptor.numel() >= self.threshold else self.small


def wire_bytes(numels: list[int], threshold: int = 2**16) -> int:
    """Bytes one copy of float tensors of these sizes takes on the wire (payload only).

    8-bit quantization sends one byte per element plus a 256-entry fp32 codebook per tensor.
    """
    total = 0
    for n in numels:
        total += n + 256 * 4 if n >= threshold else 2 * n
    return total
