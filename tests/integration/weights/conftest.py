"""A real threading HTTP server on loopback that serves a directory and honours ``Range``."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True
    root: Path
    requests: list[str]


class _Handler(BaseHTTPRequestHandler):
    server: RangeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        self.server.requests.append(f"{self.command} {self.path} {self.headers.get('Range')}")

    def _file(self) -> Path | None:
        path = (self.server.root / self.path.lstrip("/")).resolve()
        if self.server.root.resolve() not in path.parents or not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return path

    def do_HEAD(self) -> None:
        path = self._file()
        if path is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        path = self._file()
        if path is None:
            return
        size = path.stat().st_size
        start, end = 0, size - 1
        spec = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", spec or "")
        if spec and (m is None or int(m.group(1)) >= size):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left:
                chunk = f.read(min(left, 1 << 20))
                self.wfile.write(chunk)
                left -= len(chunk)


@pytest.fixture
def http_files(tmp_path: Path) -> Iterator[RangeServer]:
    """Serve ``server.root`` (a fresh temp dir) at ``http://127.0.0.1:PORT/``."""
    root = tmp_path / "www"
    root.mkdir()
    server = RangeServer(("127.0.0.1", 0), _Handler)
    server.root = root
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def url_of(server: RangeServer, name: str = "") -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}/{name}"
