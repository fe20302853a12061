"""The FUSE descriptor holder: a tiny process that keeps the FUSE server's ``/dev/fuse``
connection open while the server itself dies or is replaced.

The kernel aborts a FUSE connection (every running container then reads "Transport endpoint
is not connected") when the last descriptor of its ``/dev/fuse`` file closes. The FUSE server
hands a copy of its descriptor to this process (``SCM_RIGHTS`` over a unix socket), so a
``kill -9`` of the server closes only one of two; the next server takes the copy back and
serves the same connection (:mod:`coldstart.lazyfs.handover`). Reads wait in the kernel
meanwhile; none fails.

Protocol, one request per connection (the socket is ``0600``, in the server's ``0700`` root):
``PUT`` with a descriptor (kept; a previous one is closed), ``GET`` (answered ``FD`` with the
descriptor, or ``NO``), ``DROP`` (close it and exit). The holder exits by itself once the
connection is gone (unmounted or aborted: the descriptor then polls ``POLLERR``).

Run as ``python -m coldstart.lazyfs.holder SOCKET``: it imports nothing of coldstart, so it
stays a few MB and never needs a restart for an upgrade.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys

__all__ = ["main"]

#: the largest request line
_MAX = 16


def _serve(listener: socket.socket) -> None:
    held: int | None = None
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    while True:
        for fd, events in poller.poll():
            if fd != listener.fileno():
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    return                  # the connection is gone: nothing left to hold
                continue
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5.0)
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _MAX, 1)
                except OSError:
                    continue
                if msg.startswith(b"PUT") and fds:
                    if held is not None:
                        poller.unregister(held)
                        os.close(held)
                    held = fds[0]
                    # no events asked: poll still reports the connection's end (POLLERR)
                    poller.register(held, 0)
                    with contextlib.suppress(OSError):
                        conn.sendall(b"OK")
                    continue
                for extra in fds:
                    os.close(extra)
                with contextlib.suppress(OSError):
                    if msg.startswith(b"GET"):
                        if held is None:
                            conn.sendall(b"NO")
                        else:
                            socket.send_fds(conn, [b"FD"], [held])
                    elif msg.startswith(b"DROP"):
                        conn.sendall(b"OK")
                        return
                    else:
                        conn.sendall(b"??")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m coldstart.lazyfs.holder SOCKET", file=sys.stderr)
        return 2
    path = argv[0]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
        ino = os.stat(path).st_ino
    finally:
        os.umask(old)
    listener.listen(8)
    print("ready", flush=True)
    try:
        _serve(listener)
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == ino:     # ours, not a successor's
                os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
