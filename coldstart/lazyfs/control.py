"""The FUSE server's control protocol, both sides of it: framing, ops, shapes, errors, dispatch.

The gRPC snapshotter (through :mod:`coldstart.lazyfs.client`) and the FUSE server (through
:mod:`coldstart.lazyfs.server`) meet only here and at the layer spec. One JSON object per line
(UTF-8, ``\\n``-terminated), one request per connection in practice, any number allowed; blank
lines are skipped; a request line over :data:`MAX_LINE` bytes ends the connection with an
``InvalidArgument`` reply::

    {"op": "ping"}                                        -> {"ok": true, "result": {"pid": …}}
    {"op": "mount", "mountpoint": P, "spec": {…}[,
     "image_layers": [D, …]]}                             -> {"ok": true, "result": null}
    {"op": "check", "mountpoint": P}                      -> {"ok": true, "result": null}
    {"op": "unmount", "mountpoint": P}                    -> {"ok": true, "result": null}
    {"op": "status"}                                      -> {"ok": true, "result": [{…}, …]}
    {"op": "record", "on": B, "mountpoint": P | null}     -> {"ok": true, "result": N}
    {"op": "profile"}                                     -> {"ok": true, "result": [{…}, …]}
    {"op": "hold", "seconds": S}                          -> {"ok": true, "result": null}
    {"op": "unpack", "dir": D, "spec": {…}, "lowers": [L, …],
     "parent_chain": C, "chain": C}                       -> {"ok": true, "result": {…}}
    failure:  {"ok": false, "error": {"kind": "IntegrityError",
                                      "kinds": ["IntegrityError", "ColdstartError"], "message": …}}

``P`` is an absolute path (normalized by the server); ``spec`` is a
:class:`~coldstart.lazyfs.spec.LayerSpec`'s JSON object. An error travels as its kind and the
kinds it derives from, most specific first, so a reader that does not know a new kind (a server
newer than its client) rebuilds its nearest known base: :func:`error_payload` and
:func:`error_from_payload` are each other's inverse. The wire form is frozen: snapshotters and FUSE
servers of different versions talk to each other across an upgrade.

This module does no I/O and does not import trio (the snapshotter imports it): the
server's trio loop feeds received bytes to a :class:`LineBuffer` and hands each line to
:func:`dispatch`, which calls a :class:`ControlHandler`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Protocol

from coldstart import errors
from coldstart.errors import ColdstartError, InvalidArgument
from coldstart.lazyfs.spec import LayerSpec, digest_list

__all__ = [
    "CHECK",
    "MAX_LINE",
    "MOUNT",
    "OPS",
    "PING",
    "PROFILE",
    "RECORD",
    "STATUS",
    "UNMOUNT",
    "UNPACK",
    "ControlHandler",
    "LineBuffer",
    "check_request",
    "decode_reply",
    "dispatch",
    "encode",
    "error_from_payload",
    "error_payload",
    "error_reply",
    "mount_request",
    "ok_reply",
    "ping_request",
    "profile_request",
    "record_request",
    "status_request",
    "unmount_request",
    "unpack_request",
]

log = logging.getLogger(__name__)

#: longest request line the server reads (a layer spec with its annotations is a few KiB)
MAX_LINE = 1 << 20

PING = "ping"
MOUNT = "mount"
CHECK = "check"
UNMOUNT = "unmount"
STATUS = "status"
RECORD = "record"      # start/stop recording file accesses (one mountpoint's layer, or all)
PROFILE = "profile"    # what each recording layer read so far
UNPACK = "unpack"      # pull a layer in full into a directory (parallel fetch, unpacked)
HOLD = "hold"          # background work (the fill) waits: the node is busy with a restore
#: the longest one ``hold`` lasts
MAX_HOLD = 600.0
OPS = (PING, MOUNT, CHECK, UNMOUNT, STATUS, RECORD, PROFILE, UNPACK, HOLD)


# -- framing -------------------------------------------------------------------------------

def encode(message: dict[str, Any]) -> bytes:
    """One message as its wire line (requests and replies alike)."""
    return json.dumps(message).encode() + b"\n"


class LineBuffer:
    """Split a byte stream into lines: ``feed(data)`` returns the complete, non-blank ones.

    ``max_line`` (None: no limit) bounds a line, and what may pile up without a newline: beyond
    it :meth:`feed` raises InvalidArgument (however the stream was cut into reads), and the
    connection is beyond repair.

    >>> b = LineBuffer()
    >>> b.feed(b'{"op": "ping"}\\n\\n{"op"'), b.feed(b': "status"}\\n')
    ([b'{"op": "ping"}'], [b'{"op": "status"}'])
    """

    def __init__(self, max_line: int | None = MAX_LINE) -> None:
        self.max_line = max_line
        self._buf = b""

    @property
    def pending(self) -> bool:
        """Whether part of a line is waiting for its end."""
        return bool(self._buf)

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        limit = self.max_line
        if limit is not None and (len(self._buf) > limit or any(len(x) > limit for x in lines)):
            raise InvalidArgument("request line too long")
        return [line for line in lines if line.strip()]


# -- requests (client side) ----------------------------------------------------------------

def ping_request() -> dict[str, Any]:
    return {"op": PING}


def mount_request(mountpoint: str, spec: LayerSpec) -> dict[str, Any]:
    req = {"op": MOUNT, "mountpoint": mountpoint, "spec": json.loads(spec.to_json())}
    if spec.image_layers:
        # beside the spec, not in it: an older server ignores a key it does not know
        req["image_layers"] = list(spec.image_layers)
    return req


def check_request(mountpoint: str) -> dict[str, Any]:
    return {"op": CHECK, "mountpoint": mountpoint}


def unmount_request(mountpoint: str) -> dict[str, Any]:
    return {"op": UNMOUNT, "mountpoint": mountpoint}


def status_request() -> dict[str, Any]:
    return {"op": STATUS}


def record_request(on: bool, mountpoint: str | None = None) -> dict[str, Any]:
    return {"op": RECORD, "on": on, "mountpoint": mountpoint}


def profile_request() -> dict[str, Any]:
    return {"op": PROFILE}


def hold_request(seconds: float) -> dict[str, Any]:
    return {"op": HOLD, "seconds": seconds}


def unpack_request(directory: str, spec: LayerSpec, *, lowers: list[str], parent_chain: str,
                   chain: str) -> dict[str, Any]:
    return {"op": UNPACK, "dir": directory, "spec": json.loads(spec.to_json()),
            "lowers": lowers, "parent_chain": parent_chain, "chain": chain}


# -- replies and errors --------------------------------------------------------------------

def error_payload(exc: BaseException) -> dict[str, Any]:
    """The wire form of an error: its kind, the kinds it derives from, its message.

    >>> error_payload(errors.NotFound("no layer"))["kinds"]
    ['NotFound', 'ColdstartError']
    """
    kinds = [c.__name__ for c in type(exc).__mro__
             if issubclass(c, ColdstartError)] or ["ColdstartError"]
    return {"kind": kinds[0], "kinds": kinds, "message": str(exc)}


def error_from_payload(payload: dict[str, Any]) -> ColdstartError:
    """The inverse of :func:`error_payload`: the first kind of ``kinds`` that
    :mod:`coldstart.errors` knows, with the message (ColdstartError if none is known).

    >>> error_from_payload({"kinds": ["AuthError", "FailedPrecondition"], "message": "no"})
    FailedPrecondition('no')
    """
    message = str(payload.get("message", "FUSE server error"))
    kinds = payload.get("kinds")
    if not kinds or not isinstance(kinds, list):
        kinds = [payload.get("kind", "ColdstartError")]
    for kind in kinds:
        cls = getattr(errors, str(kind), None)
        if isinstance(cls, type) and issubclass(cls, ColdstartError):
            return cls(message)
    return ColdstartError(message)


def ok_reply(result: Any = None) -> bytes:
    return encode({"ok": True, "result": result})


def error_reply(exc: BaseException, **extra: Any) -> bytes:
    """A failure reply; ``extra``: keys beside ``error`` (readers ignore the ones they do not
    know)."""
    return encode({"ok": False, "error": error_payload(exc), **extra})


def decode_reply(line: bytes) -> Any:
    """A reply line's result; raises the error it carries (:func:`error_from_payload`), or
    ValueError if the line is not a reply at all."""
    reply = _loads(line)
    if not isinstance(reply, dict):
        raise ValueError("the reply is not a JSON object")
    if reply.get("ok"):
        return reply.get("result")
    error = reply.get("error") or {}
    if not isinstance(error, dict):
        raise ValueError("the reply's error is not a JSON object")
    raise error_from_payload(error)


def _loads(line: bytes) -> Any:
    """``json.loads``, with nesting too deep for the interpreter's stack a ValueError too."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# -- dispatch (server side) ----------------------------------------------------------------

