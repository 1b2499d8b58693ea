"""Measure the real peak memory of training steps and compare it with the estimate (needs torch).

Used by the test and by ``benchmarks/bench_memcalc.py``. Each case builds a small, randomly
initialised model (a Hugging Face GPT-2/BERT or one of our presets), runs two training steps
with the requested options (the first creates the optimizer states) and measures the second
with :func:`crowdtrain.measure.peak_memory_bytes`: tensor bytes via torch's MemTracker on CPU,
``torch.cuda.max_memory_allocated`` on a GPU. Gradients are set to None between steps, as the
estimate assumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from crowdtrain.measure import peak_memory_bytes
from crowdtrain.memcalc.architectures import Architecture, bert, get_architecture, gpt2_like
from crowdtrain.memcalc.estimate import Options, estimate


@dataclass(frozen=True)
class Case:
    """One measured configuration: a model (``hf:<family>`` small config, or ``crowdtrain-<preset>``)."""

    name: str
    model: str
    options: Options
    dims: tuple = ()  # (layers, width, heads, vocab, seq) for Hugging Face cases

    def architecture(self) -> Architecture:
        if self.model == "hf:gpt2":
            layers, h, heads, vocab, seq = self.dims
            return gpt2_like("gpt2-test", "test", layers=layers, h=h, heads=heads, vocab=vocab, positions=seq)
        if self.model == "hf:bert":
            layers, h, heads, vocab, seq = self.dims
            return bert("bert-test", "test", layers=layers, h=h, heads=heads, vocab=vocab, positions=seq, seq_len=seq)
        return get_architecture(self.model)


GPT2_DIMS = (4, 256, 4, 8000, 256)
BERT_DIMS = (4, 256, 4, 8000, 256)
O = Options  # short alias for the table below

CASES = [
    Case("gpt2 fp32 adam", "hf:gpt2", O(batch_size=4), GPT2_DIMS),
    Case("gpt2 fp32 adam ckpt", "hf:gpt2", O(batch_size=4, checkpointing=True), GPT2_DIMS),
    Case("gpt2 fp32 8bit", "hf:gpt2", O(batch_size=4, optimizer="8bit"), GPT2_DIMS),
    Case("gpt2 fp32 8bit ckpt", "hf:gpt2", O(batch_size=2, optimizer="8bit", checkpointing=True), GPT2_DIMS),
    Case("gpt2 fp32 adafactor", "hf:gpt2", O(batch_size=4, optimizer="factorized"), GPT2_DIMS),
    Case("gpt2 mixed adam", "hf:gpt2", O(batch_size=4, precision="mixed"), GPT2_DIMS),
    Case("gpt2 pure16 16bit", "hf:gpt2", O(batch_size=4, precision="pure16", optimizer="16bit"), GPT2_DIMS),
    Case("gpt2 fp32 adam shared2", "hf:gpt2", O(batch_size=4, shared_groups=2), GPT2_DIMS),
    Case("bert fp32 adam", "hf:bert", O(batch_size=4), BERT_DIMS),
    Case("tiny fp32 adam", "crowdtrain-tiny", O(batch_size=8)),
    Case("demo fp32 adam", "crowdtrain-demo", O(batch_size=8)),
    Case("demo fp32 adam ckpt", "crowdtrain-demo", O(batch_size=8, checkpointing=True)),
    Case("demo fp32 adam reversible", "crowdtrain-demo", O(batch_size=8, reversible=True)),
    Case("demo pure16 8bit", "crowdtrain-demo", O(batch_size=8, precision="pure16", optimizer="8bit")),
    Case("demo mixed adafactor ckpt", "crowdtrain-demo", O(batch_size=8, precision="mixed", optimizer="factorized",
                                                           checkpointing=True)),
]


def build_model(case: Case, device: torch.device):
    """The model and a ``loss(batch)`` closure inputs for ``case``; fp32 on ``device``."""
    opts = case.options
    if case.model.startswith("hf:"):
        from crowdtrain.memcalc.calibrate import build_hf

        layers, h, heads, vocab, seq = case.dims
        model = build_hf(case.model[3:], layers=layers, h=h, heads=heads, d_head=h // heads, f=4 * h, s=seq, V=vocab)
        if opts.shared_groups:  # ALBERT-style: layer i is layer i % groups
            blocks = model.transformer.h
            for i in range(len(blocks)):
                blocks[i] = blocks[i % opts.shared_groups]
        if opts.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(2, vocab, (opts.batch_size, seq), device=device)
        loss = lambda m: m(input_ids=ids, labels=ids).loss
    else:
        from crowdtrain.model.config import get_preset
        from crowdtrain.model.transformer import DalleTransformer

        config = get_preset(case.model.removeprefix("crowdtrain-"), checkpointing=opts.checkpointing,
                            reversible=opts.reversible)
        model = DalleTransformer(config)
        text = torch.randint(1, config.text_vocab_size, (opts.batch_size, config.text_len), device=device)
        image = torch.randint(0, config.image_vocab_size, (opts.batch_size, config.image_len), device=device)
        loss = lambda m: m(text, image).loss
    return model.to(device).train(), loss


def make_optimizer(params, optimizer: str, *, foreach: bool):
    if optimizer in ("fp32", "16bit"):  # state dtype follows the parameters'
        return torch.optim.Adam(params, lr=1e-4, foreach=foreach)
    if optimizer == "8bit":
        import bitsandbytes as bnb

        return bnb.optim.Adam8bit(params, lr=1e-4)
    if optimizer == "factorized":
        return torch.optim.Adafactor(params, lr=1e-3, foreach=foreach)
    raise ValueError(optimizer)


def measure_case(case: Case, device: str | torch.device = "cpu") -> dict:
    """Run two steps of ``case``; return estimate, measured peak of the second and the error."""
    device = torch.device(device)
    opts = case.options
    if opts.offload:
        raise ValueError("offload moves memory between devices; validate it on a GPU by hand")
    if opts.optimizer == "16bit" and opts.precision != "pure16":
        raise ValueError("16-bit optimizer states are measured with precision=pure16 (torch keeps states in param dtype)")
    torch.manual_seed(0)
    model, loss_fn = build_model(case, device)
    masters = None
    if opts.precision != "fp32":
        model.to(torch.bfloat16)
    if opts.precision == "mixed":
        # fp32 master weights own the optimizer; the 16-bit model only runs forward/backward.
        masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
        opt = make_optimizer(masters, opts.optimizer, foreach=opts.foreach)
    else:
        opt = make_optimizer(model.parameters(), opts.optimizer, foreach=opts.foreach)

    def step():
        loss_fn(model).backward()
        if masters is not None:
            params = list(model.parameters())
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
                    m.grad = None
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()
    measured = peak_memory_bytes(step, device=device, track=(model, opt, *(masters or ())))
    est = estimate(case.architecture(), opts)
    predicted = est.gpu_total
    return {"case": case.name, "model": case.model, "options": dataclasses.asdict(opts),
            "estimate_bytes": predicted, "measured_bytes": measured,
            "error": (predicted - measured) / measured, "peak_phase": est.peak_phase,
            "breakdown_bytes": dataclasses.asdict(est.gpu), "device": str(device)}
