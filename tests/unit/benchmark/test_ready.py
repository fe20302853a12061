"""Ready conditions and the app's phases, from real datagrams on a real socket (no containers)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coldstart.benchmark.ready import PhaseMarks, ReadyWatch, parse_ready, phase_name
from coldstart.errors import DeadlineExceeded, InvalidArgument, Unavailable
from coldstart.probe.notify import notify, parse_notice


@pytest.mark.parametrize(("text", "kind"), [
    ("exit", "exit"), ("notify", "notify"), ("http://127.0.0.1:8000/infer", "http"),
    ("tcp:127.0.0.1:8000", "tcp"), ("log:listening on \\d+", "log")])
def test_parse_ready(text: str, kind: str) -> None:
    assert parse_ready(text).kind == kind
    assert str(parse_ready(text)) == text


@pytest.mark.parametrize("text", ["", "ready", "log:", "log:([", "tcp://1.2.3.4:5",
                                  "tcp:1.2.3.4", "tcp:1.2.3.4:0", "tcp::80"])
def test_parse_ready_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument, match="--ready"):
        parse_ready(text)


@pytest.mark.parametrize(("datagram", "name"), [
    (b"STATUS=importing", "importing"),
    (b"STATUS=loading 0.42", "loading"),
    (b"STATUS=loading 42%", "loading"),
    (b"STATUS=loading weights\nX_PROGRESS=0.5", "loading weights"),
    (b"X_PHASE=warmup\nSTATUS=warming up the model 3", "warmup"),
    (b"READY=1", None),
    (b"STATUS=", None)])
def test_phase_name_from_notify_lines(datagram: bytes, name: str | None) -> None:
    assert phase_name(parse_notice(datagram)) == name


def test_phase_marks_make_contiguous_phases() -> None:
    marks = PhaseMarks()
    for name, at in [("importing", 2.0), ("importing", 2.5), ("loading", 3.0), (None, 3.2),
                     ("loading", 3.5), ("serving", 6.0)]:
        marks.mark(name, at)
    assert marks.phases(1.5, 7.0) == [("exec", 1.5, 2.0), ("importing", 2.0, 3.0),
                                      ("loading", 3.0, 6.0), ("serving", 6.0, 7.0)]
    assert PhaseMarks().phases(1.0, 2.0) == [("app", 1.0, 2.0)]


def _watch(tmp: Path, cond: str, exited: list[int | None] | Callable[[], int | None]
           ) -> ReadyWatch:
    """A watch on ``tmp``; ``exited``: the exit code so far ([None]: running) or a callable."""
    code = exited if callable(exited) else (lambda: exited[0])
    return ReadyWatch(parse_ready(cond), notify_path=tmp / "n.sock", log_path=tmp / "out.log",
                      exited=code, t0=time.monotonic())


def test_notify_ready_with_phases(tmp_path: Path) -> None:
    with _watch(tmp_path, "notify", [None]) as w:
        sock = str(tmp_path / "n.sock")
        notify(status="importing", socket_path=sock)
        notify(status="loading 0.5", progress=0.5, socket_path=sock)
        notify(ready=True, status="ready", socket_path=sock)
        outcome = w.wait(5)
        assert outcome.exit_code is None
        assert [m[0] for m in w.marks.marks] == ["importing", "loading"]


def test_ready_counts_when_it_was_sent_not_when_it_was_read(tmp_path: Path) -> None:
    """The bench reads the socket only once ``ctr task start`` returns; a restored app may say
    READY=1 before that: the kernel's arrival stamp is the time, not the read's."""
    with _watch(tmp_path, "notify", [None]) as w:
        time.sleep(0.1)
        notify(status="importing", socket_path=str(tmp_path / "n.sock"))
        notify(ready=True, socket_path=str(tmp_path / "n.sock"))
        sent = time.monotonic() - w.t0
        time.sleep(0.4)                                     # busy elsewhere
        outcome = w.wait(5)
        assert 0.1 <= outcome.ready_at <= sent + 0.02, (outcome.ready_at, sent)
        assert w.marks.marks[0][0] == "importing" and w.marks.marks[0][1] <= sent + 0.02


def test_log_condition_and_log_phases(tmp_path: Path) -> None:
    with _watch(tmp_path, "log:^serving on", [None]) as w:
        (tmp_path / "out.log").write_text("coldstart-phase importing\nhello\n"
                                          "coldstart-phase loading\nserving on 8000\n")
        w.wait(5)
        assert [m[0] for m in w.marks.marks] == ["importing", "loading"]


def test_exit_condition(tmp_path: Path) -> None:
    with _watch(tmp_path, "exit", [0]) as w:
        assert w.wait(5).exit_code == 0


def test_exit_before_ready_is_an_error_with_the_output(tmp_path: Path) -> None:
    with _watch(tmp_path, "notify", [3]) as w:
        (tmp_path / "out.log").write_text("Traceback: ModuleNotFoundError: torch\n")
        with pytest.raises(Unavailable, match=r"exited with code 3(.|\n)*ModuleNotFoundError"):
            w.wait(5)
    with _watch(tmp_path, "exit", [1]) as w, pytest.raises(Unavailable, match="code 1"):
        w.wait(5)


def test_not_ready_in_time(tmp_path: Path) -> None:
    with _watch(tmp_path, "notify", [None]) as w, pytest.raises(DeadlineExceeded):
        w.wait(0.2)


def test_http_condition(tmp_path: Path) -> None:
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ok" else 503)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        with _watch(tmp_path, f"http://127.0.0.1:{port}/ok", [None]) as w:
            w.wait(5)
        with _watch(tmp_path, f"http://127.0.0.1:{port}/no", [None]) as w, \
                pytest.raises(DeadlineExceeded):
            w.wait(0.3)
    finally:
        srv.shutdown()


def test_socket_is_datagram_and_removed_on_rebind(tmp_path: Path) -> None:
    (tmp_path / "n.sock").write_text("stale")
    with _watch(tmp_path, "notify", [None]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(b"READY=1", str(tmp_path / "n.sock"))
        s.close()


def test_ready_then_exit_counts_as_ready(tmp_path: Path) -> None:
    # containerd's exit event can overtake the app's last datagram or output line: the exit is
    # seen first (the callable below sends READY=1 as it reports the exit), READY still counts
    sock = str(tmp_path / "n.sock")

    def exits_after_notifying() -> int:
        notify(ready=True, socket_path=sock)
        return 0

    with _watch(tmp_path, "notify", exits_after_notifying) as w:
        assert w.wait(5).exit_code == 0

    def exits_after_printing() -> int:
        (tmp_path / "out.log").write_text("work\ndone\n")
        return 0

    with _watch(tmp_path, "log:^done$", exits_after_printing) as w:
        assert w.wait(5).exit_code == 0


def test_notify_phases_win_over_log_phase_lines(tmp_path: Path) -> None:
    with _watch(tmp_path, "notify", [None]) as w:
        sock = str(tmp_path / "n.sock")
        notify(status="importing", socket_path=sock)
        notify(status="loading", socket_path=sock)
        time.sleep(0.05)
        (tmp_path / "out.log").write_text("coldstart-phase importing\ncoldstart-phase loading\n")
        time.sleep(0.05)
        notify(ready=True, socket_path=sock)
        w.wait(5)
        assert [m[0] for m in w.marks.marks] == ["importing", "loading"]


def test_a_status_sent_with_ready_is_not_a_phase() -> None:
    marks = PhaseMarks()
    marks.mark("loading", 2.0)
    marks.mark("ready", 5.0)
    assert marks.phases(1.0, 5.0) == [("exec", 1.0, 2.0), ("loading", 2.0, 5.0)]


def test_the_status_sent_with_ready_starts_no_phase(tmp_path: Path) -> None:
    with _watch(tmp_path, "notify", [None]) as w:
        notify(status="loading", socket_path=str(tmp_path / "n.sock"))
        notify(ready=True, status="ready", socket_path=str(tmp_path / "n.sock"))
        w.wait(5)
        assert [m[0] for m in w.marks.marks] == ["loading"]


def test_tcp_ready_once_the_port_accepts(tmp_path: Path) -> None:
    import socket
    import threading

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    def listen_later() -> None:
        time.sleep(0.3)
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen()
        time.sleep(2.0)
        srv.close()

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        with _watch(tmp_path, f"tcp:127.0.0.1:{port}", [None]) as watch:
            assert parse_ready(f"tcp:127.0.0.1:{port}").needs_host_network
            outcome = watch.wait(10.0)
        assert outcome.ready_at >= 0.25
    finally:
        t.join()
