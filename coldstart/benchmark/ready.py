"""When a benchmarked container is ready, and the phases its app reports on the way.

:func:`parse_ready` reads the ``--ready`` condition:

- ``exit``: the command exits with code 0 (a batch start-up such as ``python -c "import torch"``);
- ``notify``: ``READY=1`` on ``$NOTIFY_SOCKET`` (systemd's ``sd_notify``; ``coldstart.probe.notify``
  and ``coldstart probe`` speak it); ``STATUS=`` / ``X_PHASE=`` before it name the app's phases;
- ``http://HOST:PORT/PATH``: a GET answers 200 (the container shares the host's network);
- ``log:REGEX``: a line of the container's output matches.

:class:`PhaseMarks` turns the notices (or ``coldstart-phase NAME`` lines in the output) into
named phases; :class:`ReadyWatch` waits for the condition, watching the notify socket, the
output file, containerd's exit event and the URL at once, and fails fast when the app exits
before it is ready.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.errors import DeadlineExceeded, InvalidArgument, Unavailable
from coldstart.probe.notify import MAX_DATAGRAM, parse_notice
from coldstart.probe.states import Notice

__all__ = ["CONDITIONS_HELP", "PhaseMarks", "ReadyCondition", "ReadyWatch", "parse_ready",
           "phase_name"]

#: the --ready conditions as the commands' help lists them
CONDITIONS_HELP = """\
  exit               the command exits with code 0
  notify             READY=1 on $NOTIFY_SOCKET (sd_notify; STATUS=/X_PHASE= name phases)
  http://H:P/PATH    a GET answers 200 (the container uses the host's network)
  tcp:HOST:PORT      the port accepts a connection (the host's network too)
  log:REGEX          a line of its output matches
"""

LOG_PHASE = re.compile(rb"^coldstart-phase (\S+)", re.MULTILINE)
#: SO_TIMESTAMPNS (asm-generic/socket.h): the kernel's arrival time of each datagram
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TRAILING_NUMBERS = re.compile(r"(\s+[-+]?[\d.]+%?)+$")


@dataclass(frozen=True)
class ReadyCondition:
    kind: str            # exit | notify | http | tcp | log
    url: str = ""        # http: the URL; tcp: HOST:PORT
    pattern: str = ""

    @property
    def needs_host_network(self) -> bool:
        return self.kind in ("http", "tcp")

    def __str__(self) -> str:
        if self.kind == "http":
            return self.url
        if self.kind == "tcp":
            return f"tcp:{self.url}"
        if self.kind == "log":
            return f"log:{self.pattern}"
        return self.kind


def parse_ready(text: str) -> ReadyCondition:
    """``exit``, ``notify``, ``http(s)://…``, ``tcp:HOST:PORT`` (the port accepts a
    connection) or ``log:REGEX``.

    >>> parse_ready("log:listening on").pattern
    'listening on'
    >>> str(parse_ready("tcp:127.0.0.1:8000"))
    'tcp:127.0.0.1:8000'
    """
    text = text.strip()
    if text in ("exit", "notify"):
        return ReadyCondition(text)
    if text.startswith(("http://", "https://")):
        return ReadyCondition("http", url=text)
    if text.startswith("tcp:"):
        host, sep, port = text[4:].rpartition(":")
        if (not sep or not host or "/" in host or not port.isdigit()
                or not 0 < int(port) < 65536):
            raise InvalidArgument(f"--ready {text!r}: expected tcp:HOST:PORT")
        return ReadyCondition("tcp", url=f"{host}:{port}")
    if text.startswith("log:") and len(text) > 4:
        try:
            re.compile(text[4:])
        except re.error as exc:
            raise InvalidArgument(f"--ready {text!r}: bad regular expression: {exc}") from exc
        return ReadyCondition("log", pattern=text[4:])
    raise InvalidArgument(f"--ready {text!r}: expected exit, notify, http://HOST:PORT/PATH, "
                          "tcp:HOST:PORT or log:REGEX")


def phase_name(notice: Notice) -> str | None:
    """The phase a notice names: ``X_PHASE`` if set, else ``STATUS`` without trailing numbers
    (``STATUS=loading 0.42`` is the phase ``loading``); None if it names none."""
    if notice.phase:
        return notice.phase.strip() or None
    if notice.status:
        name = _TRAILING_NUMBERS.sub("", notice.status.strip())
        return name or None
    return None


@dataclass
class PhaseMarks:
    """Phase starts in the order the app reported them: ``(name, seconds after t0)``."""

    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, name: str | None, at: float) -> None:
        if name and (not self.marks or self.marks[-1][0] != name):
            self.marks.append((name, at))

    def phases(self, started: float, ready: float) -> list[tuple[str, float, float]]:
        """The app's phases from ``started`` (the process runs) to ``ready``: ``exec`` until
        the first mark, then each mark until the next; ``app`` when there are no marks."""
        marks = [(n, min(max(t, started), ready)) for n, t in self.marks]
        if not marks:
            return [("app", started, ready)]
        out: list[tuple[str, float, float]] = []
        if marks[0][1] > started:
            out.append(("exec", started, marks[0][1]))
        for (name, t), nxt in zip(marks, [*marks[1:], ("", ready)], strict=True):
            # a phase reported twice (importing, loading, importing) keeps both spans
            out.append((f"app:{name}" if name in ("exec", "app") else name, t, nxt[1]))
        if len(out) > 1 and out[-1][1] >= ready:   # "STATUS=ready" sent with READY=1
            out.pop()
        return out


@dataclass
class ReadyOutcome:
    ready_at: float        # seconds after t0
    exit_code: int | None  # set when the process exited (the ``exit`` condition, or early)


class ReadyWatch:
    """Waits for a :class:`ReadyCondition`; one per run.

    ``notify_path``: the datagram socket bound here (the container sees it through a bind
    mount); ``log_path``: the file the container's output goes to; ``exited()`` returns the
    exit code once containerd reports the task's exit (None before)."""

    def __init__(self, cond: ReadyCondition, *, notify_path: Path, log_path: Path,
                 exited: Callable[[], int | None], t0: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cond, self.log_path, self.exited, self.t0 = cond, log_path, exited, t0
        self.clock = clock
        self.marks = PhaseMarks()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            notify_path.unlink()
        self._sock.bind(str(notify_path))
        os.chmod(notify_path, 0o777)
        self._sock.setblocking(False)
        # each datagram stamped by the kernel as it arrives: READY counts when the app said
        # it, not when this watch (busy with `ctr task start` meanwhile) reads it
        self._sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        self._ready_at: float | None = None
        self._log_pos = 0
        self._notified_phase = False
        self._log_tail = b""
        self._pattern = (re.compile(cond.pattern.encode(), re.MULTILINE)
                         if cond.kind == "log" else None)
        self._next_http = 0.0

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ReadyWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _now(self) -> float:
        return self.clock() - self.t0

    def _read_notices(self) -> bool:
        """Drain the socket; True once READY=1 came."""
        ready = False
        while True:
            try:
                data, anc, _, _ = self._sock.recvmsg(MAX_DATAGRAM, socket.CMSG_SPACE(16))
            except BlockingIOError:
                return ready
            at = self._now()
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(payload) >= 16:
                    sec, nsec = struct.unpack_from("@qq", payload)
                    at = max(0.0, at - max(0.0, time.time() - (sec + nsec / 1e9)))
            notice = parse_notice(data)
            # the STATUS sent with READY=1 ("ready") ends the phases, it does not start one
            name = None if notice.ready else phase_name(notice)
            if name:
                self._notified_phase = True
            self.marks.mark(name, at)
            if notice.ready and self._ready_at is None:
                self._ready_at = at
            ready = ready or notice.ready

    def _read_log(self) -> bool:
        """New output: phase lines, and True when the log condition's pattern matched."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                new = f.read()
        except FileNotFoundError:
            return False
        if not new:
            return False
        self._log_pos += len(new)
        text = self._log_tail + new
        complete, _, self._log_tail = text.rpartition(b"\n")
        if not self._notified_phase:   # an app that sends phases on both: the socket's win
            for m in LOG_PHASE.finditer(complete):
                self.marks.mark(m.group(1).decode(errors="replace"), self._now())
        return bool(self._pattern is not None and self._pattern.search(complete))

    def _tcp_ok(self) -> bool:
        import socket

        now = self.clock()
        if now < self._next_http:
            return False
        self._next_http = now + 0.01
        host, _, port = self.cond.url.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
                return True
        except OSError:
            return False

    def _http_ok(self) -> bool:
        import httpx

        now = self.clock()
        if now < self._next_http:
            return False
        self._next_http = now + 0.01
        try:
            return httpx.get(self.cond.url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def output_tail(self, n: int = 1500) -> str:
        try:
            data = self.log_path.read_bytes()[-n:]
        except FileNotFoundError:
            return ""
        return data.decode(errors="replace").strip()

    def wait(self, timeout: float) -> ReadyOutcome:
        """Block until ready; :class:`Unavailable` if the app exits first (or exits non-zero
        under ``exit``), :class:`DeadlineExceeded` after ``timeout`` seconds."""
        deadline = self.clock() + timeout
        kind = self.cond.kind
        while True:
            readable, _, _ = select.select([self._sock], [], [], 0.005)
            notified = self._read_notices() if readable else False
            logged = self._read_log()
            if kind == "notify" and notified and self._ready_at is not None:
                return ReadyOutcome(self._ready_at, None)
            if ((kind == "notify" and notified) or (kind == "log" and logged)
                    or (kind == "http" and self._http_ok())
                    or (kind == "tcp" and self._tcp_ok())):
                return ReadyOutcome(self._now(), None)
            code = self.exited()
            if code is not None:
                at = self._now()
                # the exit can overtake the last datagrams and output lines: read them first
                time.sleep(0.05)
                notified = self._read_notices()
                logged = self._read_log()
                if kind == "notify" and notified and self._ready_at is not None:
                    return ReadyOutcome(self._ready_at, code)
                if ((kind == "exit" and code == 0) or (kind == "notify" and notified)
                        or (kind == "log" and logged)):
                    return ReadyOutcome(at, code)
                raise Unavailable(f"the container exited with code {code} before it was "
                                  f"ready ({self.cond}); its output ends:\n"
                                  f"{self.output_tail()}")
            if self.clock() > deadline:
                raise DeadlineExceeded(f"not ready ({self.cond}) after {timeout:.0f} s; "
                                       f"its output ends:\n{self.output_tail()}")
