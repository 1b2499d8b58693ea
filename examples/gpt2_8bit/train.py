"""Fine-tune GPT-2 with bitsandbytes 8-bit Adam, gradient checkpointing and a streamed corpus.

Runs anywhere as is: a small randomly initialised GPT-2 on a generated local corpus, byte-level
tokens, CPU or GPU. With real weights on a GPU (docs/tutorial-8bit.md):

    python examples/gpt2_8bit/train.py --pretrained gpt2-large --corpus my_corpus.txt \
        --seq-len 1024 --batch-size 1 --steps 1000 --device cuda

It prints perplexity as it trains and, at the end, the peak memory of one training step with
fp32 Adam and with 8-bit Adam on the same model and batch (crowdtrain.measure).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch


def make_corpus(path: Path, *, lines: int = 3000, seed: int = 0) -> Path:
    """A small generated English-like corpus (well under 1 MiB), so nothing is downloaded."""
    rng = random.Random(seed)
    subjects = ["the volunteer", "a small gpu", "the swarm", "every peer", "the coordinator", "our model"]
    verbs = ["trains", "averages", "streams", "compresses", "checks", "shares"]
    objects = ["the gradients", "a batch of images", "the optimizer state", "eight-bit moments", "the loss"]
    tails = ["over the internet.", "while the owner sleeps.", "in half the memory.", "with its neighbours.", "."]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(lines):
            f.write(" ".join([rng.choice(subjects), rng.choice(verbs), rng.choice(objects), rng.choice(tails)]) + "\n")
    return path


def token_stream(corpus: Path, encode, seq_len: int):
    """Stream the text with `datasets` and cut it into (seq_len + 1)-token windows, forever."""
    from datasets import load_dataset

    buffer: list[int] = []
    while True:
        for row in load_dataset("text", data_files=str(corpus), split="train", streaming=True):
            buffer.extend(encode(row["text"] + "\n"))
            while len(buffer) >= seq_len:
                yield buffer[:seq_len]
                buffer = buffer[seq_len:]


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.pretrained:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.pretrained)
        model = GPT2LMHeadModel.from_pretrained(args.pretrained)
        encode = lambda text: tokenizer(text)["input_ids"]
    else:  # bytes as tokens: no tokenizer files needed
        config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_positions=args.seq_len,
                            vocab_size=256, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        encode = lambda text: list(text.encode("utf-8"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, encode


def make_optimizer(kind: str, params, lr: float):
    if kind == "8bit":
        import bitsandbytes as bnb

        return bnb.optim.Adam8bit(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, foreach=True)


def peak_step_bytes(model, batch, kind: str, device) -> int:
    """Peak bytes of the second training step with a fresh optimizer of ``kind`` (weights unchanged)."""
    from crowdtrain.measure import peak_memory_bytes

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(kind, model.parameters(), lr=0.0)

    def step():
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer states
    peak = peak_memory_bytes(step, device=device, track=(model, opt))
    del opt
    model.load_state_dict(state)
    return peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", default=None, help="Hugging Face model id, e.g. gpt2-large (needs the hub)")
    p.add_argument("--corpus", type=Path, default=Path("runs/gpt2_8bit/corpus.txt"),
                   help="text file, one document per line (generated when missing)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if not args.corpus.exists():
        make_corpus(args.corpus)
    model, encode = build(args)
    model.to(device).train()
    stream = token_stream(args.corpus, encode, args.seq_len)
    next_batch = lambda: torch.tensor([next(stream) for _ in range(args.batch_size)], device=device)
    opt = make_optimizer("8bit", model.parameters(), args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 {n_params / 1e6:.1f}M params on {device}, 8-bit Adam, gradient checkpointing, "
          f"batch {args.batch_size} x {args.seq_len}", flush=True)
    running = []
    for step in range(1, args.steps + 1):
        batch = next_batch()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        running.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            mean = sum(running) / len(running)
            print(f"step {step:5d}  loss {mean:.3f}  perplexity {math.exp(mean):.2f}", flush=True)
            running = []
    del opt
    batch = next_batch()
    peaks = {kind: peak_step_bytes(model, batch, kind, device) for kind in ("fp32", "8bit")}
    print("\npeak memory of one training step (same model, same batch)")
    print(f"{'optimizer':12}{'peak MiB':>12}")
    for kind, label in (("fp32", "fp32 Adam"), ("8bit", "8-bit Adam")):
        print(f"{label:12}{peaks[kind] / 2**20:12.1f}")
    print(f"saved: {(peaks['fp32'] - peaks['8bit']) / 2**20:.1f} MiB ({1 - peaks['8bit'] / peaks['fp32']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