class ControlHandler(Protocol):
    """What :func:`dispatch` calls: the FUSE server's operations, one per op.

    ``mountpoint`` arrives absolute and normalized. :meth:`ready` is awaited before every op but
    ``ping``, so that those answer from the restored mount table, while ``ping`` answers at once
    (a snapshotter waiting for a restarting server sees it alive)."""

    async def ready(self) -> None: ...

    async def ping(self) -> dict[str, Any]: ...

    async def mount(self, mountpoint: str, spec: LayerSpec) -> None: ...

    async def check(self, mountpoint: str) -> None: ...

    async def unmount(self, mountpoint: str) -> None: ...

    def status(self) -> list[dict[str, Any]]: ...

    def record(self, on: bool, mountpoint: str | None) -> int: ...

    def profile(self) -> list[dict[str, Any]]: ...

    def hold(self, seconds: float) -> None: ...

    async def unpack(self, directory: str, spec: LayerSpec, lowers: list[str],
                     parent_chain: str, chain: str) -> dict[str, Any]: ...


async def dispatch(line: bytes, handler: ControlHandler) -> bytes:
    """Answer one request line: the reply line, never an exception.

    Expected failures go back as their kind; a malformed request as InvalidArgument; anything
    else is logged here and goes back as a plain ColdstartError (``internal error: …``)."""
    try:
        req = _loads(line)
        if not isinstance(req, dict):
            raise InvalidArgument("request must be a JSON object")
        op = req.get("op")
        result: Any = None
        if op != PING:
            await handler.ready()
        if op == PING:
            result = await handler.ping()
        elif op == MOUNT:
            spec = LayerSpec.from_json(json.dumps(req.get("spec")))
            if req.get("image_layers") is not None:
                spec = dataclasses.replace(
                    spec, image_layers=digest_list(req["image_layers"], "'image_layers'"))
            await handler.mount(_mountpoint(req), spec)
        elif op == UNMOUNT:
            await handler.unmount(_mountpoint(req))
        elif op == CHECK:
            await handler.check(_mountpoint(req))
        elif op == STATUS:
            result = handler.status()
        elif op == RECORD:
            on = req.get("on")
            if not isinstance(on, bool):
                raise InvalidArgument(f"'on' must be true or false, not {on!r}")
            mp = _mountpoint(req) if req.get("mountpoint") is not None else None
            result = handler.record(on, mp)
        elif op == PROFILE:
            result = handler.profile()
        elif op == HOLD:
            seconds = req.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or \
                    not 0 <= seconds <= MAX_HOLD:
                raise InvalidArgument(f"'seconds' must be a number from 0 to {MAX_HOLD:g}, "
                                      f"not {seconds!r}")
            handler.hold(float(seconds))
        elif op == UNPACK:
            spec = LayerSpec.from_json(json.dumps(req.get("spec")))
            lowers = req.get("lowers")
            if not isinstance(lowers, list) or not all(
                    isinstance(x, str) and os.path.isabs(x) for x in lowers):
                raise InvalidArgument("'lowers' must be a list of absolute paths")
            parent_chain, chain = req.get("parent_chain"), req.get("chain")
            if not isinstance(parent_chain, str) or not isinstance(chain, str):
                raise InvalidArgument("'parent_chain' and 'chain' must be strings")
            result = await handler.unpack(_path(req, "dir"), spec, lowers, parent_chain, chain)
        else:
            raise InvalidArgument(f"unknown op {op!r}")
    except ColdstartError as exc:
        return error_reply(exc)
    except ValueError as exc:
        return error_reply(InvalidArgument(f"bad request: {exc}"))
    except Exception as exc:
        log.exception("control request failed")
        return error_reply(ColdstartError(f"internal error: {exc}"))
    return ok_reply(result)


def _mountpoint(req: dict[str, Any]) -> str:
    return _path(req, "mountpoint")


def _path(req: dict[str, Any], key: str) -> str:
    mp = req.get(key)
    if not isinstance(mp, str) or not os.path.isabs(mp):
        raise InvalidArgument(f"{key} must be an absolute path, not {mp!r}")
    return os.path.normpath(mp)
