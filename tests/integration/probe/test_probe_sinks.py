"""Sinks driven by a real Prober: webhook, Kubernetes pod condition (against a fake API server,
since no cluster runs here), and Redis heartbeats and epochs."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import NotFound, Unavailable
from coldstart.probe.checks import HttpCheck
from coldstart.probe.prober import ProbeConfig, Prober
from coldstart.probe.router import Router
from coldstart.probe.sinks import RedisSink, WebhookSink, make_sink
from coldstart.probe.states import State, Status

pytestmark = pytest.mark.integration


@dataclass
class Recorder:
    """What a receiving HTTP server saw; ``fail_first`` answers 503 to that many requests."""

    fail_first: int = 0
    requests: list[tuple[str, str, dict[str, str], Any, int]] = field(default_factory=list)
    app_ready: bool = False
    # Authorization values answered 401 (an expired token); on_refused runs before the answer
    refused: set[str] = field(default_factory=set)
    on_refused: Callable[[], None] | None = None


def serve(rec: Recorder) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length", "0"))
            return json.loads(self.rfile.read(n)) if n else None

        def _answer(self, code: int, doc: Any) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # the app under probe
            self._answer(200 if rec.app_ready else 503, {"ready": rec.app_ready})

        def _record(self) -> None:
            code = 200
            if rec.fail_first > 0:
                rec.fail_first -= 1
                code = 503
            elif self.headers.get("Authorization") in rec.refused:
                code = 401
                if rec.on_refused is not None:
                    rec.on_refused()
            rec.requests.append((self.command, self.path, dict(self.headers), self._body(), code))
            self._answer(code, {"kind": "Status" if code != 200 else "Pod"})

        do_POST = _record
        do_PATCH = _record

        def log_message(self, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def recorder() -> Iterator[tuple[Recorder, int]]:
    rec = Recorder()
    server = serve(rec)
    yield rec, server.server_address[1]
    server.shutdown()
    server.server_close()


async def until(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def test_webhook_and_kubernetes_condition(recorder: tuple[Recorder, int],
                                          tmp_path: Path) -> None:
    """A fake API server (a real HTTP server written here) stands in for Kubernetes."""
    rec, port = recorder
    rec.fail_first = 2  # the first two requests (of either sink) get a 503 and are retried
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    api = f"http://127.0.0.1:{port}"
    k8s = make_sink(f"k8s://prod/llama-0?api={api}&token_file={token}&condition=example.com/warm",
                    "llama", "10.0.0.5:8000")
    hook = WebhookSink(f"{api}/hook", "llama", "10.0.0.5:8000")
    config = ProbeConfig(service="llama", target="10.0.0.5:8000", interval=0.02, grace=0.2)
    prober = Prober(config, HttpCheck(f"{api}/health"), [hook, k8s])

    async def main() -> int:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: prober.status.state is State.STARTING and len(rec.requests) >= 3)
        rec.app_ready = True
        await until(lambda: prober.status.state is State.READY)
        await prober.flush(5)
        prober.request_drain()
        return await task

    assert asyncio.run(main()) == 0
    patches = [r for r in rec.requests if r[0] == "PATCH"]
    posts = [r for r in rec.requests if r[0] == "POST"]
    assert all(p[1] == "/api/v1/namespaces/prod/pods/llama-0/status" for p in patches)
    assert all(p[2]["Content-Type"] == "application/strategic-merge-patch+json" for p in patches)
    assert all(p[2]["Authorization"] == "Bearer s3cret" for p in patches)
    accepted: dict[str, list[Any]] = {"PATCH": [], "POST": []}
    for method, _, _, body, code in rec.requests:
        if code == 200:
            accepted[method].append(body)
    conditions = [b["status"]["conditions"][0] for b in accepted["PATCH"]]
    assert [(c["type"], c["status"], c["reason"]) for c in conditions] == [
        ("example.com/warm", "False", "Starting"), ("example.com/warm", "True", "Ready"),
        ("example.com/warm", "False", "Draining"), ("example.com/warm", "False", "Stopped")]
    assert [d["state"] for d in accepted["POST"]] == ["STARTING", "READY", "DRAINING", "STOPPED"]
    assert len(patches) + len(posts) == 10


def test_kubernetes_sink_reads_a_rotated_token(recorder: tuple[Recorder, int],
                                               tmp_path: Path) -> None:
    """Issue 16, bug 4: projected service-account tokens rotate (hourly) and the sink used
    to read the token file once. The recorder (a local HTTP server written here) stands in for
    the API server, since no Kubernetes cluster can run here: the token file is rewritten
    between two pushes, and the second request must carry the new token. A 401 (the token
    rotated between the read and the request) is retried once with the file read afresh."""
    rec, port = recorder
    token = tmp_path / "token"
    token.write_text("first\n")
    sink = make_sink(f"k8s://prod/llama-0?api=http://127.0.0.1:{port}&token_file={token}",
                     "llama", "10.0.0.5:8000")

    def rotate() -> None:
        token.write_text("third\n")

    async def main() -> None:
        try:
            await sink.publish(Status(State.STARTING, epoch=1))
            token.write_text("second\n")  # the kubelet rotated it
            await sink.publish(Status(State.READY, epoch=2))
            assert rec.requests[-1][2]["Authorization"] == "Bearer second"
            rec.refused, rec.on_refused = {"Bearer second"}, rotate  # "second" expired
            await sink.publish(Status(State.DRAINING, epoch=3))
            rec.refused, rec.on_refused = {"Bearer third"}, None  # refused, nothing newer
            with pytest.raises(Unavailable, match="refused the service-account token"):
                await sink.publish(Status(State.STOPPED, epoch=4))
        finally:
            await sink.close()

    asyncio.run(main())
    seen = [(r[2]["Authorization"], r[4]) for r in rec.requests if r[0] == "PATCH"]
    assert seen == [("Bearer first", 200), ("Bearer second", 200), ("Bearer second", 401),
                    ("Bearer third", 200), ("Bearer third", 401), ("Bearer third", 401)]


def test_webhook_gives_up_on_a_refusal(recorder: tuple[Recorder, int]) -> None:
    rec, port = recorder
    rec.fail_first = 100
    hook = WebhookSink(f"http://127.0.0.1:{port}/hook", "s", "t", retries=2)

    async def main() -> None:
        try:
            await hook.publish(Status(State.READY, epoch=1))
        finally:
            await hook.close()

    with pytest.raises(Unavailable, match="HTTP 503"):
        asyncio.run(main())
    assert len(rec.requests) == 3


def test_redis_heartbeat_rewrites_a_forgotten_target(redis_server: str) -> None:
    """The store loses every key; the next heartbeat finds the target unknown and writes the
    whole state again, and later heartbeats keep pushing its TTL on.

    The TTL (30 s) is far longer than anything here takes, so no real expiry can happen
    however slow the machine; that the heartbeats keep the target alive past the TTL the
    rewrite gave it is asked of ``pick`` at that moment, on the store's clock (``at_ms``)."""
    service, target = f"svc-{uuid.uuid4().hex[:8]}", "a:1"
    router = Router.connect(redis_server, service)
    heartbeats = router.keys[4]  # target -> heartbeat deadline (server ms)
    sink = RedisSink(redis_server, service, target, ttl=30.0)
    config = ProbeConfig(service=service, target=target, heartbeat=0.05, ttl=30.0)
    prober = Prober(config, None, [sink], notify_path=None)

    async def main() -> None:
        task = asyncio.create_task(prober.run(signals=False))
        from coldstart.probe.states import Notice

        await until(lambda: bool(prober.history))
        prober.notice(Notice(ready=True))
        await prober.flush(5)
        assert router.pick() == target
        router.release(target)
        router.client.delete(*router.keys)  # the store restarted without persistence
        await until(lambda: bool(router.list()) and router.list()[0].state == "READY")
        rewritten = router.client.zscore(heartbeats, target)  # the rewrite's TTL ends here
        assert rewritten is not None
        await until(lambda: (router.client.zscore(heartbeats, target) or 0) > rewritten)
        # at the end of the rewrite's TTL the target is still picked: a later heartbeat
        # pushed its deadline on; long after the newest one it is not (the TTL still counts)
        assert router.pick(at_ms=int(rewritten)) == target
        router.release(target)
        newest = router.client.zscore(heartbeats, target)
        assert newest is not None and newest > rewritten
        with pytest.raises(NotFound):
            router.pick(at_ms=int(newest) + 60_000)
        prober.request_drain()
        await task

    try:
        asyncio.run(main())
    finally:
        router.client.delete(*router.keys)


def test_a_newer_prober_owns_the_target(redis_server: str) -> None:
    service = f"svc-{uuid.uuid4().hex[:8]}"
    router = Router.connect(redis_server, service)

    async def main() -> tuple[bool, bool]:
        old = RedisSink(redis_server, service, "a:1")
        new = RedisSink(redis_server, service, "a:1")
        await old.publish(Status(State.READY, epoch=100))
        await new.publish(Status(State.READY, epoch=200))  # restarted prober, newer epoch
        await old.publish(Status(State.DEGRADED, epoch=150))  # the old one is late
        await old.heartbeat()
        await old.close()
        await new.close()
        return old.superseded, new.superseded

    try:
        assert asyncio.run(main()) == (True, False)
        [view] = router.list()
        assert view.state == "READY" and view.doc["epoch"] == 200
    finally:
        router.client.delete(*router.keys)
