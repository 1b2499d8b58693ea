"""The coordinator's web pages: home, dashboard, leaderboard, peers, checkpoints, samples, join, guide.

Every page is rendered on the server from the run's database (``Store``) and the files the
auxiliary peer writes in the run folder (``run.json``, ``status.json``), so every page works
without JavaScript. The one exception is the dashboard's live refresh: ``static/dashboard.js``
polls ``/api/status`` and ``/api/history`` every 5 s and redraws its charts with ``Plotly.react``.
plotly.js is served from the ``plotly`` Python package at ``/static/plotly.min.js``; nothing is
loaded from a CDN, so the pages work on a network without the Internet.

User names, prompts and peer IDs come from volunteers: templates are autoescaped, and the
dashboard's embedded data goes through Jinja's ``tojson`` (which escapes ``<``, ``>`` and ``&``).
No torch here, as in the rest of ``coordinator/``.
"""

from __future__ import annotations

import shlex
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import jinja2
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

from crowdtrain.coordinator.db import Store
from crowdtrain.coordinator.status import CHECKPOINT_FILES, run_status
from crowdtrain.data.sample_prompts import load_run_prompts
from crowdtrain.runspec.files import read_run_info

HERE = Path(__file__).resolve().parent
GUIDE_NAME = "organize-a-run.md"
# The guide lives in the repository's docs/ (read on GitHub) and ships in the package through a
# symlink in coordinator/docs/ (wheels store the file itself); look in both, package first.
GUIDE_PATHS = (HERE / "docs" / GUIDE_NAME, HERE.parents[1] / "docs" / GUIDE_NAME)
HISTORY_POINTS = 1500  # the dashboard's charts start with the whole run, averaged down to this many points
REFRESH_MS = 5000
# Download links, most wanted first; the service serves exactly CHECKPOINT_FILES.
FILE_ORDER = ("model.safetensors", "config.json", "optimizer.safetensors", "text_tokenizer.json",
              "image_tokenizer.safetensors")
assert set(FILE_ORDER) == CHECKPOINT_FILES
NAV = (("/", "Home"), ("/dashboard", "Dashboard"), ("/leaderboard", "Leaderboard"), ("/peers", "Peers"),
       ("/checkpoints", "Checkpoints"), ("/samples", "Samples"), ("/join", "Join"), ("/organize", "Organize"),
       ("/memcalc/", "Memory calculator"), ("/docs", "API"))


def join_command(public_url: str, auth_mode: str, pin: str | None = None) -> str:
    """The one command a volunteer runs (``YOUR_KEY``/``YOUR_NAME`` are placeholders they fill in).
    ``pin``: the coordinator key's fingerprint (crowdtrain.runspec.trust), so that the command
    refuses any other coordinator at that address."""
    line = f"crowdtrain join {public_url}" + (f" --pin {pin}" if pin else "")
    return line + (" --key YOUR_KEY" if auth_mode == "allowlist" else " --user YOUR_NAME")


