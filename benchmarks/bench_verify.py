"""What verification costs a volunteer: the signed join information, and a shard fetched whole
and hashed (what `crowdtrain join` does with a coordinator's shards) against the same shard read
by byte ranges unchecked (what it did before), from a real HTTP server on this machine.

    python benchmarks/bench_verify.py [--repeats 5] [--out benchmarks/results/verify.json]

Prints a table (median and spread over the repeats) and writes JSON; the ratio is verified /
unverified on the same shard in the same session.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _serve(folder: Path):
    class Ranged(http.server.BaseHTTPRequestHandler):
        """Whole files and byte ranges, as the coordinator serves shards (pyarrow seeks)."""

        def do_HEAD(self):
            self.do_GET(body=False)

        def do_GET(self, body=True):
            data = (folder / self.path.lstrip("/")).read_bytes()
            start, end = 0, len(data) - 1
            ranged = self.headers.get("Range", "").startswith("bytes=")
            if ranged:
                first, _, last = self.headers["Range"][6:].partition("-")
                start, end = int(first), min(int(last) if last else end, end)
            self.send_response(206 if ranged else 200)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            if body:
                self.wfile.write(data[start:end + 1])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ranged)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _read_rows(f) -> int:
    import pyarrow.parquet as pq

    return sum(b.num_rows for b in pq.ParquetFile(f).iter_batches(columns=["caption", "code"], batch_size=512))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=10_000,
                        help="rows of the shard, each with a 32x32 grid of codes (the paper's), as a LAION shard")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify.json"))
    args = parser.parse_args()

    import numpy as np

    from crowdtrain.data.shards import codes_to_bytes, write_shard
    from crowdtrain.data.streaming import fetch_verified, open_shard
    from crowdtrain.runspec.tokens import CoordinatorKey
    from crowdtrain.runspec.trust import CoordinatorTrust, fingerprint, sign_answer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = tmp / "shards"
        shards.mkdir()
        rng = np.random.default_rng(0)
        shard = shards / "train-00000.parquet"
        write_shard(shard, {"caption": [f"a picture number {i} of a thing" for i in range(args.rows)],
                            "code": [codes_to_bytes(rng.integers(0, 8192, 1024)) for _ in range(args.rows)],
                            "original_width": [256] * args.rows, "original_height": [256] * args.rows,
                            "NSFW": ["UNLIKELY"] * args.rows, "url": [""] * args.rows})
        shard_bytes = shard.stat().st_size
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        server = _serve(shards)
        url = f"http://127.0.0.1:{server.server_address[1]}/{shard.name}"
        key = CoordinatorKey.load_or_create(tmp / "key.pem")
        body = json.dumps({"initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/Qm" + "x" * 44] * 4,
                           "files": {f"shards/train-{i:05d}.parquet": "0" * 64 for i in range(1000)}}).encode()
        headers = sign_answer(key, body)
        times = {"unverified": [], "verified": [], "join_info_signature": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            with open_shard(url, timeout_s=60) as f:
                rows = _read_rows(f)
            times["unverified"].append(time.perf_counter() - start)
            start = time.perf_counter()
            with fetch_verified(url, digest, timeout_s=60) as f:
                assert _read_rows(f) == rows
            times["verified"].append(time.perf_counter() - start)
            start = time.perf_counter()
            CoordinatorTrust("https://bench", pin=fingerprint(key.public_key)).check(body, headers, "bench")
            times["join_info_signature"].append(time.perf_counter() - start)
        server.shutdown()
    result = {"shard_bytes": shard_bytes, "rows": rows, "repeats": args.repeats,
              "seconds": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()},
              "ratio_verified_over_unverified": statistics.median(times["verified"]) / statistics.median(
                  times["unverified"])}
    print(f"shard {result['shard_bytes'] / 2**20:.2f} MiB, {rows} rows, {args.repeats} repeats")
    print(f"{'':28}{'median s':>10}{'min':>10}{'max':>10}")
    for name, s in result["seconds"].items():
        print(f"{name:28}{s['median']:10.4f}{s['min']:10.4f}{s['max']:10.4f}")
    print(f"verified / unverified shard read: {result['ratio_verified_over_unverified']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
