"""Model benchmarks: sparse patterns vs the dense-mask reference, cached sampling, activation memory.

Prints three tables and writes benchmarks/results/bench_model.json. Every figure is a ratio
against a baseline measured in the same process, interleaved (A, B, A, B, ...) and reduced
with the median, because the machines this runs on are shared and noisy.

    python benchmarks/bench_model.py            # full run, a few minutes on 2 CPU cores
    python benchmarks/bench_model.py --quick    # smaller sizes, for a smoke check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from crowdtrain.measure import peak_memory_bytes
from crowdtrain.model import DalleTransformer, ModelConfig, generate_images, get_preset
from crowdtrain.model.config import _cycle

RESULTS = Path(__file__).parent / "results"


def paper_shaped(grid: int, *, width: int = 128, depth: int = 8, text_len: int = 64, **kw) -> ModelConfig:
    """The paper's layout (row, col, row, row ... conv; shared groups; tied embeddings), smaller."""
    return ModelConfig(
        width=width, depth=depth, heads=max(1, width // 32), head_dim=32, text_len=text_len, text_vocab_size=1024,
        image_height=grid, image_width=grid, image_vocab_size=1024,
        patterns=_cycle(("axial_row", "axial_col", "axial_row", "axial_row"), depth - 1) + ("conv_like",),
        share_ids=_cycle((0, 1, 2, 3), depth - 1) + (4,), **kw)


def batch_for(cfg: ModelConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, cfg.text_vocab_size, (batch, cfg.text_len), generator=g)
    text[:, cfg.text_len * 3 // 4:] = cfg.text_pad_id  # some padding, as real captions have
    image = torch.randint(0, cfg.image_vocab_size, (batch, cfg.image_len), generator=g)
    return text, image


def make_step(model: DalleTransformer, text: torch.Tensor, image: torch.Tensor, device: str):
    """One training step (forward, backward, drop the gradients), synchronised on CUDA."""

    def step():
        model(text, image).loss.backward()
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return step


def bench_throughput(name: str, cfg: ModelConfig, batch: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    model = DalleTransformer(cfg).to(device)
    text, image = (t.to(device) for t in batch_for(cfg, batch))
    step = make_step(model, text, image, device)
    times = {"efficient": [], "dense": []}
    for impl in times:  # warm-up both paths
        model.attention_impl = impl
        step()
    for _ in range(repeats):
        for impl in times:
            model.attention_impl = impl
            t0 = time.perf_counter()
            step()
            times[impl].append(time.perf_counter() - t0)
    tokens = batch * cfg.seq_len
    eff, dense = statistics.median(times["efficient"]), statistics.median(times["dense"])
    return {"config": name, "seq_len": cfg.seq_len, "width": cfg.width, "batch": batch,
            "efficient_tokens_per_s": tokens / eff, "dense_tokens_per_s": tokens / dense, "speedup": dense / eff}


def bench_sampling(cfg: ModelConfig, batch: int, uncached_tokens: int, device: str) -> dict:
    torch.manual_seed(0)
    model = DalleTransformer(cfg).to(device).eval()
    text, _ = (t.to(device) for t in batch_for(cfg, batch))
    t0 = time.perf_counter()
    generate_images(model, text, seed=0)
    cached_s = time.perf_counter() - t0
    # Without the cache every token re-runs the whole sequence, so each token costs the same:
    # time the first `uncached_tokens` of a generation and scale to the full image.
    t0 = time.perf_counter()
    _time_uncached_prefix(model, text, uncached_tokens)
    per_token_uncached = (time.perf_counter() - t0) / uncached_tokens
    n = cfg.image_len
    cached_tps = batch * n / cached_s
    uncached_tps = batch / per_token_uncached
    return {"image_tokens": n, "seq_len": cfg.seq_len, "batch": batch, "cached_tokens_per_s": cached_tps,
            "uncached_tokens_per_s": uncached_tps, "speedup": cached_tps / uncached_tps,
            "uncached_tokens_timed": uncached_tokens}


@torch.no_grad()
def _time_uncached_prefix(model: DalleTransformer, text: torch.Tensor, tokens: int) -> None:
    """The body of ``generate_images(use_cache=False)`` for the first ``tokens`` codes."""
    from crowdtrain.model.sampling import sample_next

    cfg = model.config
    keep = model.text_keep(text)
    codes = torch.zeros(text.shape[0], cfg.image_len, dtype=torch.long, device=text.device)
    for k in range(tokens):
        h = model.final_norm(model.run_layers(model.embed(text, model.image_stream(codes)), keep))
        codes[:, k] = sample_next(model.logits(h[:, cfg.text_len + k], "image"), temperature=1.0, top_k=256,
                                  top_p=None, generator=None)


def bench_memory(depths: list[int], device: str, batch: int = 8) -> list[dict]:
    rows = []
    for depth in depths:
        row = {"depth": depth}
        for mode in ("plain", "checkpointed", "reversible"):
            cfg = get_preset("demo", depth=depth, patterns=_cycle(("axial_row", "axial_col", "axial_row", "axial_row"), depth),
                             share_ids=_cycle((0, 1, 2, 3), depth), reversible=mode == "reversible",
                             checkpointing=mode == "checkpointed")
            torch.manual_seed(0)
            model = DalleTransformer(cfg).to(device)
            text, image = (t.to(device) for t in batch_for(cfg, batch))
            step = make_step(model, text, image, device)
            step()
            row[f"{mode}_mib"] = peak_memory_bytes(step, device=device, track=(model,)) / 2**20
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    grids = [16, 32] if args.quick else [16, 32, 48, 64]
    configs = [("demo", get_preset("demo"), 32)]
    configs += [(f"paper-shaped {g}x{g}", paper_shaped(g), 1) for g in grids]
    throughput = [bench_throughput(n, c, b, args.repeats, args.device) for n, c, b in configs]
    print("\nTraining step throughput, sparse patterns vs dense-mask reference (same process, medians)")
    print(f"{'config':<22}{'seq':>6}{'eff tok/s':>12}{'dense tok/s':>13}{'speedup':>9}")
    for r in throughput:
        print(f"{r['config']:<22}{r['seq_len']:>6}{r['efficient_tokens_per_s']:>12.0f}{r['dense_tokens_per_s']:>13.0f}"
              f"{r['speedup']:>8.2f}x")

    sampling_grid = 16 if args.quick else 32
    sampling = bench_sampling(paper_shaped(sampling_grid), batch=2, uncached_tokens=8 if args.quick else 24,
                              device=args.device)
    print(f"\nSampling {sampling['image_tokens']} image tokens (sequence {sampling['seq_len']}), batch {sampling['batch']}")
    print(f"  with KV cache    {sampling['cached_tokens_per_s']:8.1f} tokens/s")
    print(f"  without cache    {sampling['uncached_tokens_per_s']:8.1f} tokens/s "
          f"(timed over {sampling['uncached_tokens_timed']} tokens; each costs a full forward)")
    print(f"  speedup          {sampling['speedup']:8.1f}x")

    memory = bench_memory([4, 8] if args.quick else [4, 8, 16, 32], args.device)
    print("\nPeak memory of a training step, demo preset at several depths (MiB; weights+grads included)")
    print(f"{'depth':>6}{'plain':>10}{'checkpointed':>14}{'reversible':>12}")
    for r in memory:
        print(f"{r['depth']:>6}{r['plain_mib']:>10.1f}{r['checkpointed_mib']:>14.1f}{r['reversible_mib']:>12.1f}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_model.json"
    out.write_text(json.dumps({"device": args.device, "throughput": throughput, "sampling": sampling,
                               "memory": memory}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
