"""Talk to the FUSE server over its control socket: the snapshotter's ``LayerMounter``.

>>> client = FuseServerClient("/run/coldstart/fuse.sock")          # doctest: +SKIP
>>> client.mount("/var/lib/coldstart/snapshots/7/fs", spec)        # doctest: +SKIP

Failures come back as the ColdstartError kind the server raised (IntegrityError for a TOC that
does not match its digest, FailedPrecondition for a layer without one, NotFound, …), so the
snapshotter can fall back to a normal pull. Only a server that cannot be reached (no socket,
connection refused or dropped mid-request) is :class:`FuseServerUnreachable`; an ``Unavailable``
that the server forwarded (a registry 503 while opening a TOC) stays a plain ``Unavailable``, so
the snapshotter restarts the server only when it is really gone.

The wire form (requests, replies, errors) is :mod:`coldstart.lazyfs.control`'s; this module adds
the transport: a blocking unix-socket connection per call, with a deadline.
"""

from __future__ import annotations

import socket
from typing import Any

from coldstart.errors import DeadlineExceeded, Unavailable
from coldstart.lazyfs import control
from coldstart.lazyfs.spec import LayerSpec

__all__ = ["FuseServerClient", "FuseServerUnreachable"]


class FuseServerUnreachable(Unavailable):
    """The transport failed: the FUSE server could not be connected to, written to or read
    from (it is not running, or died mid-request). Never sent by the server itself."""


class FuseServerClient:
    """One request per connection; every call has a deadline (``timeout`` seconds)."""

    def __init__(self, socket_path: str, timeout: float = 60.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def _call(self, request: dict[str, Any], timeout: float | None = None) -> Any:
        t = self.timeout if timeout is None else timeout
        what = f"FUSE server at {self.socket_path}"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(t)
                s.connect(self.socket_path)
                s.sendall(control.encode(request))
                lines = control.LineBuffer(max_line=None)   # a status reply may be long
                got: list[bytes] = []
                while not got:
                    data = s.recv(65536)
                    if not data:
                        raise FuseServerUnreachable(f"{what} closed the connection")
                    got = lines.feed(data)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{what}: no answer to {request.get('op')} "
                                   f"within {t:g} s") from exc
        except OSError as exc:
            raise FuseServerUnreachable(f"{what} is not reachable: {exc}") from exc
        try:
            return control.decode_reply(got[0])
        except ValueError as exc:
            raise Unavailable(f"{what} sent a bad reply: {exc}") from exc

    def ping(self) -> dict[str, Any]:
        """The server's pid; FuseServerUnreachable if it does not answer."""
        result: dict[str, Any] = self._call(control.ping_request(), timeout=min(self.timeout, 10.0))
        return result

    def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        """Serve ``spec``'s layer at ``mountpoint`` (an existing empty directory)."""
        self._call(control.mount_request(mountpoint, spec))

    def check(self, mountpoint: str) -> None:
        """Raise unless ``mountpoint`` is mounted and served."""
        self._call(control.check_request(mountpoint))

    def unmount(self, mountpoint: str) -> None:
        """Unmount ``mountpoint`` (NotFound if nothing is mounted there)."""
        self._call(control.unmount_request(mountpoint))

    def status(self) -> list[dict[str, Any]]:
        """Per mountpoint: layer digest, reference, fetched bytes, requests, last error."""
        result: list[dict[str, Any]] = self._call(control.status_request())
        return result

    def record(self, on: bool, mountpoint: str | None = None) -> int:
        """Start or stop recording file accesses of ``mountpoint``'s layer (None: every
        layer, and the layers mounted from now on); how many layers it changed."""
        result: int = self._call(control.record_request(on, mountpoint))
        return result

    def hold(self, seconds: float) -> None:
        """Background work (the fill) waits ``seconds`` as if the node were reading: a
        restore is busy without reading through FUSE."""
        self._call(control.hold_request(seconds), timeout=min(self.timeout, 5.0))

    def profile(self) -> list[dict[str, Any]]:
        """Per layer that recorded: digest, mountpoints and the files read, in order."""
        result: list[dict[str, Any]] = self._call(control.profile_request())
        return result

    def unpack(self, directory: str, spec: LayerSpec, *, lowers: list[str], parent_chain: str,
               chain: str, timeout: float) -> dict[str, Any]:
        """Pull ``spec``'s layer in full into the empty ``directory`` (parallel range
        requests, unpacked as they arrive by containerd's applier's rules), checked against
        ``chain``; what it took."""
        result: dict[str, Any] = self._call(
            control.unpack_request(directory, spec, lowers=lowers, parent_chain=parent_chain,
                                   chain=chain), timeout=timeout)
        return result



# the old name (tests import it): the payload's error, rebuilt
_error = control.error_from_payload
