"""``hold``: background work (the fill) waits while a snapshot restore keeps the node busy
without reading through FUSE, as it waits for reads."""

from __future__ import annotations

import time

import pytest

from coldstart.errors import InvalidArgument
from coldstart.lazyfs import control
from coldstart.lazyfs.fetcher import ChunkFetcher


def test_a_hold_keeps_background_work_waiting_until_it_ends() -> None:
    fetcher = ChunkFetcher(None)
    try:
        assert fetcher.wait_quiet(timeout=0.2)          # no read yet: quiet
        t = time.monotonic()
        fetcher.hold(0.6)
        assert not fetcher.wait_quiet(timeout=0.2)      # held: gives up
        assert fetcher.wait_quiet(timeout=5.0)          # quiet once the hold ends
        assert time.monotonic() - t >= 0.55
        fetcher.hold(0.0)                                # a shorter hold never cuts one
        fetcher.hold(0.5)
        fetcher.hold(0.1)
        assert not fetcher.wait_quiet(timeout=0.2)
    finally:
        fetcher.close()


class _Held:
    def __init__(self) -> None:
        self.held: list[float] = []

    async def ready(self) -> None:
        pass

    def hold(self, seconds: float) -> None:
        self.held.append(seconds)


def _dispatch(request: dict[str, object], handler: _Held) -> bytes:
    import trio

    line = control.encode(request).strip()
    reply: bytes = trio.run(control.dispatch, line, handler)
    return reply


@pytest.mark.parametrize("seconds", [-1, 601, "5", True, None])
def test_the_control_op_refuses_what_is_not_a_duration(seconds: object) -> None:
    handler = _Held()
    with pytest.raises(InvalidArgument, match="seconds"):
        control.decode_reply(_dispatch({"op": control.HOLD, "seconds": seconds}, handler))
    assert not handler.held


def test_the_control_op_holds() -> None:
    handler = _Held()
    assert control.decode_reply(_dispatch(control.hold_request(2.5), handler)) is None
    assert handler.held == [2.5]
