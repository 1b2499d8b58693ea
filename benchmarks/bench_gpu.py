"""The GPU path in figures: the training step, its memory, sampling and the offloaded optimizer.

Prints a table and writes JSON (with the device's name) for one model preset, by default
`paper` on the first CUDA device:

- training step (forward and backward under autocast, as `crowdtrain join --precision bf16`
  runs it; the optimizer is offloaded, so it is not in the step): samples/s and model FLOP
  utilization (MFU: samples/s x seq_len x 3 x forward FLOPs per token of `crowdtrain model info`,
  over the card's peak; recomputation by reversible layers is not useful work and not counted),
  for each batch size that fits, reversible on and off, sparse ("efficient") and dense attention;
- peak GPU memory of each step against `crowdtrain memcalc` for the same settings (8-bit
  optimizer, offloaded). Autocast keeps fp32 weights and gradients and caches 16-bit copies
  of the weights, which memcalc does not model: its `mixed` (16-bit weights and gradients) is the
  lower figure and `fp32` (every byte at 4) the upper one; `vs_memcalc` is against `mixed`
  (against `fp32` for an fp32 run);
- sampling: samples/s for ``--samples`` (128: the paper's re-ranking batch) of one prompt with
  the KV cache;
- the offloaded 8-bit LAMB step (gradients to the host, the step on the CPU, weights back) on its
  own, and run in a thread beside the next training step as hivemind's delayed update does (the
  gradients copied out before, the weights copied back after): it is hidden when the whole takes
  no more than 1.1x the training step alone.

    python benchmarks/bench_gpu.py                       # a GPU: the paper preset, about 3 min on an H100 (gpu_check.sh: --steps 3 --warmup 1)
    python benchmarks/bench_gpu.py --preset tiny --device cpu --batch-sizes 2 --samples 4 --peak-tflops 0.1
    python benchmarks/bench_gpu.py --profile 8             # where one step's time goes (torch.profiler)

Targets on an H100 (bf16): MFU >= 40% for the paper preset's step, peak memory within 10% of
memcalc, the offloaded optimizer step hidden behind the next step. If MFU is low, ``--profile``
says whether the step is launch-bound (CPU time above GPU time: raise the batch, fuse ops); if
`efficient` beats `dense` on your card, take ``"cuda"`` out of ``AUTO_DENSE_DEVICES`` in
crowdtrain/model/attention.py. Measured figures: docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from crowdtrain.measure import peak_memory_bytes
from crowdtrain.memcalc.estimate import estimate
from crowdtrain.model import DalleTransformer, generate_images, get_preset
from crowdtrain.model.info import model_info
from crowdtrain.train.local import autocast_context

RESULTS = Path(__file__).parent / "results"
GIB = 2**30
# Dense 16-bit tensor-core peaks (TFLOP/s, no sparsity), by a piece of the device's name; fp32
# runs use the fp32 column. Other cards: pass --peak-tflops.
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100 PCIe": (756.0, 51.0), "H100": (989.0, 67.0),
               "A100": (312.0, 19.5), "L40S": (362.0, 91.6), "4090": (165.0, 82.6)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def peak_tflops(name: str, precision: str) -> float | None:
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in name:
            return single if precision == "fp32" else half
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_of(config, batch: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, config.text_vocab_size, (batch, config.text_len), generator=g)
    text[:, config.text_len * 3 // 4:] = config.text_pad_id  # some padding, as real captions have
    image = torch.randint(0, config.image_vocab_size, (batch, config.image_len), generator=g)
    return text.to(device), image.to(device)


def make_step(model, text, image, device, precision):
    """Forward and backward; the gradients stay (an offloaded optimizer reads them), the next
    step's ``set_to_none`` frees them."""

    def step():
        model.zero_grad(set_to_none=True)
        with autocast_context(device, precision):
            loss = model(text, image).loss
        loss.backward()
        sync(device)

    return step