# ---- formatting, as Jinja filters ------------------------------------------------------------------
def fmt_duration(seconds: float | None) -> str:
    """``3 d 4 h``, ``2 h 05 min``, ``4 min 09 s``, ``12 s``; an em dash when unknown."""
    if seconds is None:
        return "\u2014"
    s = int(round(max(seconds, 0.0)))
    days, rest = divmod(s, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def _datetime(ts: float | None) -> datetime | None:
    """None for a missing time or one no calendar holds (a stored value from a broken or hostile peer)."""
    try:
        return None if ts is None else datetime.fromtimestamp(ts, timezone.utc)
    except (OverflowError, OSError, ValueError, TypeError):
        return None


def fmt_ago(ts: float | None, now: float | None = None) -> str:
    if _datetime(ts) is None:
        return "never"
    return fmt_duration((now or time.time()) - ts) + " ago"


def fmt_utc(ts: float | None) -> str:
    when = _datetime(ts)
    return "\u2014" if when is None else when.strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_iso(ts: float | None) -> str:
    when = _datetime(ts)
    return "" if when is None else when.isoformat(timespec="seconds")


def fmt_loss(value: float | None) -> str:
    return "\u2014" if value is None else f"{value:.4f}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def downsample(points: list[dict], max_points: int) -> list[dict]:
    """Average consecutive points in groups so at most ``max_points`` remain (the last one is kept
    as it is, so the chart ends at the current value). A day of 2-second samples is 43,200 points;
    a browser draws a few thousand smoothly. Points taken at a checkpoint (with a ``valid_loss``)
    are kept as they are, between the averaged ones: there is one per checkpoint, and averaging
    would lose the validation losses."""
    if len(points) <= max_points:
        return points
    marked = [p for p in points[:-1] if p.get("valid_loss")]
    head, last = [p for p in points[:-1] if not p.get("valid_loss")], points[-1]
    size = -(-len(head) // max(max_points - 1 - len(marked), 1))  # ceil: groups of this many points
    out = []
    for i in range(0, len(head), size):
        group = head[i:i + size]
        losses = [p["loss"] for p in group if p["loss"] is not None]
        out.append({"time": sum(p["time"] for p in group) / len(group), "epoch": group[-1]["epoch"],
                    "loss": sum(losses) / len(losses) if losses else None,
                    "active_peers": round(sum(p["active_peers"] for p in group) / len(group), 2),
                    "samples_per_second": sum(p["samples_per_second"] for p in group) / len(group),
                    "valid_loss": None})
    return sorted(out + marked, key=lambda p: p["time"]) + [last]


# The auxiliary peer records a point every ~2 s while it runs; a longer silence is downtime (the
# coordinator was stopped), and a line drawn across it would show values nobody measured.
GAP_S = 30.0


class DrawnHistory:
    """The run's history as the dashboard page embeds it (``downsample`` then ``mark_gaps``),
    computed again only when the auxiliary peer has added a point since. Reading a day of points
    costs about 200 ms (25 ms for 5,000); points come every 2 s while 200 viewers open the page
    several times a second, so most openings cost one indexed probe for a newer point."""

    def __init__(self, store: Store, max_points: int = HISTORY_POINTS):
        self.store = store
        self.max_points = max_points
        self._lock = threading.Lock()
        self._newest: float | None = None  # the newest point's time when ``_drawn`` was made
        self._drawn: list[dict] = []

    def read(self) -> list[dict]:
        with self._lock:
            if self._newest is not None and not self.store.swarm_history(since=self._newest, limit=1):
                return self._drawn
            points = self.store.swarm_history(limit=100_000)
            self._drawn = mark_gaps(downsample(points, self.max_points))
            self._newest = points[-1]["time"] if points else None
            return self._drawn


def mark_gaps(points: list[dict], *, gap_s: float = GAP_S, before: dict | None = None) -> list[dict]:
    """``points`` with a marker (``gap``, every value None: charts break their lines there) wherever
    two consecutive points, or ``before`` and the first, are more than ``gap_s`` apart; ``gap_s`` is
    raised to three typical spacings when points are sparser (downsampled history)."""
    if len(points) >= 3:
        spacing = sorted(b["time"] - a["time"] for a, b in zip(points, points[1:]))[len(points) // 2 - 1]
        gap_s = max(gap_s, 3 * spacing)
    out, prev = [], before
    for p in points:
        if prev is not None and p["time"] - prev["time"] > gap_s:
            out.append({"time": (p["time"] + prev["time"]) / 2, "epoch": None, "loss": None, "active_peers": None,
                        "samples_per_second": None, "valid_loss": None, "gap": True})
        out.append(p)
        prev = p
    return out


def _templates() -> Jinja2Templates:
    # Lenient undefined: a field missing from run.json (an older aux peer) renders blank, never a 500.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True,
                             undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(duration=fmt_duration, ago=fmt_ago, utc=fmt_utc, iso=fmt_iso, loss=fmt_loss,
                       filesize=fmt_bytes)
    return Jinja2Templates(env=env)


def _plotly_js() -> Path:
    from crowdtrain.memcalc.web import _plotly_js as path

    return path()


def _guide_html() -> str | None:
    from markdown_it import MarkdownIt

    for path in GUIDE_PATHS:
        if path.is_file():
            # Raw HTML in the markdown is escaped, not passed through: the page shows text only.
            return MarkdownIt("commonmark", {"html": False}).enable("table").render(path.read_text())
    return None


def _shapes_prompts(run_prompts: list | None, items: list[dict]) -> bool:
    """Whether the samples are of the bundled shapes data's evaluation prompts (whose seen and
    held-out tags mean colour-shape pairs): the run's prompts are those, or, for a run folder
    without its prompts file, every sample's prompt is one of them."""
    from crowdtrain.data.sample_prompts import shapes_prompts

    known = {p["prompt"] for p in shapes_prompts(per_group=100)}
    prompts = [p.get("prompt") for p in run_prompts if isinstance(p, dict)] if run_prompts else \
        [s["prompt"] for s in items]
    return bool(prompts) and all(p in known for p in prompts)


def create_router(*, run_dir: Path, store: Store, public_url: str, auth_mode: str,
                  checkpoint_dir: Path | None = None, install: str = "", pin: str | None = None) -> APIRouter:
    """``install``: the line that installs this coordinator's crowdtrain (crowdtrain.release);
    ``pin``: its key's fingerprint, which the join command carries."""
    run_dir = Path(run_dir)
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else run_dir / "checkpoints"
    templates = _templates()
    router = APIRouter(include_in_schema=False)
    drawn_history = DrawnHistory(store)
    static = {"app.css": (HERE / "static" / "app.css", "text/css"),
              "dashboard.js": (HERE / "static" / "dashboard.js", "application/javascript"),
              "favicon.svg": (HERE / "static" / "favicon.svg", "image/svg+xml")}

    def render(request: Request, template: str, page: str, **context) -> HTMLResponse:
        run_info, _ = read_run_info(run_dir)  # a problem with it shows in the status
        info = run_info.to_dict() if run_info is not None else {}
        status = run_status(run_dir, store)
        total = status["total_epochs"]
        base = {"nav": NAV, "page": page, "public_url": public_url, "auth_mode": auth_mode,
                "join_command": join_command(public_url, auth_mode, pin), "install_command": install, "pin": pin,
                "run_id": info.get("run_id"),
                "info": info, "model": info.get("task", {}).get("model", {}), "status": status, "now": time.time(),
                "progress": min(status["epoch"] / total, 1.0) if total else 0.0}
        return templates.TemplateResponse(request, template, {**base, **context})

    @router.get("/", response_class=HTMLResponse)
    def home(request: Request):
        return render(request, "home.html", "/", leaders=store.leaderboard()[:5], checkpoints=store.checkpoints()[-1:])

    @router.get("/dashboard", response_class=HTMLResponse)
    def dashboard(request: Request):
        history = drawn_history.read()
        evaluated = [c for c in store.checkpoints(include_pruned=True) if c["valid_loss"]]
        return render(request, "dashboard.html", "/dashboard", history=history, refresh_ms=REFRESH_MS,
                      evaluated=evaluated[-10:][::-1],
                      valid_splits=sorted({k for c in evaluated for k in c["valid_loss"]},
                                          key=lambda k: (k != "valid", k)))

    @router.get("/leaderboard", response_class=HTMLResponse)
    def leaderboard(request: Request):
        return render(request, "leaderboard.html", "/leaderboard", board=store.leaderboard())

    @router.get("/peers", response_class=HTMLResponse)
    def peers(request: Request, show_all: bool = Query(False, alias="all")):
        everyone = store.peers()
        shown = everyone if show_all else [p for p in everyone if p["active"]]
        return render(request, "peers.html", "/peers", peers=shown, show_all=show_all, seen=len(everyone))

    @router.get("/checkpoints", response_class=HTMLResponse)
    def checkpoints(request: Request):
        rows = []
        for ckpt in reversed(store.checkpoints()):  # newest first
            folder = checkpoint_dir / ckpt["name"]
            files = [{"name": f, "size": (folder / f).stat().st_size if (folder / f).is_file() else None}
                     for f in FILE_ORDER if f in ckpt["files"]]
            rows.append({**ckpt, "downloads": files})
        prompts = load_run_prompts(run_dir) or []
        example = prompts[0]["prompt"] if prompts and isinstance(prompts[0], dict) else None
        splits = sorted({k for c in rows for k in (c["valid_loss"] or {})}, key=lambda k: (k != "valid", k))
        return render(request, "checkpoints.html", "/checkpoints", checkpoints=rows, valid_splits=splits,
                      example_prompt=shlex.quote(str(example or "YOUR PROMPT")))  # captions are strangers' text

    @router.get("/samples", response_class=HTMLResponse)
    def samples(request: Request):
        groups: dict[str, dict] = {}
        for s in store.samples(limit=240):  # newest checkpoint first
            group = groups.setdefault(s["checkpoint"], {"checkpoint": s["checkpoint"], "epoch": s["epoch"],
                                                        "time": s["time"], "items": [], "complete": True})
            group["items"].append({**s, "url": f"/files/{s['path']}"})
            group["complete"] &= (run_dir / s["path"]).is_file()
        # A checkpoint shows once every one of its images exists (not while they are being drawn,
        # nor after its folder was removed).
        shown = [g for g in groups.values() if g["complete"]][:6]
        items = [s for g in shown for s in g["items"]]
        return render(request, "samples.html", "/samples", groups=shown,
                      composition_tags=any(s["tag"] in ("seen", "held-out") for s in items),
                      shapes_prompts=_shapes_prompts(load_run_prompts(run_dir), items),
                      with_reference=any(s["reference"] for s in items))

    @router.get("/join", response_class=HTMLResponse)
    def join(request: Request):
        return render(request, "join.html", "/join")

    @router.get("/organize", response_class=HTMLResponse)
    def organize(request: Request):
        html = _guide_html()
        if html is None:
            raise HTTPException(404, f"the organizer's guide ({GUIDE_NAME}) is not installed with this copy")
        return render(request, "organize.html", "/organize", guide=html)

    @router.get("/favicon.ico")  # browsers ask for it whatever the page says
    def favicon():
        return static_file("favicon.svg")

    @router.get("/static/{name}")
    def static_file(name: str):
        if name == "plotly.min.js":  # 4.6 MB that never changes within a plotly version: cache it
            return FileResponse(_plotly_js(), media_type="application/javascript",
                                headers={"Cache-Control": "public, max-age=86400"})
        if name not in static:
            raise HTTPException(404, f"no static file {name!r}")
        path, media_type = static[name]
        return FileResponse(path, media_type=media_type, headers={"Cache-Control": "no-cache"})

    return router
