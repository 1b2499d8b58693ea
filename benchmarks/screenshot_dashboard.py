"""The dashboard picture (docs/img/dashboard.png, shown on docs/dashboard.md) from a real run: a
coordinator and three volunteers on 127.0.0.1.

alice and bob start together, carol joins a quarter of the way in and bob leaves at two thirds
(of --minutes, counted from the first global epoch), so the charts show churn; at the end
chromium (through Playwright) loads /dashboard while the peers are still training and saves a
screenshot. Everything runs as separate processes, as in
tests/test_web_browser.py (which also needs chromium: `apt-get install -y chromium`).

    python benchmarks/screenshot_dashboard.py [--minutes 3] [--preset tiny --data pattern] \
        [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from playwright.sync_api import sync_playwright  # noqa: E402

from crowdtrain.launch import CHROMIUM, CHROMIUM_ARGS, LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def screenshot(url: str, out: Path, *, width: int = 1280, height: int = 900) -> None:
    if not Path(CHROMIUM).is_file():
        raise FileNotFoundError(f"chromium not found at {CHROMIUM}: apt-get install -y chromium "
                                "(or set CROWDTRAIN_CHROMIUM)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(f"{url}/dashboard")
        page.wait_for_function("() => { const d = document.getElementById('chart-loss').data;"
                               " return d && d[0].y.some(v => v !== null); }", timeout=60_000)
        page.wait_for_timeout(1000)  # let plotly finish its layout
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="training time before the screenshot")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--data", default="pattern")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        swarm = LocalSwarm(Path(tmp), preset=args.preset, data=args.data, samples_every=1,
                      swarm={"target_batch_size": 192, "total_epochs": 400, "warmup_epochs": 5,
                             "checkpoint_every_epochs": 10})
        try:
            swarm.start_coordinator()
            print(f"coordinator at {swarm.url}", flush=True)
            swarm.join("alice", batch_size=args.batch_size, max_epochs=10**6)
            swarm.join("bob", batch_size=args.batch_size // 2, max_epochs=10**6)
            swarm.wait_epoch(1, timeout=600)  # the clock starts when training does (start-up varies with load)
            start, total_s = time.monotonic(), args.minutes * 60
            events = [(0.25, lambda: swarm.join("carol", batch_size=args.batch_size, max_epochs=10**6,
                                                extra=["--simulated-step-s", "0.2"])),
                      (0.67, lambda: os.killpg(swarm.procs["bob"].pid, signal.SIGINT))]  # Ctrl-C: a clean leave
            while (elapsed := time.monotonic() - start) < total_s:
                while events and elapsed >= events[0][0] * total_s:
                    events.pop(0)[1]()
                try:
                    status = swarm.status()
                except OSError:  # busy for a moment; the next poll will do
                    status = {}
                print(f"{elapsed:5.0f}s epoch {status.get('epoch')} peers {status.get('active_peers')} "
                      f"loss {status.get('loss')}", flush=True)
                time.sleep(min(15, max(total_s - elapsed, 0)))
            screenshot(swarm.url, Path(args.out))
            print(f"wrote {args.out}")
            swarm.interrupt_all([n for n in ("alice", "bob", "carol") if n in swarm.procs])
        finally:
            swarm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