def timed_median(fn, *, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def memcalc_gb(preset: str, *, batch: int, reversible: bool) -> dict[str, float]:
    common = {"optimizer": "8bit", "offload": True, "reversible": reversible, "batch_size": batch}
    return {p: estimate(f"crowdtrain-{preset}", precision=p, **common).gpu_total / GIB for p in ("mixed", "fp32")}


def train_rows(args, device, flops_model) -> list[dict]:
    rows = []
    reference = "fp32" if args.precision == "fp32" else "mixed"  # the memcalc figure vs_memcalc compares with
    for reversible in (True, False):
        config = get_preset(args.preset, reversible=reversible, checkpointing=False)
        torch.manual_seed(0)
        model = DalleTransformer(config).to(device)
        for impl in ("efficient", "dense"):
            model.attention_impl = impl
            for batch in args.batch_sizes:
                row = {"section": "train", "reversible": reversible, "attention": impl, "batch": batch,
                       "precision": args.precision}
                oom = False
                try:
                    text, image = batch_of(config, batch, device)
                    step = make_step(model, text, image, device, args.precision)
                    seconds = timed_median(step, warmup=args.warmup, repeats=args.steps)
                    peak = peak_memory_bytes(step, device=device, track=(model,))
                except RuntimeError as e:
                    if not is_oom(e):
                        raise
                    oom = True
                if oom:  # outside the handler: the exception's frames hold the step's tensors
                    text = image = step = None
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    rows.append({**row, "oom": True})
                    progress(rows[-1])
                    break  # larger batches do not fit either
                samples_per_s = batch / seconds
                achieved = samples_per_s * config.seq_len * flops_model / 1e12
                calc = memcalc_gb(args.preset, batch=batch, reversible=reversible)
                rows.append({**row, "oom": False, "step_s": seconds, "samples_per_s": samples_per_s,
                             "model_tflops": achieved, "mfu": achieved / args.peak_tflops if args.peak_tflops else None,
                             "peak_gb": peak / GIB, "memcalc_gb": calc, "vs_memcalc_of": reference,
                             "vs_memcalc": peak / GIB / calc[reference] - 1})
                progress(rows[-1])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sampling_row(args, device) -> dict:
    config = get_preset(args.preset)
    torch.manual_seed(0)
    model = DalleTransformer(config).to(device).eval()
    text = batch_of(config, 1, device)[0].expand(args.samples, -1)

    def sample():
        with autocast_context(device, args.precision):
            generate_images(model, text, seed=0)
        sync(device)

    seconds = timed_median(sample, warmup=min(1, args.warmup), repeats=1)  # one run of the paper's: ~10 s
    return {"section": "sampling", "samples": args.samples, "kv_cache": True, "precision": args.precision,
            "seconds": seconds, "samples_per_s": args.samples / seconds}


def offload_row(args, device, batch: int) -> dict:
    """The offloaded 8-bit LAMB step (crowdtrain.swarm.lamb.ClippedLAMB8bit on host copies
    of the parameters, as hivemind's offload_optimizer keeps them), alone and beside a training
    step of ``batch`` (the largest that fit): a small batch's step is too short to hide it."""
    from crowdtrain.runspec.swarm import SwarmConfig
    from crowdtrain.swarm.lamb import make_lamb

    config = get_preset(args.preset)
    torch.manual_seed(0)
    model = DalleTransformer(config).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    host = [p.detach().to("cpu", torch.float32, copy=True) for p in params]
    for h in host:
        h.grad = torch.zeros_like(h)
    optimizer = make_lamb(host, SwarmConfig())
    step = make_step(model, *batch_of(config, batch, device), device, args.precision)
    step()  # gradients to offload

    def to_host():  # hivemind copies the gradients before it starts the delayed step
        with torch.no_grad():
            for p, h in zip(params, host):
                h.grad.copy_(p.grad)

    def to_device():  # the new weights reach the model at the next step's start
        with torch.no_grad():
            for p, h in zip(params, host):
                p.copy_(h, non_blocking=True)
        sync(device)

    def offloaded_step():
        to_host()
        optimizer.step()
        to_device()

    step_s = timed_median(step, warmup=args.warmup, repeats=args.steps)
    optimizer_s = timed_median(offloaded_step, warmup=min(1, args.warmup), repeats=args.steps)

    def overlapped():
        to_host()
        worker = threading.Thread(target=optimizer.step)
        worker.start()
        step()
        worker.join()
        to_device()

    both_s = timed_median(overlapped, warmup=min(1, args.warmup), repeats=args.steps)
    return {"section": "offload", "batch": batch, "params": sum(p.numel() for p in params), "step_s": step_s,
            "optimizer_s": optimizer_s, "overlapped_s": both_s, "hidden": both_s <= 1.1 * step_s}


def profile_step(args, device, batch: int) -> dict:
    """torch.profiler over one reversible training step at ``batch``: where the time goes (the
    ops by their own CPU time and by their GPU time, and how many kernels one step launches). A
    step whose CPU time exceeds its GPU time is launch-bound: fewer, larger kernels (fusing the
    elementwise ops, a larger batch) help more than faster matmuls."""
    from torch.profiler import ProfilerActivity, profile

    config = get_preset(args.preset, reversible=True, checkpointing=False)
    torch.manual_seed(0)
    model = DalleTransformer(config).to(device)
    step = make_step(model, *batch_of(config, batch, device), device, args.precision)
    for _ in range(max(1, args.warmup)):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    cpu_us = sum(e.self_cpu_time_total for e in events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx"))
    tables = {key: events.table(sort_by=key, row_limit=25, max_name_column_width=60)
              for key in ("self_cpu_time_total",) + (("self_device_time_total",) if gpu_us else ())}
    return {"section": "profile", "batch": batch, "reversible": True, "precision": args.precision,
            "cpu_s": cpu_us / 1e6, "gpu_s": gpu_us / 1e6, "kernel_launches": launches,
            "launch_bound": bool(gpu_us) and cpu_us > gpu_us, "tables": tables}


def progress(row: dict) -> None:
    """One line per measured row as it comes: the paper preset's whole table takes minutes, and a
    run cut short (a lent GPU's time is short) still shows what it measured."""
    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items() if not isinstance(v, dict)), flush=True)


