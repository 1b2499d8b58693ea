"""The coordinator's HTTP service: what volunteers need, as data, plus shards and checkpoints.

Reads the files the auxiliary peer writes in the run folder (``run.json``, ``status.json``,
``metrics.jsonl``, ``checkpoints/``); never imports torch. Shards are served with HTTP Range
support (parquet readers seek). The web pages and authentication attach here later.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse

CHECKPOINT_FILES = {"config.json", "model.safetensors", "optimizer.safetensors", "text_tokenizer.json",
                    "image_tokenizer.safetensors"}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _inside(root: Path, relative: str) -> Path:
    """``root / relative`` if it stays inside root and is a file; else 404 (no path traversal)."""
    root = root.resolve()
    path = (root / relative).resolve()
    if root not in path.parents or not path.is_file():
        raise HTTPException(404, f"no such file: {relative}")
    return path


def create_app(run_dir: str | Path, *, shards_dir: str | Path | None = None,
               text_tokenizer: str | Path | None = None) -> FastAPI:
    from crowdtrain.memcalc.web import create_router as memcalc_router

    run_dir = Path(run_dir)
    app = FastAPI(title="crowdtrain coordinator",
                  description="Join information, live status, metrics, shards and checkpoints of one run.")
    app.include_router(memcalc_router("/memcalc"))  # the memory calculator page, for volunteers sizing a GPU

    def join_info() -> dict:
        info = _read_json(run_dir / "run.json")
        if info is None:
            raise HTTPException(503, "the run is starting: its first peer is not up yet; retry in a few seconds")
        return info

    @app.get("/api/join", summary="Everything a volunteer needs to join, as data")
    def api_join() -> dict:
        return join_info()

    @app.get("/api/status", summary="Current epoch, live peers and swarm throughput")
    def api_status() -> dict:
        status = _read_json(run_dir / "status.json") or {"epoch": 0, "peers": [], "samples_per_second": 0.0}
        status["run_id"] = join_info()["run_id"]
        return status

    @app.get("/api/metrics", summary="The latest metrics records of all peers, oldest first")
    def api_metrics(limit: int = 1000) -> list[dict]:
        if not 1 <= limit <= 100_000:
            raise HTTPException(422, "limit must be between 1 and 100000")
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        with open(path) as f:
            lines = deque(f, maxlen=limit)
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
        return out

    @app.get("/api/checkpoints", summary="Saved checkpoints, oldest first")
    def api_checkpoints() -> list[dict]:
        root = run_dir / "checkpoints"
        found = []
        for path in sorted(root.glob("step-*")) if root.is_dir() else []:
            meta = _read_json(path / "config.json")
            if meta is not None:
                found.append({"name": path.name, "epoch": meta["step"], "loss": meta.get("loss"),
                              "time": meta.get("time"),
                              "files": sorted(p.name for p in path.iterdir() if p.name in CHECKPOINT_FILES)})
        return found

    @app.api_route("/checkpoints/{name}/{filename}", methods=["GET", "HEAD"], summary="Download one file of a checkpoint")
    def checkpoint_file(name: str, filename: str):
        if filename not in CHECKPOINT_FILES:
            raise HTTPException(404, f"checkpoints hold only {sorted(CHECKPOINT_FILES)}")
        return FileResponse(_inside(run_dir / "checkpoints", f"{name}/{filename}"))

    if shards_dir is not None:
        shards_root = Path(shards_dir)

        # HEAD too: streaming readers ask a shard's size before reading byte ranges.
        @app.api_route("/shards/{relative:path}", methods=["GET", "HEAD"], summary="Data shards (HTTP Range supported)")
        def shard(relative: str):
            return FileResponse(_inside(shards_root, relative))

    if text_tokenizer is not None:
        tokenizer_path = Path(text_tokenizer)

        @app.get("/assets/text_tokenizer.json", summary="The run's text tokenizer")
        def tokenizer():
            return FileResponse(tokenizer_path)

    @app.get("/", response_class=HTMLResponse, summary="A short page: the run and how to join")
    def home() -> str:
        info = _read_json(run_dir / "run.json") or {}
        status = _read_json(run_dir / "status.json") or {}
        run_id = info.get("run_id", "(starting)")
        return (f"<!doctype html><title>crowdtrain: {run_id}</title><h1>crowdtrain run {run_id}</h1>"
                f"<p>Global epoch {status.get('epoch', 0)}, {len(status.get('peers', []))} active peers.</p>"
                "<p>Join with <code>crowdtrain join URL-OF-THIS-PAGE</code>. "
                "JSON: <a href='/api/status'>status</a>, <a href='/api/metrics'>metrics</a>, "
                "<a href='/api/checkpoints'>checkpoints</a>, <a href='/docs'>API docs</a>. "
                "Will it fit your GPU? <a href='/memcalc'>Memory calculator</a>.</p>")

    return app
