"""The calculator as a web page: a FastAPI router the coordinator mounts, or a standalone app.

``GET /memcalc/`` is a server-rendered form that re-estimates as options change and draws a
stacked bar chart (plotly.js served from the ``plotly`` Python package, no CDN);
``GET /memcalc/api/models`` and ``GET /memcalc/api/estimate?model=...&optimizer=...`` are the
JSON API it calls. No torch here: the coordinator's process must not import it.
"""

from __future__ import annotations

import math
from pathlib import Path

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

from crowdtrain.memcalc.architectures import get_architecture, names
from crowdtrain.memcalc.estimate import GPU_SIZES_GB, OPTIMIZERS, PRECISIONS, Options, estimate

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))


def _plotly_js() -> Path:
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.exists():
        raise FileNotFoundError(f"plotly.min.js not found at {path}; reinstall the `plotly` package")
    return path


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


DEFAULTS = {"model": "gpt2-large", "optimizer": "fp32", "precision": "fp32", "offload": False, "checkpointing": False,
            "reversible": False, "shared_groups": None, "batch_size": 1}


def create_router(prefix: str = "/memcalc", nav: tuple[tuple[str, str], ...] = (), *, site: bool = False,
                  run: dict | None = None) -> APIRouter:
    """``nav``: (href, label) links shown above the calculator, e.g. back to a run's pages;
    ``site``: in the coordinator's style (its stylesheet and top bar); ``run``: ``{"defaults":
    {field: value}, "note": str}``, the settings the page opens on (a run's model and optimizer)."""
    router = APIRouter(prefix=prefix)
    defaults = {**DEFAULTS, **((run or {}).get("defaults") or {})}

    @router.get("/", response_class=HTMLResponse)
    def page(request: Request):
        return TEMPLATES.TemplateResponse(request, "memcalc.html", {
            "models": names(), "optimizers": OPTIMIZERS, "precisions": PRECISIONS, "gpus": GPU_SIZES_GB,
            "prefix": prefix, "defaults": defaults, "nav": nav, "site": site, "page": f"{prefix}/",
            "run_note": (run or {}).get("note")})

    @router.get("/plotly.min.js")
    def plotly_js():
        return FileResponse(_plotly_js(), media_type="application/javascript")

    @router.get("/api/models")
    def models():
        out = []
        for name in names():
            arch = get_architecture(name)
            out.append({"name": name, "title": arch.title, "params": arch.params().numel, "layers": arch.layers,
                        "seq_len": arch.seq_len, "fixed_seq_len": arch.fixed_seq_len, "note": arch.note})
        return out

    @router.get("/api/estimate")
    def api_estimate(model: str = "gpt2-large", optimizer: str = "fp32", precision: str = "fp32",
                     offload: bool = False, checkpointing: bool = False, reversible: bool = False,
                     shared_groups: int | None = None, batch_size: int = 1, seq_len: int | None = None,
                     pcie_gb_per_s: float = 16.0):
        try:
            options = Options(optimizer=optimizer, precision=precision, offload=offload, checkpointing=checkpointing,
                              reversible=reversible, shared_groups=shared_groups, batch_size=batch_size,
                              seq_len=seq_len, pcie_gb_per_s=pcie_gb_per_s)
            result = estimate(model, options).to_dict()
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from e
        except OverflowError:
            result = None
        # Inputs out of any real range (batch_size 10**40, pcie_gb_per_s 1e-320) give numbers no
        # float or JSON holds: say so instead of failing to encode the answer.
        if result is None or not _finite(result):
            raise HTTPException(status_code=422, detail="these inputs give numbers too large to estimate: use a "
                                                        "realistic batch_size, seq_len and pcie_gb_per_s")
        return result

    return router


def create_app() -> FastAPI:
    """A standalone app serving only the calculator (``crowdtrain memcalc --serve``)."""
    from fastapi.responses import RedirectResponse

    app = FastAPI(title="crowdtrain memory calculator")
    app.include_router(create_router())
    app.add_api_route("/", lambda: RedirectResponse("/memcalc/"), include_in_schema=False)
    return app
