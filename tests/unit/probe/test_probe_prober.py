"""The Prober's own rules, with a real notify socket and no sinks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument
from coldstart.probe.notify import notify
from coldstart.probe.prober import ProbeConfig, Prober
from coldstart.probe.states import State


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
