"""Data benchmarks: bytes streamed per sample, and loader throughput (local vs HTTP).

1. Bytes per sample: the shard's compressed image codes (brotli parquet, as streamed) against
   the source images stored as PNG and as JPEG at quality 90, measured in the same run:
   - shapes: 64x64 images, codes from the shipped 8x8 tokenizer;
   - natural-like 256x256: no photographs can be downloaded here, so these are synthetic
     images with the falling spectrum of natural photos (amplitude ~ 1/f^1.3..1.6, coloured). No
     trained f=8 VQGAN is available offline either, so their 32x32 codes are drawn uniformly
     from 8192: the worst case for compression (13 bits per code), hence an UPPER bound on the
     code bytes and a LOWER bound on the saving. Real VQGAN codes compress better.
   The paper reports about 18x less bandwidth than images.
2. Loader throughput: samples/s of ``batch_stream`` over demo shards read from the local disk
   and from a local HTTP server with Range requests (``serve_directory``).

Run: ``python benchmarks/bench_data.py [--quick]``; writes benchmarks/results/bench_data.json.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _png_jpeg_bytes(images: np.ndarray) -> tuple[float, float]:
    from PIL import Image

    png = jpg = 0
    for im in images:
        for fmt, kw in (("PNG", {"optimize": True}), ("JPEG", {"quality": 90})):
            buf = io.BytesIO()
            Image.fromarray(im).save(buf, format=fmt, **kw)
            if fmt == "PNG":
                png += buf.tell()
            else:
                jpg += buf.tell()
    return png / len(images), jpg / len(images)


def _code_bytes(codes: np.ndarray) -> float:
    """Per-sample size of the code column in a brotli parquet shard (the bytes a peer streams)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crowdtrain.data.shards import codes_to_bytes

    blobs = [codes_to_bytes(c) for c in codes]
    table = pa.table({"code": pa.array(blobs, type=pa.binary())})
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "codes.parquet"
        pq.write_table(table, path, compression="brotli", row_group_size=1024, use_dictionary=False,
                       write_statistics=False)
        meta = pq.ParquetFile(path).metadata
        column = sum(meta.row_group(i).column(0).total_compressed_size for i in range(meta.num_row_groups))
    return column / len(codes)


def natural_like_images(num: int, size: int = 256, seed: int = 0) -> np.ndarray:
    """Synthetic images with a natural-image-like spectrum (amplitude ~ 1/f^1.3..1.6), channels correlated."""
    rng = np.random.default_rng(seed)
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    f = np.sqrt(fx ** 2 + fy ** 2)
    f[0, 0] = 1.0
    out = []
    for _ in range(num):
        base = rng.normal(size=(size, size // 2 + 1)) + 1j * rng.normal(size=(size, size // 2 + 1))
        channels = []
        for _ in range(3):
            noise = 0.7 * base + 0.3 * (rng.normal(size=base.shape) + 1j * rng.normal(size=base.shape))
            img = np.fft.irfft2(noise / f ** rng.uniform(1.3, 1.6), s=(size, size))
            channels.append((img - img.mean()) / (img.std() + 1e-8))
        img = np.stack(channels, -1) * rng.uniform(35, 55) + rng.uniform(70, 180, size=3)
        out.append(np.clip(img, 0, 255).astype(np.uint8))
    return np.stack(out)


def bench_bytes(num_shapes: int, num_natural: int) -> list[dict]:
    from crowdtrain.data import shapes
    from crowdtrain.data.tokenizers import default_image_tokenizer

    rows = []
    tok = default_image_tokenizer()
    images = np.stack([im for im, _, _ in shapes.generate_samples(num_shapes, seed=123)])
    codes = np.concatenate([tok.encode(images[i: i + 256]).numpy() for i in range(0, len(images), 256)])
    png, jpg = _png_jpeg_bytes(images)
    rows.append({"data": "shapes 64x64", "codes": "shipped VQ 8x8 of 512", "raw_code_bytes": codes[0].size * 2,
                 "code_bytes": _code_bytes(codes), "png_bytes": png, "jpeg90_bytes": jpg})
    natural = natural_like_images(num_natural)
    uniform = np.random.default_rng(0).integers(0, 8192, size=(num_natural, 32, 32))
    png, jpg = _png_jpeg_bytes(natural)
    rows.append({"data": "natural-like 256x256", "codes": "32x32 uniform of 8192 (worst case)",
                 "raw_code_bytes": 32 * 32 * 2, "code_bytes": _code_bytes(uniform), "png_bytes": png,
                 "jpeg90_bytes": jpg})
    for r in rows:
        r["png_over_codes"] = r["png_bytes"] / r["code_bytes"]
        r["jpeg90_over_codes"] = r["jpeg90_bytes"] / r["code_bytes"]
    return rows


def bench_loader(num_train: int, batches: int, batch_size: int) -> list[dict]:
    from crowdtrain.data import batch_stream, default_text_tokenizer, ensure_demo_shards, serve_directory
    from crowdtrain.model.config import get_preset

    config = get_preset("demo")
    tok = default_text_tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        folder = ensure_demo_shards(Path(d) / "shards", num_train=num_train)
        server = serve_directory(folder)
        try:
            for name, source in (("local folder", str(folder)), ("HTTP (local server, Range)", server.url)):
                stream = batch_stream(source, text_tokenizer=tok, model_config=config, batch_size=batch_size,
                                      seed_key="bench")
                next(stream)  # start-up (listing, first row groups) is not throughput
                t0 = time.perf_counter()
                for _ in range(batches):
                    next(stream)
                dt = time.perf_counter() - t0
                rows.append({"source": name, "samples_per_s": batches * batch_size / dt, "batch_size": batch_size,
                             "samples": batches * batch_size, "epochs_done": stream.epoch})
        finally:
            server.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_data.json"))
    args = parser.parse_args(argv)
    n_shapes, n_natural, n_train, n_batches = (200, 8, 500, 20) if args.quick else (2000, 64, 4000, 200)
    byte_rows = bench_bytes(n_shapes, n_natural)
    print(f"{'data':22s} {'codes':36s} {'codes B':>8s} {'PNG B':>8s} {'JPEG90 B':>9s} {'PNG/codes':>9s} {'JPEG/codes':>10s}")
    for r in byte_rows:
        print(f"{r['data']:22s} {r['codes']:36s} {r['code_bytes']:8.1f} {r['png_bytes']:8.1f} {r['jpeg90_bytes']:9.1f} "
              f"{r['png_over_codes']:9.1f} {r['jpeg90_over_codes']:10.1f}")
    loader_rows = bench_loader(n_train, n_batches, 64)
    print(f"\n{'loader source':28s} {'samples/s':>10s}")
    for r in loader_rows:
        print(f"{r['source']:28s} {r['samples_per_s']:10.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bytes_per_sample": byte_rows, "loader": loader_rows, "quick": args.quick}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