def table(rows: list[dict]) -> str:
    lines = [f"{'reversible':>10} {'attention':>9} {'batch':>5} {'samples/s':>10} {'MFU':>6} {'peak GiB':>9} "
             f"{'memcalc mixed..fp32':>20} {'vs memcalc':>10}"]
    for r in rows:
        if r["section"] != "train":
            continue
        head = f"{str(r['reversible']):>10} {r['attention']:>9} {r['batch']:>5}"
        if r["oom"]:
            lines.append(f"{head} {'out of memory':>10}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "     -"
        calc = f"{r['memcalc_gb']['mixed']:.3f}..{r['memcalc_gb']['fp32']:.3f}"
        lines.append(f"{head} {r['samples_per_s']:10.2f} {mfu} {r['peak_gb']:9.3f} {calc:>20} "
                     f"{100 * r['vs_memcalc']:+9.1f}%")
    for r in rows:
        if r["section"] == "sampling":
            lines.append(f"sampling {r['samples']} of one prompt (KV cache): {r['samples_per_s']:.2f} samples/s "
                         f"({r['seconds']:.1f} s)")
        if r["section"] == "offload":
            lines.append(f"offloaded 8-bit LAMB ({r['params']:,} parameters): {r['optimizer_s']:.3f} s alone; "
                         f"training step {r['step_s']:.3f} s, both together {r['overlapped_s']:.3f} s: "
                         f"{'hidden' if r['hidden'] else 'NOT hidden'}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="paper", help="model preset: tiny, demo or paper")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, help="bf16 (GPU default), fp16 or fp32 (CPU default)")
    parser.add_argument("--batch-sizes", default="2,8,32",
                        help="comma-separated; each reversible/attention setting stops at its first out-of-memory")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting (the median is kept)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=128, help="samples of one prompt for the sampling figure")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak for MFU (default: from the GPU's name, H100/H200/A100...)")
    parser.add_argument("--profile", type=int, default=None, metavar="BATCH",
                        help="instead of the figures: torch.profiler over one reversible step at this batch")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_gpu_<device>.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device; use --device cpu with a small --preset")
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    name = device_name(device)
    args.peak_tflops = args.peak_tflops or peak_tflops(name, args.precision)
    info = model_info(get_preset(args.preset))
    flops_model = 3 * info["flops_per_token"]["forward"]

    if args.profile:
        row = profile_step(args, device, args.profile)
        for table_text in row["tables"].values():
            print(table_text)
        progress(row)
        out = Path(args.out) if args.out else RESULTS / f"bench_gpu_profile_{device.type}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": name, "preset": args.preset, "torch": torch.__version__,
                                   "rows": [row]}, indent=2))
        print(f"wrote {out}")
        return row
    print(f"{args.preset} on {name}, {args.precision}: one line per measurement", flush=True)
    rows = train_rows(args, device, flops_model)
    rows.append(sampling_row(args, device))
    progress(rows[-1])
    fitted = [r["batch"] for r in rows if r["section"] == "train" and r["reversible"] and not r["oom"]]
    rows.append(offload_row(args, device, max(fitted, default=args.batch_sizes[0])))
    progress(rows[-1])
    result = {"device": name, "device_type": device.type, "torch": torch.__version__,
              "cuda": torch.version.cuda, "preset": args.preset, "precision": args.precision,
              "seq_len": get_preset(args.preset).seq_len, "model_flops_per_token": flops_model,
              "peak_tflops": args.peak_tflops, "unix_time": time.time(), "rows": rows}
    print(f"{args.preset} on {name}, {args.precision}; peak {args.peak_tflops} TFLOP/s")
    print(table(rows))
    out = Path(args.out) if args.out else RESULTS / f"bench_gpu_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
