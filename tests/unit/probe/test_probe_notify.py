"""sd_notify: parsing, the app-side helper, and the prober's listening socket."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument, Unavailable
from coldstart.probe.notify import NotifyListener, notify, parse_notice
from coldstart.probe.states import Notice


def test_parse_systemd_assignments_and_extensions() -> None:
    n = parse_notice(b"READY=1\nSTATUS=serving on :8000\nX_PHASE=warm\nX_PROGRESS=1\nMAINPID=7")
    assert n == Notice(ready=True, status="serving on :8000", phase="warm", progress=1.0)
    assert parse_notice(b"STOPPING=1").stopping
    assert parse_notice(b"RELOADING=1").reloading


@pytest.mark.parametrize("data", [b"", b"garbage", b"\xff\xfe=1", b"X_PROGRESS=nan",
                                  b"X_PROGRESS=abc", b"READY=0", b"READY=yes"])
def test_junk_is_ignored_not_fatal(data: bytes) -> None:
    n = parse_notice(data)
    assert not n.ready and n.progress is None


def test_notify_without_socket_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify(ready=True) is False


def test_notify_sends_one_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert notify(ready=True, status="up", progress=0.5) is True
        data = server.recv(4096)
    assert parse_notice(data) == Notice(ready=True, status="up", progress=0.5)


def test_notify_abstract_namespace() -> None:
    name = f"@coldstart-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name[1:])
        assert notify("STATUS=hello", socket_path=name)
        assert server.recv(4096) == b"STATUS=hello"


def test_notify_to_a_missing_socket_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="cannot notify"):
        notify(ready=True, socket_path=str(tmp_path / "nobody.sock"))


def test_listener_receives_what_notify_sends(tmp_path: Path) -> None:
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stale:
        stale.bind(path)  # left behind by an earlier run

    async def main() -> list[Notice]:
        got: list[Notice] = []
        arrived = asyncio.Event()

        def deliver(n: Notice) -> None:
            got.append(n)
            if n.ready:
                arrived.set()

        listener = NotifyListener(path, deliver)
        await listener.start()
        try:
            notify(status="loading", progress=0.25, socket_path=path)
            notify(ready=True, socket_path=path)
            await asyncio.wait_for(arrived.wait(), 5)
        finally:
            listener.close()
        return got

    got = asyncio.run(main())
    assert [n.progress for n in got] == [0.25, None] and got[1].ready
    assert not Path(path).exists()


def test_listener_never_removes_a_file_that_is_not_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "data.txt"
    path.write_text("precious")

    async def main() -> None:
        await NotifyListener(str(path), lambda n: None).start()

    with pytest.raises(InvalidArgument, match="not a socket"):
        asyncio.run(main())
    assert path.read_text() == "precious"
