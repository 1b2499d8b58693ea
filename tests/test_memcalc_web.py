"""The calculator page served standalone: start it on a free port, use the JSON API over HTTP."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "crowdtrain.cli", "memcalc", "--serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}/memcalc"
    try:
        for _ in range(100):
            try:
                if httpx.get(base + "/api/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("server did not start: " + proc.stderr.read1().decode())
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_api_and_page(server):
    models = httpx.get(server + "/api/models", timeout=5).json()
    assert {"gpt2-large", "t5-11b", "crowdtrain-paper"} <= {m["name"] for m in models}
    plain = httpx.get(server + "/api/estimate", params={"model": "gpt2-large"}, timeout=5).json()
    saving = httpx.get(server + "/api/estimate", params={"model": "gpt2-large", "optimizer": "8bit", "offload": "true",
                                                        "checkpointing": "true"}, timeout=5).json()
    assert saving["gpu_total_gb"] < plain["gpu_total_gb"] / 2
    assert saving["cpu_gb"]["optimizer_states"] > 0
    bad = httpx.get(server + "/api/estimate", params={"model": "nope"}, timeout=5)
    assert bad.status_code == 422 and "unknown model" in bad.json()["detail"]
    page = httpx.get(server + "/", timeout=5).text
    assert "plotly.min.js" in page and "/api/estimate" in page
    js = httpx.get(server + "/plotly.min.js", timeout=5)
    assert js.status_code == 200 and len(js.content) > 1_000_000
