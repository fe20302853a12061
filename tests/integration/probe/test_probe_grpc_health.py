"""gRPC health checking (grpc.health.v1) against real gRPC servers: Watch pushes, Check polls."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coldstart.probe.checks import GrpcHealthCheck
from coldstart.probe.prober import ProbeConfig, Prober
from coldstart.probe.states import State

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", NOT_SERVING)
    servicer.set("llama", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture
def check_only_server() -> Iterator[tuple[dict[str, int], int]]:
    """A server that implements Check but not Watch (as some servers do)."""
    status = {"value": NOT_SERVING}

    def check(request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse(status=status["value"])

    handler = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield status, port
    server.stop(0)


async def until(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def test_check_per_service(health_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = health_server

    async def main() -> list[Any]:
        whole = GrpcHealthCheck(f"127.0.0.1:{port}")
        llama = GrpcHealthCheck(f"127.0.0.1:{port}", "llama")
        missing = GrpcHealthCheck(f"127.0.0.1:{port}", "nope")
        out = [await whole.run(2), await llama.run(2)]
        servicer.set("llama", SERVING)
        out += [await llama.run(2), await missing.run(2)]
        for c in (whole, llama, missing):
            await c.close()
        return out

    whole, before, after, missing = asyncio.run(main())
    assert not whole.ok and whole.detail == "gRPC NOT_SERVING"
    assert not before.ok and after.ok and after.detail == "gRPC SERVING"
    assert not missing.ok and "NOT_FOUND" in missing.detail


def test_watch_pushes_each_change(health_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = health_server
    check = GrpcHealthCheck(f"127.0.0.1:{port}", "llama")
    # polling slower than the test: whatever happens fast came by Watch
    config = ProbeConfig(startup_interval=30, startup_try_timeout=1, interval=30, grace=0.1)
    prober = Prober(config, check)

    async def main() -> list[State]:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: prober._watching)
        servicer.set("llama", SERVING)
        await until(lambda: prober.status.state is State.READY)
        servicer.set("llama", NOT_SERVING)
        await until(lambda: prober.status.state is State.DEGRADED)
        servicer.set("llama", SERVING)
        await until(lambda: prober.status.state is State.READY)
        prober.request_drain()
        await task
        return [s.state for s in prober.history]

    states = asyncio.run(main())
    assert states[:4] == [State.STARTING, State.READY, State.DEGRADED, State.READY]
    assert not check.watch_unsupported


def test_without_watch_it_polls_check(check_only_server: tuple[dict[str, int], int]) -> None:
    status, port = check_only_server
    check = GrpcHealthCheck(f"127.0.0.1:{port}")
    prober = Prober(ProbeConfig(grace=0.1), check)

    async def main() -> None:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: check.watch_unsupported)
        await asyncio.sleep(0.05)
        before = prober.status
        assert before.state is State.STARTING  # polling Check: NOT_SERVING is not ready
        status["value"] = SERVING
        await until(lambda: prober.status.state is State.READY)
        prober.request_drain()
        await task

    asyncio.run(main())
