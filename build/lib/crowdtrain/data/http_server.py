"""A small threaded HTTP server for a shard folder, with Range requests.

Parquet readers seek: they read the footer at the end of the file first, then only the row
groups they need. Python's ``http.server`` ignores ``Range`` and always sends the whole file,
so it cannot serve shards to a streaming reader efficiently; this one answers
``Range: bytes=a-b`` / ``a-`` / ``-n`` with 206 Partial Content (416 when unsatisfiable) and
advertises ``Accept-Ranges: bytes``. Only files inside the folder are served; no listings.

Torch-free: the coordinator can run it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CHUNK = 1 << 16


class _Handler(BaseHTTPRequestHandler):
    root: Path  # set on the subclass made per server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # route to logging instead of stderr
        logger.debug("%s %s", self.address_string(), fmt % args)

    def _resolve(self) -> Path | None:
        rel = unquote(urlsplit(self.path).path).lstrip("/")
        path = (self.root / rel).resolve()
        if self.root not in path.parents or not path.is_file():
            return None
        return path

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        path = self._resolve()
        if path is None:
            self.send_error(HTTPStatus.NOT_FOUND, "no such file")
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        status = HTTPStatus.OK
        header = self.headers.get("Range")
        if header:
            m = _RANGE.match(header.strip())
            if not m or (not m[1] and not m[2]):
                self._unsatisfiable(size)
                return
            if m[1]:
                start = int(m[1])
                end = min(int(m[2]), size - 1) if m[2] else size - 1
            else:  # suffix range: the last n bytes
                start = max(size - int(m[2]), 0)
            if start >= size or start > end:
                self._unsatisfiable(size)
                return
            status = HTTPStatus.PARTIAL_CONTENT
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = length
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the reader went away: normal for a streaming client
                left -= len(chunk)

    def _unsatisfiable(self, size: int) -> None:
        self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
        self.send_header("Content-Range", f"bytes */{size}")
        self.send_header("Content-Length", "0")
        self.end_headers()


class ShardServer:
    """A running server: ``.url`` (base URL, ends with '/'), ``.close()``; also a context manager."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread
        host, port = httpd.server_address[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}/"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_directory(directory, host: str = "127.0.0.1", port: int = 0) -> ShardServer:
    """Serve ``directory`` over HTTP in a background thread (port 0 picks a free port)."""
    root = Path(directory).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"cannot serve {directory}: not a folder")
    handler = type("ShardHandler", (_Handler,), {"root": root})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name=f"shard-server-{os.path.basename(root)}", daemon=True)
    thread.start()
    server = ShardServer(httpd, thread)
    logger.info("serving %s at %s", root, server.url)
    return server
