"""`coldstart probe` as a wrapper and as a sidecar, pushing to a real redis-server."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import NotFound
from coldstart.probe.router import Router, channel
from tests.fixtures.procs import free_port, tcp_open, wait_for
from tests.integration.probe.probe_helpers import APP, Watcher, coldstart_probe, sigterm

pytestmark = pytest.mark.integration


def fresh() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"svc-{tag}", f"app-{tag}:8000"


class Health:
    """An app's health endpoint that answers as the test says, for as long as it says: each
    phase begins and ends when the test moves it, not when a timer runs out, so the states a
    prober publishes do not depend on how quickly it polls. ``phase``: "loading" (503 with
    ``progress``, as ``probe_app`` answers while loading), "serving" (200) or "stalled" (503).
    """

    def __init__(self) -> None:
        self.phase = "loading"
        self.progress = 0.5
        health = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                phase = health.phase
                doc: dict[str, Any] = {"phase": phase}
                if phase == "loading":
                    doc["progress"] = health.progress
                body = json.dumps(doc).encode()
                self.send_response(200 if phase == "serving" else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/health"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health() -> Iterator[Health]:
    h = Health()
    yield h
    h.close()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_wrapper_http_start_drift_and_drain(redis_server: str, tmp_path: Path,
                                            health: Health) -> None:
    """The wrapped app's health answers come from ``health``: loading, serving, a stall and
    the recovery each last until the test ends them, so the sequence of states is the same
    however fast or slow the prober runs. (The app's own endpoint is probed in
    test_pick_skips_a_degraded_target.)"""
    service, target = fresh()
    port = free_port()
    router = Router.connect(redis_server, service)
    router._call("update", "other:1", 1, "READY", "{}", 60_000, channel(service), 0)
    watcher = Watcher(redis_server, service)
    marker = tmp_path / "sigterm-saw"
    args = ["--service", service, "--advertise", target, "--sink", redis_server,
            "--target", health.url, "--interval", "0.02",
            "--failures", "3", "--successes", "2", "--grace", "10", "--", sys.executable, APP,
            "--port", str(port), "--load", "0", "--exit-code", "7", "--redis", redis_server,
            "--service", service, "--target", target, "--sigterm-file", str(marker)]
    try:
        with coldstart_probe(args, tmp_path / "probe.log") as proc:
            loading = watcher.wait_for(target, "LOADING")
            assert loading["phase"] == "loading" and loading["progress"] == 0.5
            # `health` says nothing of the app process: wait until it serves (then its
            # SIGTERM handler is in place and it has gone on to wait for signals)
            wait_for(lambda: get(f"http://127.0.0.1:{port}/health")[0] == 200, timeout=20,
                     what="app", proc=proc)
            health.phase = "serving"
            ready = watcher.wait_for(target, "READY")
            assert "progress" not in ready
            n = len(watcher.docs)
            health.phase = "stalled"  # the app stalls, until the test lets it recover
            degraded = watcher.wait_for(target, "DEGRADED", after=n)
            assert degraded["detail"] == "HTTP 503"
            health.phase = "serving"
            watcher.wait_for(target, "READY", after=n)
            n = len(watcher.docs)
            sigterm(proc)
            assert proc.wait(20) == 7  # the app's exit code
            watcher.wait_for(target, "DRAINING", after=n)
            watcher.wait_for(target, "STOPPED", after=n)
        assert marker.read_text() == "DRAINING"  # routers were told before the app's SIGTERM
        assert watcher.states(target) == [
            "STARTING", "LOADING", "READY", "DEGRADED", "READY", "DRAINING", "STOPPED"]
        view = next(v for v in router.list() if v.target == target)
        assert view.state == "STOPPED"
        assert {router.pick() for _ in range(3)} == {"other:1"}
    finally:
        watcher.close()
        router.client.delete(*router.keys)


def test_pick_skips_a_degraded_target(redis_server: str, tmp_path: Path) -> None:
    """The drift again, on the app's own endpoint, with no other target: pick has nothing to
    give while DEGRADED. The stall lasts until the test ends it (``/fail?ms=0``), so the pick
    never races the recovery."""
    service, target = fresh()
    port = free_port()
    router = Router.connect(redis_server, service)
    watcher = Watcher(redis_server, service)
    args = ["--service", service, "--advertise", target, "--sink", redis_server,
            "--target", f"http://127.0.0.1:{port}/health", "--interval", "0.02",
            "--", sys.executable, APP, "--port", str(port), "--load", "0"]
    try:
        with coldstart_probe(args, tmp_path / "probe.log"):
            watcher.wait_for(target, "READY")
            assert router.pick() == target
            router.release(target)
            n = len(watcher.docs)
            get(f"http://127.0.0.1:{port}/fail?ms=3600000")  # failing until told otherwise
            watcher.wait_for(target, "DEGRADED", after=n)
            with pytest.raises(NotFound):
                router.pick()
            get(f"http://127.0.0.1:{port}/fail?ms=0")  # recovered
            watcher.wait_for(target, "READY", after=n)
            assert router.pick() == target
    finally:
        watcher.close()
        router.client.delete(*router.keys)


def test_wrapper_with_sd_notify_only(redis_server: str, tmp_path: Path) -> None:
    service, target = fresh()
    watcher = Watcher(redis_server, service)
    args = ["--service", service, "--advertise", target, "--sink", redis_server,
            "--", sys.executable, APP, "--load", "0.4", "--notify", "--stop-self-after", "0.5"]
    try:
        with coldstart_probe(args, tmp_path / "probe.log") as proc:
            loading = watcher.wait_for(target, "LOADING")
            assert loading["phase"] == "weights" and loading["detail"] == "loading weights"
            watcher.wait_for(target, "READY")
            assert proc.wait(20) == 0
        watcher.wait_for(target, "STOPPED")
        assert watcher.states(target) == ["STARTING", "LOADING", "READY", "DRAINING", "STOPPED"]
    finally:
        watcher.close()


def test_crash_while_loading_is_failed_with_the_apps_exit_code(
        redis_server: str, tmp_path: Path) -> None:
    service, target = fresh()
    watcher = Watcher(redis_server, service)
    port = free_port()
    args = ["--service", service, "--advertise", target, "--sink", redis_server,
            "--target", f"http://127.0.0.1:{port}/health", "--", sys.executable, APP,
            "--port", str(port), "--never-ready", "--crash-after", "0.3", "--exit-code", "3"]
    try:
        with coldstart_probe(args, tmp_path / "probe.log") as proc:
            assert proc.wait(20) == 3
        failed = watcher.wait_for(target, "FAILED")
        assert "exited with 3" in failed["detail"]
    finally:
        watcher.close()


def test_startup_timeout_is_failed_and_stops_the_app(redis_server: str, tmp_path: Path) -> None:
    service, target = fresh()
    watcher = Watcher(redis_server, service)
    port = free_port()
    args = ["--service", service, "--advertise", target, "--sink", redis_server,
            "--target", f"http://127.0.0.1:{port}/health", "--startup-timeout", "1",
            "--", sys.executable, APP, "--port", str(port), "--never-ready"]
    try:
        with coldstart_probe(args, tmp_path / "probe.log") as proc:
            code = proc.wait(20)
        failed = watcher.wait_for(target, "FAILED")
        assert "not ready after 1 s" in failed["detail"]
        assert code != 0
        assert not tcp_open_quiet(port)  # the app is gone
    finally:
        watcher.close()


def tcp_open_quiet(port: int) -> bool:
    try:
        return tcp_open(port)()
    except OSError:
        return False


def test_sidecar_kubelet_endpoint(tmp_path: Path, health: Health) -> None:
    """The app (``health``, not the sidecar's child) stays loading until the test says it is
    serving, so LOADING is seen and read back however late the sidecar's first try is."""
    listen = free_port()
    args = ["--target", health.url, "--listen", f"127.0.0.1:{listen}", "--service", "side",
            "--grace", "0.5"]
    with coldstart_probe(args, tmp_path / "probe.log") as proc:
        wait_for(tcp_open(listen), timeout=20, what="probe endpoint", proc=proc)
        # the endpoint opens before the first try: STARTING, then LOADING, both 503
        first = get(f"http://127.0.0.1:{listen}/ready")
        assert first in ((503, b"STARTING\n"), (503, b"LOADING\n"))
        wait_for(lambda: get(f"http://127.0.0.1:{listen}/ready") == (503, b"LOADING\n"),
                 timeout=20, what="LOADING", proc=proc)
        status = json.loads(get(f"http://127.0.0.1:{listen}/status")[1])
        assert status["state"] == "LOADING" and status["target"] == f"127.0.0.1:{health.port}"
        health.phase = "serving"
        deadline = time.monotonic() + 20
        while get(f"http://127.0.0.1:{listen}/ready")[0] != 200:
            assert time.monotonic() < deadline, "never READY"
            time.sleep(0.02)
        assert get(f"http://127.0.0.1:{listen}/healthz") == (200, b"READY\n")
        sigterm(proc)
        # the app keeps answering (it is not the sidecar's to stop): STOPPED after grace
        assert proc.wait(60) == 0


def test_wrapper_forwards_signals_and_sigint_drains(tmp_path: Path) -> None:
    port = free_port()
    usr1 = tmp_path / "usr1"
    args = ["--target", f"http://127.0.0.1:{port}/health", "--", sys.executable, APP,
            "--port", str(port), "--load", "0", "--usr1-file", str(usr1), "--exit-code", "5",
            "--sigterm-file", str(tmp_path / "term")]
    with coldstart_probe(args, tmp_path / "probe.log") as proc:
        wait_for(tcp_open(port), timeout=20, what="app", proc=proc)
        wait_for(lambda: usr1.exists() or _kill(proc.pid, signal.SIGUSR1), timeout=20,
                 what="SIGUSR1 forwarded")
        assert usr1.read_text() == "usr1"
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C drains like SIGTERM
        assert proc.wait(20) == 5
    assert (tmp_path / "term").exists()


def _kill(pid: int, sig: int) -> bool:
    os.kill(pid, sig)
    time.sleep(0.1)
    return False
