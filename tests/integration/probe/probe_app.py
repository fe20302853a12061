"""The app under test: a real HTTP server that loads for a while, can be told to fail, and
reports itself through sd_notify. Started as its own process by `coldstart probe -- …`.

/health: 503 {"phase": "loading", "progress": p} while loading, then 200 {"phase": "serving"};
/fail?ms=N: /health answers 503 for the next N ms.
On SIGTERM it records the state the routing store shows for it (so a test can see that DRAINING
was published before the app was told to stop), then exits with --exit-code.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from coldstart.probe import notify


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--load", type=float, default=0.3, help="seconds of 'loading'")
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--crash-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--notify", action="store_true", help="report through $NOTIFY_SOCKET")
    p.add_argument("--stop-self-after", type=float, default=None,
                   help="send STOPPING=1 and exit 0 this long after READY")
    p.add_argument("--redis", default=None)
    p.add_argument("--service", default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--sigterm-file", default=None)
    p.add_argument("--usr1-file", default=None, help="write 'usr1' here on SIGUSR1")
    args = p.parse_args()

    started = time.monotonic()
    fail_until = [0.0]

    def loaded() -> float:
        if args.never_ready:
            return 0.0
        return min(1.0, (time.monotonic() - started) / args.load) if args.load else 1.0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/fail":
                ms = float(urllib.parse.parse_qs(url.query)["ms"][0])
                fail_until[0] = time.monotonic() + ms / 1000
                self.answer(200, {"failing_ms": ms})
            elif loaded() < 1.0:
                self.answer(503, {"phase": "loading", "progress": round(loaded(), 3)})
            elif time.monotonic() < fail_until[0]:
                self.answer(503, {"phase": "stalled"})
            else:
                self.answer(200, {"phase": "serving"})

        def answer(self, code: int, doc: dict[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    def on_sigterm(*_: Any) -> None:
        if args.sigterm_file:
            seen = "?"
            if args.redis:
                import redis

                from coldstart.probe.router import keys

                client = redis.Redis.from_url(args.redis, socket_timeout=2)
                raw = client.hget(keys(args.service)[0], args.target)
                seen = raw.decode() if isinstance(raw, bytes) else "absent"
            with open(args.sigterm_file, "w") as f:
                f.write(seen)
        sys.exit(args.exit_code)

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.usr1_file:
        usr1_file = args.usr1_file

        def on_usr1(*_: Any) -> None:
            with open(usr1_file, "w") as f:
                f.write("usr1")

        signal.signal(signal.SIGUSR1, on_usr1)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if args.notify:
        notify(status="loading weights", phase="weights", progress=0.0)
    if args.crash_after is not None:
        time.sleep(args.crash_after)
        sys.exit(args.exit_code)
    while args.notify and not args.never_ready and loaded() < 1.0:
        time.sleep(args.load / 4)
        notify(status="loading weights", phase="weights", progress=loaded())
    if args.notify and not args.never_ready:
        notify(ready=True, status="serving")
    if args.stop_self_after is not None:
        time.sleep(args.stop_self_after)
        notify(stopping=True)
        server.shutdown()
        sys.exit(0)
    while True:
        time.sleep(0.1)  # short: a signal that races the first sleep is seen within 0.1 s


if __name__ == "__main__":
    main()
