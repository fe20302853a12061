"""A small, real HTTP proxy on loopback in front of the registry, that can misbehave on purpose.

``flip`` = (start, end): bytes of the blob in that absolute range are inverted in responses;
``hang`` = True: blob range requests that start at or before ``hang_below`` are held open
without an answer until the proxy stops. Every request is counted.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from coldstart.stack.procs import free_port

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


class Proxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.upstream_host = upstream.split("://", 1)[1]
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.flip: tuple[int, int] | None = None
        self.hang = False
        self.hang_below = 1 << 62
        self.requests: list[tuple[str, str, str]] = []   # method, path, range
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=30.0)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                rng = self.headers.get("Range", "")
                with proxy._lock:
                    proxy.requests.append((method, self.path, rng))
                m = _RANGE.match(rng)
                start = int(m.group(1)) if m else 0
                if proxy.hang and "/blobs/" in self.path and m and start <= proxy.hang_below:
                    proxy._stop.wait(60)
                    return
                body = b""
                length = int(self.headers.get("Content-Length", "0") or 0)
                if length:
                    body = self.rfile.read(length)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection")}
                resp = proxy._client.request(method, proxy.upstream + self.path,
                                             headers=headers, content=body)
                data = resp.content
                if proxy.flip is not None and "/blobs/" in self.path and method == "GET":
                    a, b = proxy.flip
                    buf = bytearray(data)
                    for pos in range(max(a, start), min(b, start + len(buf))):
                        buf[pos - start] ^= 0xFF
                    data = bytes(buf)
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() in ("content-length", "transfer-encoding", "connection",
                                     "content-encoding"):
                        continue
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if method != "HEAD"
                                                       else resp.headers.get("Content-Length",
                                                                             "0")))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_HEAD(self) -> None:
                self._forward("HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def blob_gets(self) -> list[str]:
        with self._lock:
            return [r for m, p, r in self.requests if m == "GET" and "/blobs/" in p]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


@contextmanager
def proxy_for(upstream_url: str) -> Iterator[Proxy]:
    p = Proxy(upstream_url)
    p.start()
    try:
        yield p
    finally:
        p.stop()
