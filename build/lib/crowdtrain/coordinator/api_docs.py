"""The API's interactive docs (``/docs``, Swagger UI) with every file served by the coordinator.

FastAPI's own ``/docs`` loads Swagger UI's script and style sheet from a CDN and its icon from
FastAPI's site, so on a network without the Internet (a lab, a cluster) the page stays blank.
Here they come from the ``swagger-ui-py`` package, which ships Swagger UI's built files; it must
hold Swagger UI 5 or later, as earlier ones cannot read the OpenAPI 3.1 that FastAPI writes. The
app is made with ``docs_url=None, redoc_url=None`` (ReDoc too would come from a CDN).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css",
          "favicon-32x32.png": "image/png"}
ASSET_PREFIX = "/docs/swagger-ui"
INSTALL_HINT = "install it with `pip install 'swagger-ui-py>=25.7'` (`make install` does)"


def swagger_ui_dir() -> Path:
    """The folder of Swagger UI's built files inside the installed ``swagger_ui`` package (found
    without importing it: its import pulls in web-framework handlers this app does not use)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"/docs needs Swagger UI's files from the swagger-ui-py package: {INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    missing = [name for name in ASSETS if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}: the swagger-ui-py package is broken or changed its "
                                f"layout; {INSTALL_HINT}")
    return folder


def add_api_docs(app: FastAPI, *, path: str = "/docs") -> None:
    """Serve Swagger UI at ``path`` for ``app``'s OpenAPI document, its files under ASSET_PREFIX."""

    @app.get(path, include_in_schema=False)
    def docs() -> HTMLResponse:
        try:
            swagger_ui_dir()
        except FileNotFoundError as e:
            raise HTTPException(503, str(e)) from e
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title}: API",
                                   swagger_js_url=f"{ASSET_PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSET_PREFIX}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSET_PREFIX}/favicon-32x32.png")

    @app.get(ASSET_PREFIX + "/{name}", include_in_schema=False)
    def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise HTTPException(404, f"no Swagger UI file {name!r}")
        try:
            folder = swagger_ui_dir()
        except FileNotFoundError as e:
            raise HTTPException(503, str(e)) from e
        # Fixed within one installed version, and 1.5 MB of script: let browsers keep it a day.
        return FileResponse(folder / name, media_type=ASSETS[name], headers={"Cache-Control": "public, max-age=86400"})
