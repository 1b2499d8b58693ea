"""Peak training memory of a model under memory-saving options: pure arithmetic, no torch.

The step is modelled as the allocator sees it (docs/memcalc.md derives every term):

- Static: weights ``W``, optimizer states ``O`` (plus fp32 master weights in mixed
  precision), buffers ``B``. Gradients are set to None between steps.
- Backward start: all saved activations ``A`` plus the loss's backward temporaries, plus the
  first gradient (the output projection's). Activations are freed layer by layer as gradients
  appear, a linear trade, so the peak of backward is at one of its ends.
- Optimizer step: ``W + O + B + G`` plus the step's temporaries (fp32 gradient copies for
  master weights; one state-sized scratch tensor for torch's multi-tensor Adam/Adafactor).

Peak = max(backward start, optimizer step). With ``offload`` the optimizer (states, master
weights, its fp32 gradient copy, its scratch) lives in CPU RAM and the GPU keeps W, G, A, B.

If the estimate says it does not fit: turn on checkpointing (activations shrink to one layer
input per layer), then an 8-bit or factorized optimizer (states from 8 or 12 B/param to about
2), then offload (states leave the GPU, at the cost of PCIe traffic each step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from crowdtrain.memcalc.architectures import ACTIVATION_COEFFS, Architecture, get_architecture

GIB = 2**30
GPU_SIZES_GB = (8, 12, 16, 24, 40, 80)
OPTIMIZERS = ("fp32", "16bit", "8bit", "factorized")
PRECISIONS = ("fp32", "mixed", "pure16")
BLOCKSIZE_8BIT = 256  # bitsandbytes' blockwise quantisation: one fp32 absmax per 256 values and state
QMAP_BYTES = 2 * 256 * 4  # the two 256-entry quantisation maps, shared by all tensors


@dataclass(frozen=True)
class Options:
    """What the training step does. Defaults: plain fp32 Adam, batch 1, the model's sequence."""

    optimizer: str = "fp32"  # fp32 (Adam/LAMB states), 16bit, 8bit (blockwise), factorized (Adafactor)
    precision: str = "fp32"  # fp32, mixed (16-bit model, fp32 master weights), pure16
    offload: bool = False  # optimizer states, master weights and the update on the CPU
    checkpointing: bool = False  # keep only each layer's input, recompute in backward
    reversible: bool = False  # keep only the last layer's two streams, invert in backward
    shared_groups: int | None = None  # distinct layers per stack (ALBERT-style sharing); None: the model's own
    batch_size: int = 1  # micro-batch (sequences per forward/backward)
    seq_len: int | None = None  # None: the model's default
    pcie_gb_per_s: float = 16.0  # host<->device bandwidth for the offload traffic (PCIe 3.0 x16 ~ 16 GB/s)
    foreach: bool = True  # torch's multi-tensor optimizer step (its CUDA default): one scratch copy of all states
    reserve_gb: float = 0.75  # CUDA context and allocator slack subtracted from a GPU before "fits"

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose from {', '.join(PRECISIONS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.shared_groups is not None and self.shared_groups < 1:
            raise ValueError(f"shared_groups must be >= 1 (or None for no sharing), got {self.shared_groups}")
        if not (math.isfinite(self.pcie_gb_per_s) and self.pcie_gb_per_s > 0):  # NaN passes a plain `<= 0`
            raise ValueError(f"pcie_gb_per_s must be a positive finite number, got {self.pcie_gb_per_s}")

    @classmethod
    def from_dict(cls, d: dict) -> "Options":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class Parts:
    """Bytes by kind on one device."""

    weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0  # includes fp32 master weights in mixed precision
    activations: int = 0  # saved for backward, plus the loss's backward temporaries
    buffers: int = 0
    temporaries: int = 0  # optimizer-step scratch (fp32 gradient copies, multi-tensor scratch)

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def gb(self) -> dict[str, float]:
        return {k: v / GIB for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Estimate:
    model: str
    options: Options
    params: int  # parameters the model applies (every layer counted)
    unique_params: int  # after sharing: what is stored, updated and communicated
    seq_len: int
    gpu: Parts
    cpu: Parts
    peak_phase: str  # "backward" or "optimizer step": where the GPU peak is
    traffic_bytes_per_step: int
    traffic_s_per_step: float
    fits: dict[int, bool] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return self.gpu.total

    @property
    def cpu_total(self) -> int:
        return self.cpu.total

    def to_dict(self) -> dict:
        """JSON-ready; sizes in GiB (``*_gb``, 2**30 bytes) and exact bytes under ``*_bytes``."""
        return {
            "model": self.model, "options": dataclasses.asdict(self.options), "params": self.params,
            "unique_params": self.unique_params, "seq_len": self.seq_len,
            "gpu_total_gb": self.gpu_total / GIB, "cpu_total_gb": self.cpu_total / GIB,
            "gpu_gb": self.gpu.gb(), "cpu_gb": self.cpu.gb(),
            "gpu_bytes": dataclasses.asdict(self.gpu), "cpu_bytes": dataclasses.asdict(self.cpu),
            "peak_phase": self.peak_phase, "traffic_gb_per_step": self.traffic_bytes_per_step / GIB,
            "traffic_s_per_step": self.traffic_s_per_step,
            "fits": {f"{k}": v for k, v in self.fits.items()},
        }


# ---- activations ----------------------------------------------------------------------------
def _linear(coeffs: dict[str, float], dims: dict[str, float]) -> float:
    return sum(c * dims[name] for name, c in coeffs.items())


@dataclass(frozen=True)
class ActivationProfile:
    """Per micro-batch bytes: what each layer saves, the non-repeated part, the loss temporaries."""

    layers: tuple[float, ...]  # saved by each layer, in order
    head: float  # embeddings, final norm, logits and loss
    loss_backward: float  # extra while the loss is differentiated (logit gradients)
    layer_input: float  # one layer's input (what checkpointing keeps per layer)


def activation_profile(arch: Architecture, *, batch: int, seq: int, p: int) -> ActivationProfile:
    """``p``: bytes per activation element (4 for fp32, 2 for 16-bit)."""
    layer_input = batch * seq * arch.width * p
    if arch.family == "crowdtrain":
        c = arch.preset
        layers = tuple(batch * c["layer_bytes"][pattern][str(p)] for pattern in c["patterns"])
        head = batch * c["head_bytes"][str(p)]
        logits = batch * c["logits_per_sample"]
        q = 4  # our model upcasts logits before the cross-entropy
    else:
        coeffs = ACTIVATION_COEFFS[arch.family]
        dims = {"h": arch.width, "a": arch.heads * arch.d_head, "f": arch.ff, "hs": arch.heads * seq, "s": seq,
                "heads": arch.heads, "V": arch.logits_per_token, "1": 1}
        tokens = batch * seq
        layers = tuple(tokens * _linear(coeffs[stack.name][str(p)], dims)
                       for stack in arch.stacks for _ in range(stack.layers))
        head = tokens * _linear(coeffs["head"][str(p)], dims)
        logits = tokens * arch.logits_per_token
        q = coeffs["head"][str(p)]["V"]  # bytes per saved log-probability (4 when upcast)
    # Backward through the loss: the gradient of the log-probs and of the logits, in the loss
    # dtype (measured: the cast back to 16-bit happens after the log-probs are freed).
    loss_backward = logits * 2 * q
    return ActivationProfile(layers, head, loss_backward, layer_input)


def saved_and_transient(profile: ActivationProfile, *, checkpointing: bool, reversible: bool) -> tuple[float, float]:
    """Activation bytes kept at the start of backward, and the largest transient of backward
    other than the loss's (``profile.loss_backward``)."""
    largest_layer = max(profile.layers) if profile.layers else 0.0
    if reversible:
        # Two output streams kept; backward recomputes one layer at a time holding the streams,
        # their gradients and the reconstructed inputs.
        return 2 * profile.layer_input + profile.head, largest_layer + 4 * profile.layer_input
    if checkpointing:
        # Each layer's input kept; backward recomputes one layer (and keeps its input's gradient).
        return len(profile.layers) * profile.layer_input + profile.head, largest_layer + profile.layer_input
    return sum(profile.layers) + profile.head, 0.0


# ---- optimizer --------------------------------------------------------------------------------
def optimizer_state_bytes(stats, optimizer: str) -> int:
    """Bytes of Adam-style (or Adafactor) state for parameters with statistics ``stats``."""
    if optimizer == "fp32":
        return 8 * stats.numel  # exp_avg + exp_avg_sq in fp32
    if optimizer == "16bit":
        return 4 * stats.numel
    if optimizer == "8bit":
        big = stats.numel - stats.small
        # uint8 state1 + state2, one fp32 absmax per block and state; small tensors stay fp32.
        blocks = -(-big // BLOCKSIZE_8BIT)
        return 2 * big + 2 * 4 * blocks + 8 * stats.small + QMAP_BYTES
    if optimizer == "factorized":
        return 4 * stats.factored  # Adafactor without momentum: row and column second moments
    raise AssertionError(optimizer)


def step_scratch_bytes(stats, optimizer: str, *, master: bool, param_bytes: int, foreach: bool) -> int:
    """Temporaries of one optimizer step (fp32 master-gradient copies are added by the caller)."""
    if optimizer == "8bit":
        return 0  # one fused kernel per tensor
    elem = 4 if (master or optimizer == "fp32") else param_bytes
    if optimizer == "16bit" and not master:
        elem = 2
    if foreach:
        return elem * stats.numel  # e.g. torch._foreach_sqrt(exp_avg_sqs): one copy of every state
    return (2 if optimizer in ("fp32", "16bit") else 1) * elem * stats.largest


# ---- the estimate ---------------------------------------------------------------------------
def estimate(model: str | Architecture, options: Options | None = None, **kwargs) -> Estimate:
    """Peak GPU memory and CPU RAM of one training step of ``model`` under ``options``.

    ``estimate("gpt2-large", optimizer="8bit", offload=True, checkpointing=True)``; keyword
    arguments override fields of ``options``.
    """
    arch = get_architecture(model) if isinstance(model, str) else model
    options = dataclasses.replace(options or Options(), **kwargs) if kwargs else (options or Options())
    seq = options.seq_len or arch.seq_len
    if arch.fixed_seq_len and seq != arch.seq_len:
        raise ValueError(f"{arch.name} has a fixed sequence of {arch.seq_len} tokens (text + image grid); "
                         "leave seq_len unset or change the preset")
    if options.shared_groups is not None and options.shared_groups > max(s.layers for s in arch.stacks):
        raise ValueError(f"shared_groups={options.shared_groups} exceeds {arch.name}'s {arch.layers} layers")
    stats = arch.params(options.shared_groups)
    n = stats.numel
    wb = 4 if options.precision == "fp32" else 2  # weights and gradients
    p = wb  # activations follow the model's dtype
    master = options.precision == "mixed"

    weights = wb * n
    grads = wb * n
    states = optimizer_state_bytes(stats, options.optimizer) + (4 * n if master else 0)
    buffers = 4 * arch.buffer_elems if options.precision == "fp32" else 2 * arch.buffer_elems
    scratch = step_scratch_bytes(stats, options.optimizer, master=master, param_bytes=wb, foreach=options.foreach)
    master_grads = 4 * n if master else 0  # fp32 copies of the 16-bit gradients for the update

    profile = activation_profile(arch, batch=options.batch_size, seq=seq, p=p)
    saved, recompute = saved_and_transient(profile, checkpointing=options.checkpointing, reversible=options.reversible)
    # The worst moment of backward: differentiating the loss, recomputing a layer, or the
    # output projection's weight gradient (the first gradient allocated), whichever is largest.
    first_grad = wb * arch.head_tensor
    transient = max(profile.loss_backward, recompute)
    acts = int(round(saved + transient)) if transient >= first_grad else int(round(saved))
    first_grad = 0 if transient >= first_grad else first_grad

    if options.offload:
        gpu_backward = Parts(weights, first_grad, 0, acts, buffers)
        gpu_step = Parts(weights, grads, 0, 0, buffers)
        # The CPU receives every gradient (as fp32 for the update) and sends back new weights.
        cpu = Parts(0, 4 * n, states, 0, 0, scratch)
        traffic = grads + weights
    else:
        gpu_backward = Parts(weights, first_grad, states, acts, buffers)
        # Mixed precision converts each 16-bit gradient to an fp32 master gradient and frees it.
        gpu_step = Parts(weights, master_grads or grads, states, 0, buffers, scratch)
        cpu = Parts()
        traffic = 0
    backward_is_peak = gpu_backward.total >= gpu_step.total
    gpu = gpu_backward if backward_is_peak else gpu_step
    fits = {size: gpu.total <= (size - options.reserve_gb) * GIB for size in GPU_SIZES_GB}
    applied = arch.base.numel + sum(s.layers * (s.shareable.numel + s.own.numel) for s in arch.stacks)
    return Estimate(
        model=arch.name, options=options, params=applied, unique_params=n, seq_len=seq, gpu=gpu, cpu=cpu,
        peak_phase="backward" if backward_is_peak else "optimizer step", traffic_bytes_per_step=traffic,
        traffic_s_per_step=traffic / (options.pcie_gb_per_s * 1e9), fits=fits)


def format_estimate(est: Estimate) -> str:
    """A small table for the terminal."""
    o = est.options
    lines = [f"{est.model}: {est.unique_params / 1e6:,.1f}M unique parameters ({est.params / 1e6:,.1f}M applied), "
             f"batch {o.batch_size} x {est.seq_len} tokens",
             f"options: optimizer={o.optimizer} precision={o.precision} offload={o.offload} "
             f"checkpointing={o.checkpointing} reversible={o.reversible} shared_groups={o.shared_groups}",
             f"{'':18}{'GPU GiB':>10}{'CPU GiB':>10}"]
    for name in ("weights", "gradients", "optimizer_states", "activations", "buffers", "temporaries"):
        lines.append(f"{name:18}{getattr(est.gpu, name) / GIB:10.2f}{getattr(est.cpu, name) / GIB:10.2f}")
    lines.append(f"{'total':18}{est.gpu_total / GIB:10.2f}{est.cpu_total / GIB:10.2f}")
    lines.append(f"GPU peak during the {est.peak_phase}")
    if o.offload:
        lines.append(f"CPU<->GPU traffic: {est.traffic_bytes_per_step / GIB:.2f} GiB per step, "
                     f"{est.traffic_s_per_step:.2f} s at {o.pcie_gb_per_s:g} GB/s")
    fits = [f"{size} GB" for size, ok in est.fits.items() if ok]
    lines.append("fits on: " + (", ".join(fits) if fits else f"none of {', '.join(map(str, GPU_SIZES_GB))} GB")
                 + f" (keeping {o.reserve_gb:g} GiB for the CUDA context)")
    return "\n".join(lines)
