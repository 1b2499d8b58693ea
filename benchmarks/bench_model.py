"""Model benchmarks: sparse patterns vs the dense-mask reference, cached sampling, activation memory.

Prints three tables and writes benchmarks/results/bench_model.json. Every figure is a ratio
against a baseline measured in the same process, interleaved (A, B, A, B, ...) and reduced
with the median, because the machines this runs on are shared and noisy (the load average is
printed next to the results). Each ratio is given twice: by wall-clock time (what tokens/s
means) and by this process's CPU time, which other processes on a busy machine disturb much
less; with ``--threads 1`` the CPU time is the work itself.

    python benchmarks/bench_model.py --threads 1   # full run, ~10 minutes on a 2-core CPU box
    python benchmarks/bench_model.py --quick       # smaller sizes, for a smoke check

Only a full run (no --quick, no --skip) writes bench_model.json; partial runs write
bench_model_partial.json (or --out), so a smoke check never replaces the recorded figures.
Each row records the load average when it finished.

"Paper-shaped" configs keep what makes the paper's model what it is and shrink the rest: head
dim 64 with width = heads x 64 (the paper: 16 heads, width 1024), the layer cycle
(row, col, row, row) ending in a conv_like layer with shared weight groups, tied embeddings,
a 64-token caption and a square image grid (the paper: 32x32 with 256 text tokens), depth 8.

Why the efficient/dense ratio has a ceiling: attention is only part of a step. Per token and
layer the weights cost ~16 * width^2 multiply-adds (q, k, v, out and the GEGLU feed-forward);
dense attention costs 2 * seq * width, efficient attention 2 * (text + block) * width. So
dense / efficient <= (16 * width + 2 * seq) / (16 * width + 2 * (text + block)) even if every
op ran at the same speed; the "FLOP bound" column prints this estimate (backward included).
At seq 1088 it is 2.0x for width 128 and 1.5x for width 256 (3.2x and 2.2x at seq 2368): a 2x
gain at seq ~1k needs a narrow model or a longer sequence, and the paper's own shape (width 1024,
seq 1280) would gain at most ~1.15x from sparse attention in a training step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from crowdtrain.measure import peak_memory_bytes
from crowdtrain.model import DalleTransformer, ModelConfig, get_preset
from crowdtrain.model.attention import choose_impl
from crowdtrain.model.config import _cycle
from crowdtrain.model.sampling import generate_images, sample_next, uncached_logits

RESULTS = Path(__file__).parent / "results"


def paper_shaped(grid: int, *, width: int = 128, depth: int = 8, text_len: int = 64, **kw) -> ModelConfig:
    """The paper's layout (head dim 64; row, col, row, row ... conv; shared groups), smaller."""
    return ModelConfig(
        width=width, depth=depth, heads=width // 64, head_dim=64, text_len=text_len, text_vocab_size=1024,
        image_height=grid, image_width=grid, image_vocab_size=1024,
        patterns=_cycle(("axial_row", "axial_col", "axial_row", "axial_row"), depth - 1) + ("conv_like",),
        share_ids=_cycle((0, 1, 2, 3), depth - 1) + (4,), **kw)


