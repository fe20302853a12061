"""HTTP, TCP and exec checks against real servers and processes on loopback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import InvalidArgument
from coldstart.probe.checks import ExecCheck, HttpCheck, TcpCheck, parse_target
from tests.fixtures.procs import free_port


class App:
    """What the app under test answers; changed by the test while the server runs."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b"ok"
        self.chunked = False
        self.delay = 0.0
        self.connections: set[tuple[str, int]] = set()
        self.requests = 0


def serve(app: App) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            app.connections.add(self.client_address)
            app.requests += 1
            if app.delay:
                threading.Event().wait(app.delay)
            self.send_response(app.status)
            if app.chunked:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                half = len(app.body) // 2
                for part in (app.body[:half], app.body[half:]):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("Content-Length", str(len(app.body)))
                self.end_headers()
                self.wfile.write(app.body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.fixture
def http_app() -> Iterator[tuple[App, int]]:
    app = App()
    server, port = serve(app)
    yield app, port
    server.shutdown()
    server.server_close()


#: the deadline of a check that must be answered: only a hang meets it, a busy machine does not
LONG = 30.0


def test_http_status_and_one_kept_alive_connection(http_app: tuple[App, int]) -> None:
    app, port = http_app

    async def main() -> list[bool]:
        check = HttpCheck(f"http://127.0.0.1:{port}/health")
        results = []
        for status in (503, 503, 200, 302, 500):
            app.status = status
            results.append((await check.run(LONG)).ok)
        await check.close()
        return results

    assert asyncio.run(main()) == [False, False, True, True, False]
    assert app.requests == 5 and len(app.connections) == 1


@pytest.mark.parametrize("chunked", [False, True])
def test_http_json_phase_and_progress(http_app: tuple[App, int], chunked: bool) -> None:
    app, port = http_app
    app.status, app.chunked = 503, chunked
    app.body = b'{"phase": "loading-weights", "progress": 0.42}'

    async def main() -> tuple[Any, Any]:
        check = HttpCheck(f"http://127.0.0.1:{port}/")
        first = await check.run(LONG)
        app.body = b'{"phase": "warm", "progress": true}'
        second = await check.run(LONG)
        await check.close()
        return first, second

    first, second = asyncio.run(main())
    assert (first.ok, first.phase, first.progress, first.detail) == (
        False, "loading-weights", 0.42, "HTTP 503")
    assert second.phase == "warm" and second.progress is None  # a bool is not a progress


def test_http_timeout_then_a_fresh_connection(http_app: tuple[App, int]) -> None:
    app, port = http_app

    async def main() -> tuple[Any, Any, Any]:
        check = HttpCheck(f"http://127.0.0.1:{port}/")
        # a first answer: the check holds a connection (kept alive) the app has seen
        first = await check.run(LONG)
        app.delay = 0.5
        late = await check.run(0.05)      # on that connection; the answer comes too late
        app.delay = 0.0
        await asyncio.sleep(0.6)  # the late answer arrives on the dropped connection
        fresh = await check.run(LONG)
        await check.close()
        return first, late, fresh

    first, late, fresh = asyncio.run(main())
    assert first.ok
    assert not late.ok and "no answer" in late.detail
    assert fresh.ok and fresh.detail == "HTTP 200"
    # the timed-out connection was dropped, not read again: the fresh answer came on a new
    # one (whether or not the late request reached the app before the check gave up)
    assert len(app.connections) == 2


def test_http_refused_and_then_up() -> None:
    port = free_port()

    async def main() -> tuple[Any, Any]:
        check = HttpCheck(f"http://127.0.0.1:{port}/")
        down = await check.run(0.5)
        app = App()
        server = ThreadingHTTPServer(("127.0.0.1", port), type("H", (BaseHTTPRequestHandler,), {
            "do_GET": lambda self: (self.send_response(204), self.end_headers()),
            "log_message": lambda self, *a: None,
        }))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            up = await check.run(1.0)
        finally:
            server.shutdown()
            server.server_close()
            await check.close()
        del app
        return down, up

    down, up = asyncio.run(main())
    assert not down.ok and "Refused" in down.detail
    assert up.ok  # HTTP/1.0 server closing after each answer works too


def test_tcp_check() -> None:
    async def main() -> tuple[bool, bool]:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
            up = (await TcpCheck("127.0.0.1", port).run(1.0)).ok
        down = (await TcpCheck("127.0.0.1", port).run(1.0)).ok
        return up, down

    assert asyncio.run(main()) == (True, False)


def test_exec_check(tmp_path: Path) -> None:
    py = sys.executable
    gone = tmp_path / "gone.sh"  # exists when the check is made, removed before it runs
    gone.write_text("#!/bin/sh\nexit 0\n")
    gone.chmod(0o755)
    vanished = ExecCheck([str(gone)])
    gone.unlink()

    async def main() -> list[Any]:
        return [
            await ExecCheck([py, "-c", "print('{\"phase\": \"x\", \"progress\": 0.5}')"]).run(5),
            await ExecCheck([py, "-c", "raise SystemExit(3)"]).run(5),
            await ExecCheck([py, "-c", "import time; time.sleep(5)"]).run(0.3),
            await vanished.run(1),
        ]

    ok, bad, slow, missing = asyncio.run(main())
    assert ok.ok and ok.phase == "x" and ok.progress == 0.5
    assert not bad.ok and bad.detail.startswith("exit 3")
    assert not slow.ok and "no exit" in slow.detail
    assert not missing.ok and "cannot run" in missing.detail


def test_exec_check_timeout_kills_the_commands_children() -> None:
    # a grandchild that keeps the output pipe open must not outlive the deadline
    marker = "61.4159"
    check = ExecCheck(["sh", "-c", f"sleep {marker} & sleep {marker}"])
    # bound on the whole check (not a timing assertion): it must not wait for the children
    result = asyncio.run(asyncio.wait_for(check.run(0.3), 30))
    assert not result.ok and "no exit" in result.detail
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"children left running: {left.stdout}"


def test_parse_target() -> None:
    assert isinstance(parse_target("http://127.0.0.1:8000/health"), HttpCheck)
    tcp = parse_target("tcp://127.0.0.1:6379")
    assert isinstance(tcp, TcpCheck) and tcp.port == 6379
    assert isinstance(parse_target("exec:true"), ExecCheck)


@pytest.mark.parametrize("bad", ["https://x/health", "ftp://x", "tcp://host", "tcp://h:99999",
                                 "exec:", "grpc://:1", "127.0.0.1:80"])
def test_parse_target_refuses_bad_input(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_target(bad)


def test_an_exec_target_that_can_never_pass_is_refused_at_start(tmp_path: Path) -> None:
    """Issue 16, bug 3: ``exec:/nonexistent`` used to be "not ready" until start-up timed out.
    A command that is missing, not executable, or not on PATH is refused when the check is
    made, in one line naming it; so is a target that cannot be parsed at all."""
    data = tmp_path / "data.txt"
    data.write_text("not a program\n")
    cases = {
        "exec:/nonexistent": "/nonexistent does not exist",
        "exec:/nonexistent --flag": "/nonexistent does not exist",
        f"exec:{data}": f"{data} is not an executable file",
        f"exec:{tmp_path}": "is not an executable file",
        "exec:no-such-command-cs": "'no-such-command-cs' is not an executable on PATH",
        'exec:"unclosed': "No closing quotation",
        "http://127.0.0.1:abc/health": "bad target URL",
        "http://[::1/health": "bad target URL",
        "tcp://[x": "bad target URL",
    }
    for target, message in cases.items():
        with pytest.raises(InvalidArgument) as caught:
            parse_target(target)
        text = str(caught.value)
        assert message in text and "\n" not in text, (target, text)
    assert isinstance(parse_target("exec:true"), ExecCheck)  # found on PATH, like shutil.which
    assert isinstance(parse_target(f"exec:{sys.executable} -c pass"), ExecCheck)
