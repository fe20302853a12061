"""The Prober's own rules, with a real notify socket and no sinks."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument
from coldstart.probe.checks import TcpCheck
from coldstart.probe.notify import notify
from coldstart.probe.prober import EXIT_FAILED, ProbeConfig, Prober
from coldstart.probe.states import State, Status, Thresholds
from tests.fixtures.procs import free_port


async def until(cond: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


def test_progress_is_rate_limited_but_the_latest_gets_out(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    prober = Prober(ProbeConfig(progress_every=0.2, grace=0.1), None, notify_path=path)

    async def main() -> None:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: prober.history)
        for i in range(1, 11):
            notify(status="loading", progress=i / 10, socket_path=path)
        await until(lambda: prober.history[-1].progress == 1.0)
        notify(ready=True, socket_path=path)
        await until(lambda: prober.status.state is State.READY)
        prober.request_drain()
        await task

    asyncio.run(main())
    loading = [s for s in prober.history if s.state is State.LOADING]
    assert 1 <= len(loading) < 10 and loading[-1].progress == 1.0
    epochs = [s.epoch for s in prober.history]
    assert epochs == sorted(set(epochs))  # strictly increasing
    assert [s.state for s in prober.history][-3:] == [State.READY, State.DRAINING,
                                                      State.STOPPED]


def test_app_saying_stopping_drains(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    prober = Prober(ProbeConfig(grace=0.1), None, notify_path=path)

    async def main() -> int:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: prober.history)
        notify(ready=True, socket_path=path)
        notify(stopping=True, status="bye", socket_path=path)
        return await task

    assert asyncio.run(main()) == 0
    assert [s.state for s in prober.history] == [
        State.STARTING, State.READY, State.DRAINING, State.STOPPED]


@pytest.mark.parametrize("kw", [{"startup_interval": 0.0}, {"interval": -1.0},
                                {"ttl": 1.0, "heartbeat": 1.0}, {"grace": -1.0}])
def test_bad_config_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument):
        ProbeConfig(**kw)  # type: ignore[arg-type]


class Recording:
    """A sink that keeps what it was told (the sinks' own tests use real servers)."""

    name = "recording"

    def __init__(self) -> None:
        self.states: list[Status] = []

    async def start(self) -> None:
        return None

    async def publish(self, status: Status) -> None:
        self.states.append(status)

    async def heartbeat(self) -> None:
        return None

    async def close(self) -> None:
        return None


def test_sidecar_failed_is_an_error_told_to_the_sinks_and_ends_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 16, bug 1: a sidecar whose target never got ready logged FAILED at INFO only and
    ran on forever. FAILED is logged at ERROR with the cause (how long it waited, the last
    try's answer) and what follows, the sinks get it, and run() ends with EXIT_FAILED."""
    port = free_port()  # nothing listens: every try is refused
    sink = Recording()
    config = ProbeConfig(target="10.0.0.5:8000", startup_interval=0.01,
                         thresholds=Thresholds(startup_timeout=0.3))
    prober = Prober(config, TcpCheck("127.0.0.1", port), [sink])
    caplog.set_level(logging.WARNING, logger="coldstart.probe")

    async def main() -> int:
        async with asyncio.timeout(20):  # it used to wait for a SIGTERM that never came
            return await prober.run(signals=False)

    assert asyncio.run(main()) == EXIT_FAILED == 1
    assert [s.state for s in sink.states] == [State.STARTING, State.FAILED]
    detail = sink.states[-1].detail
    assert "not ready after 0.3 s" in detail and "ConnectionRefusedError" in detail
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, caplog.text
    line = errors[0].getMessage()
    assert "\n" not in line
    assert "FAILED" in line and "not ready after 0.3 s" in line and "ConnectionRefusedError" in line
    assert "exiting with 1" in line and "--startup-timeout" in line


def test_sidecar_keep_probing_goes_ready_when_the_app_comes_up_late(
        caplog: pytest.LogCaptureFixture) -> None:
    """With keep_probing, FAILED is still an error told to the sinks, but the sidecar probes
    on and a late start is READY; SIGTERM then drains as usual (exit 0)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]  # bound, not listening yet: tries are refused
    sink = Recording()
    config = ProbeConfig(startup_interval=0.01, interval=0.02, grace=0.1, keep_probing=True,
                         thresholds=Thresholds(startup_timeout=0.2))
    prober = Prober(config, TcpCheck("127.0.0.1", port), [sink])
    caplog.set_level(logging.WARNING, logger="coldstart.probe")

    async def main() -> int:
        task = asyncio.create_task(prober.run(signals=False))
        await until(lambda: prober.status.state is State.FAILED)
        listener.listen()
        await until(lambda: prober.status.state is State.READY)
        listener.close()
        prober.request_drain()
        return await task

    try:
        assert asyncio.run(main()) == 0
    finally:
        listener.close()
    states = [s.state for s in prober.history]
    assert states[:3] == [State.STARTING, State.FAILED, State.READY]
    assert "probing on" in caplog.text


@pytest.mark.parametrize("on_sigterm", ["dies", "ignores", "exits 0"])
def test_wrapper_failed_stops_the_app_and_exits_1(
        on_sigterm: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 16, bug 2: a wrapped app not READY within the start-up timeout is stopped
    (SIGTERM, grace, SIGKILL) and the wrapper ends with 1 however the app ended (it used to
    pass on 143 or 137, read as "the kubelet stopped it"), after an ERROR line saying so."""
    handler = {"dies": "signal.SIG_DFL", "ignores": "signal.SIG_IGN",
               "exits 0": "lambda *a: sys.exit(0)"}[on_sigterm]
    pid_file = tmp_path / "pid"
    app = [sys.executable, "-c",
           f"import os, signal, sys, time; signal.signal(signal.SIGTERM, {handler}); "
           f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"]
    sink = Recording()
    # the app must have set its SIGTERM handler and written its pid before it is stopped: a
    # start-up timeout a busy machine's Python start cannot reach
    config = ProbeConfig(grace=0.5, thresholds=Thresholds(startup_timeout=5.0))
    prober = Prober(config, None, [sink])
    caplog.set_level(logging.WARNING, logger="coldstart.probe")

    async def main() -> int:
        async with asyncio.timeout(60):
            return await prober.run(app, signals=False)

    assert asyncio.run(main()) == EXIT_FAILED == 1
    assert [s.state for s in sink.states] == [State.STARTING, State.FAILED]
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "FAILED: not ready after 5 s" in errors[0]
    assert "stopping the app, then exiting with 1" in errors[0]