def batch_for(cfg: ModelConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, cfg.text_vocab_size, (batch, cfg.text_len), generator=g)
    text[:, cfg.text_len * 3 // 4:] = cfg.text_pad_id  # some padding, as real captions have
    image = torch.randint(0, cfg.image_vocab_size, (batch, cfg.image_len), generator=g)
    return text, image


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def make_step(model: DalleTransformer, text: torch.Tensor, image: torch.Tensor, device: str):
    """One training step (forward, backward, drop the gradients), synchronised on CUDA."""

    def step():
        model(text, image).loss.backward()
        model.zero_grad(set_to_none=True)
        sync(device)

    return step


# ---- FLOP model ------------------------------------------------------------------------
def step_flops(cfg: ModelConfig, impl: str) -> float:
    """Multiply-adds of one training step per sequence, as each implementation computes them.

    Weights: 3x the forward (forward, grad of inputs, grad of weights). Attention: dense SDPA
    scores every (query, key) pair of the seq x seq mask and its backward recomputes them (3.5x
    the forward); the efficient path scores each image query against text + its block (3x).
    """
    t, n, w, inner = cfg.text_len, cfg.image_len, cfg.width, cfg.inner_dim
    seq = cfg.seq_len
    hidden = cfg.ff_mult * w
    weights = seq * (3 * w * inner + inner * w + 3 * hidden * w) * cfg.depth
    weights += w * ((t - 1) * cfg.text_vocab_size + n * cfg.image_vocab_size)
    block_keys = {"axial_row": cfg.image_width, "axial_col": cfg.image_height,
                  "conv_like": (cfg.conv_kernel // 2 + 1) * cfg.image_width, "full": t + n}
    attention = 0.0
    for pattern in cfg.patterns:
        if choose_impl(impl, pattern, seq) == "dense":
            attention += 3.5 * 2 * seq * seq * inner
        else:
            attention += 3.0 * 2 * (t * t + n * (t + block_keys[pattern])) * inner
    return 3 * weights + attention


# ---- training throughput ---------------------------------------------------------------
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
            times[impl].append(timed(step))
    tokens = batch * cfg.seq_len
    (eff, eff_cpu), (dense, dense_cpu) = medians(times["efficient"]), medians(times["dense"])
    auto = sorted({choose_impl("auto", p, cfg.seq_len) for p in cfg.patterns})
    return {"config": name, "seq_len": cfg.seq_len, "width": cfg.width, "heads": cfg.heads, "batch": batch,
            "efficient_tokens_per_s": tokens / eff, "dense_tokens_per_s": tokens / dense, "speedup": dense / eff,
            "speedup_cpu_time": dense_cpu / eff_cpu,
            "flop_bound": step_flops(cfg, "dense") / step_flops(cfg, "efficient"), "auto_picks": "+".join(auto),
            "load_average": load_average()}


# ---- sampling --------------------------------------------------------------------------
def bench_sampling(cfg: ModelConfig, batch: int, sample_rows: int, repeats: int, device: str) -> dict:
    """Cached generation of the whole image vs the no-cache baseline, tokens/s.

    The baseline is what sampling without a cache must do: for each new code, the model's
    normal forward over the text and the image rows up to that code's row. Its cost depends
    only on the row, so it is timed for one code in each of ``sample_rows`` rows spread evenly
    over the grid (stratified: the midpoint row of each equal slice) and averaged; with
    sample_rows = image_height it is exactly the mean over all codes.
    """
    torch.manual_seed(0)
    model = DalleTransformer(cfg).to(device).eval()
    text, _ = (t.to(device) for t in batch_for(cfg, batch))
    keep = model.text_keep(text)
    h, w = cfg.image_height, cfg.image_width
    rows = sorted({(2 * i + 1) * h // (2 * sample_rows) for i in range(sample_rows)})
    codes = torch.randint(0, cfg.image_vocab_size, (batch, cfg.image_len), device=device)

    def uncached_token(row: int) -> None:
        k = row * w + w // 2
        with torch.inference_mode():  # as generate_images(use_cache=False) runs it
            codes[:, k] = sample_next(uncached_logits(model, text, keep, codes, k), temperature=1.0, top_k=256,
                                      top_p=None, generator=None)
        sync(device)

    def generate() -> None:
        generate_images(model, text, seed=0)
        sync(device)

    generate()  # warm-up
    uncached_token(rows[-1])
    cached, uncached = [], []
    for _ in range(repeats):
        cached.append(timed(generate))
        per_row = [timed(lambda: uncached_token(r)) for r in rows]
        uncached.append((statistics.mean(p[0] for p in per_row), statistics.mean(p[1] for p in per_row)))
    (cached_s, cached_cpu), (uncached_s, uncached_cpu) = medians(cached), medians(uncached)
    cached_tps = batch * cfg.image_len / cached_s
    uncached_tps = batch / uncached_s
    return {"image_tokens": cfg.image_len, "seq_len": cfg.seq_len, "width": cfg.width, "heads": cfg.heads,
            "batch": batch, "cached_tokens_per_s": cached_tps, "uncached_tokens_per_s": uncached_tps,
            "speedup": cached_tps / uncached_tps, "speedup_cpu_time": uncached_cpu * cfg.image_len / cached_cpu,
            "uncached_rows_timed": rows, "load_average": load_average()}


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
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "sampling", "memory"])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: results/bench_model.json for a full run, "
                             "results/bench_model_partial.json with --quick or --skip)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = load_average()
    print(f"device {args.device}, {torch.get_num_threads()} threads, load average {load:.1f} at start")
    result = {"device": args.device, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "quick": args.quick, "load_average_at_start": load}

    if "throughput" not in args.skip:
        # Batches keep ~2k tokens per step where the sequence allows it.
        # The demo preset as shipped (96 positions), and with a 32x32 grid (1056): the 2x target
        # of issue 2 is about sequences of 1024 and more.
        configs = [("demo", get_preset("demo"), 32),
                   ("demo 32x32", get_preset("demo", image_height=32, image_width=32), 2)]
        sizes = [(128, 16), (128, 32), (256, 32)] if args.quick else [(128, 16), (128, 32), (128, 48), (128, 64),
                                                                      (256, 32), (256, 64)]
        for width, grid in sizes:
            cfg = paper_shaped(grid, width=width)
            configs.append((f"paper-shaped w{width} {grid}x{grid}", cfg, max(1, round(2048 / cfg.seq_len))))
        throughput = []
        print("\nTraining step throughput, sparse patterns vs dense-mask reference (same process, medians)")
        print(f"{'config':<27}{'seq':>6}{'batch':>6}{'eff tok/s':>11}{'dense tok/s':>12}{'speedup':>9}"
              f"{'(CPU time)':>11}{'FLOP bound':>11}  auto picks")
        for name, cfg, batch in configs:
            r = bench_throughput(name, cfg, batch, args.repeats, args.device)
            throughput.append(r)
            print(f"{r['config']:<27}{r['seq_len']:>6}{r['batch']:>6}{r['efficient_tokens_per_s']:>11.0f}"
                  f"{r['dense_tokens_per_s']:>12.0f}{r['speedup']:>8.2f}x{r['speedup_cpu_time']:>10.2f}x"
                  f"{r['flop_bound']:>10.2f}x  {r['auto_picks']}",
                  flush=True)
        result["throughput"] = throughput

    if "sampling" not in args.skip:
        grid = 16 if args.quick else 32
        sampling = []
        print(f"\nSampling a {grid}x{grid} image ({grid * grid} tokens) after a 64-token caption, tokens/s: KV cache vs "
              "the normal forward over the prefix for every token (timed on a stratified sample of rows)")
        print(f"{'config':<22}{'batch':>6}{'cached':>9}{'uncached':>10}{'speedup':>9}{'(CPU time)':>11}")
        for width in (128, 256):
            for batch in (1, 8):
                r = bench_sampling(paper_shaped(grid, width=width), batch, sample_rows=4 if args.quick else 8,
                                   repeats=max(1, args.repeats // 2), device=args.device)
                sampling.append(r)
                print(f"{'paper-shaped w' + str(width):<22}{batch:>6}{r['cached_tokens_per_s']:>9.1f}"
                      f"{r['uncached_tokens_per_s']:>10.1f}{r['speedup']:>8.1f}x{r['speedup_cpu_time']:>10.1f}x",
                      flush=True)
        print(f"  uncached rows timed: {sampling[0]['uncached_rows_timed']} of {grid}")
        result["sampling"] = sampling

    if "memory" not in args.skip:
        memory = bench_memory([4, 8] if args.quick else [4, 8, 16, 32], args.device)
        print("\nPeak memory of a training step, demo preset at several depths (MiB; weights+grads included)")
        print(f"{'depth':>6}{'plain':>10}{'checkpointed':>14}{'reversible':>12}")
        for r in memory:
            print(f"{r['depth']:>6}{r['plain_mib']:>10.1f}{r['checkpointed_mib']:>14.1f}{r['reversible_mib']:>12.1f}")
        result["memory"] = memory

    result["load_average_at_end"] = load_average()
    out = args.out or RESULTS / ("bench_model_partial.json" if args.quick or args.skip else "bench_model.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nload average {result['load_average_at_end']:.1f} at end; wrote {out}")


if __name__ == "__main__":
    main()
