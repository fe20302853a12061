"""The control protocol without a server: wire form, errors both ways, framing, dispatch."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import trio
import trio.testing

from coldstart import errors
from coldstart.lazyfs import control
from coldstart.lazyfs.server import serve_connection
from coldstart.lazyfs.spec import LayerSpec

KINDS = [errors.ColdstartError, errors.NotFound, errors.AlreadyExists, errors.FailedPrecondition,
         errors.InvalidArgument, errors.Unavailable, errors.DeadlineExceeded,
         errors.IntegrityError, errors.FormatError]
SPEC = LayerSpec(reference="registry.test/lazy/x:v1", digest="sha256:" + "ab" * 32, size=123,
                 annotations={"k": "v"})


# -- wire form: frozen, older and newer peers read it ---------------------------------------

def test_requests_and_replies_keep_their_bytes() -> None:
    assert control.encode(control.ping_request()) == b'{"op": "ping"}\n'
    assert control.encode(control.status_request()) == b'{"op": "status"}\n'
    assert (control.encode(control.check_request("/mp"))
            == b'{"op": "check", "mountpoint": "/mp"}\n')
    assert (control.encode(control.unmount_request("/mp"))
            == b'{"op": "unmount", "mountpoint": "/mp"}\n')
    spec = LayerSpec(reference="r.test/x:1", digest="sha256:aa")
    assert control.encode(control.mount_request("/mp", spec)) == (
        b'{"op": "mount", "mountpoint": "/mp", "spec": {"annotations": {}, "digest": '
        b'"sha256:aa", "manifest_digest": "", "media_type": "", "reference": "r.test/x:1", '
        b'"size": -1}}\n')
    # an image's later layers travel beside the spec, which keeps its bytes (older servers
    # ignore the key), and only when there are some
    spec = LayerSpec(reference="r.test/x:1", digest="sha256:aa",
                     image_layers=["sha256:aa", "sha256:bb"])
    assert control.encode(control.mount_request("/mp", spec)) == (
        b'{"op": "mount", "mountpoint": "/mp", "spec": {"annotations": {}, "digest": '
        b'"sha256:aa", "manifest_digest": "", "media_type": "", "reference": "r.test/x:1", '
        b'"size": -1}, "image_layers": ["sha256:aa", "sha256:bb"]}\n')
    # and a newer peer's spec fields are left out, not refused
    assert LayerSpec.from_json(b'{"reference": "r", "digest": "d", "later": 1}') == LayerSpec(
        reference="r", digest="d")
    assert control.ok_reply() == b'{"ok": true, "result": null}\n'
    assert control.error_reply(errors.NotFound("x")) == (
        b'{"ok": false, "error": {"kind": "NotFound", "kinds": ["NotFound", "ColdstartError"], '
        b'"message": "x"}}\n')


# -- errors: payload and back --------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_each_error_kind_round_trips(kind: type[errors.ColdstartError]) -> None:
    payload = control.error_payload(kind("it broke: «détail»"))
    mro = [c.__name__ for c in kind.__mro__ if issubclass(c, errors.ColdstartError)]
    assert payload == {"kind": kind.__name__, "kinds": mro, "message": "it broke: «détail»"}
    back = control.error_from_payload(json.loads(json.dumps(payload)))
    assert type(back) is kind and str(back) == "it broke: «détail»"
    with pytest.raises(kind, match="it broke"):
        control.decode_reply(control.error_reply(kind("it broke")).rstrip(b"\n"))


def test_an_unknown_kind_comes_back_as_its_nearest_known_base() -> None:
    class AuthError(errors.FailedPrecondition):
        pass

    payload = control.error_payload(AuthError("denied"))
    assert payload["kinds"] == ["AuthError", "FailedPrecondition", "ColdstartError"]
    back = control.error_from_payload(payload)
    assert type(back) is errors.FailedPrecondition and str(back) == "denied"


def test_payloads_of_older_or_odd_peers() -> None:
    # an old server sent only "kind"; a non-ColdstartError raised is a plain ColdstartError
    assert type(control.error_from_payload({"kind": "NotFound", "message": "m"})) is \
        errors.NotFound
    assert type(control.error_from_payload({"kinds": ["Exception", "os"]})) is \
        errors.ColdstartError
    assert str(control.error_from_payload({})) == "FUSE server error"
    assert control.error_payload(RuntimeError("boom"))["kinds"] == ["ColdstartError"]


def test_a_reply_that_is_not_one_is_a_value_error() -> None:
    assert control.decode_reply(b'{"ok": true, "result": [1]}') == [1]
    for line in (b"not json", b"[1, 2]", b"\xff"):
        with pytest.raises(ValueError):
            control.decode_reply(line)


# -- framing -------------------------------------------------------------------------------

def test_lines_split_across_reads_and_blank_lines_skipped() -> None:
    b = control.LineBuffer()
    assert b.feed(b'{"op": "pi') == []
    assert b.feed(b'ng"}\n\n  \n{"op": "status"}\n{"op"') == [b'{"op": "ping"}',
                                                            b'{"op": "status"}']
    assert b.feed(b": 1}\n") == [b'{"op": 1}']


def test_an_over_long_line_is_refused() -> None:
    b = control.LineBuffer(max_line=16)
    assert b.feed(b"x" * 16) == []
    with pytest.raises(errors.InvalidArgument, match="too long"):
        b.feed(b"x")
    # a long stream is fine while lines end
    ok = control.LineBuffer(max_line=16)
    assert ok.feed(b"a" * 10 + b"\n" + b"b" * 10 + b"\n") == [b"a" * 10, b"b" * 10]
    assert control.LineBuffer(max_line=None).feed(b"y" * (2 * control.MAX_LINE)) == []


# -- dispatch ------------------------------------------------------------------------------

class FakeHandler:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail
        self.is_ready = False

    async def ready(self) -> None:
        self.calls.append(("ready", None))
        self.is_ready = True

    async def ping(self) -> dict[str, Any]:
        self.calls.append(("ping", None))
        return {"pid": 42}

    async def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        self._call("mount", (mountpoint, spec))

    async def check(self, mountpoint: str) -> None:
        self._call("check", mountpoint)

    async def unmount(self, mountpoint: str) -> None:
        self._call("unmount", mountpoint)

    def status(self) -> list[dict[str, Any]]:
        self._call("status", None)
        return [{"mountpoint": "/mp"}]

    def _call(self, op: str, arg: Any) -> None:
        assert self.is_ready, f"{op} before ready"
        self.calls.append((op, arg))
        if self.fail is not None:
            raise self.fail


def answer(line: bytes, handler: FakeHandler | None = None) -> dict[str, Any]:
    reply: bytes = trio.run(control.dispatch, line, handler or FakeHandler())
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1
    out: dict[str, Any] = json.loads(reply)
    return out


def error_of(line: bytes, handler: FakeHandler | None = None) -> dict[str, Any]:
    reply = answer(line, handler)
    assert reply["ok"] is False
    err: dict[str, Any] = reply["error"]
    return err


def test_each_op_reaches_its_handler_method() -> None:
    h = FakeHandler()
    assert answer(b'{"op": "ping"}', h) == {"ok": True, "result": {"pid": 42}}
    assert h.calls == [("ping", None)]     # ping does not wait for the restore
    mount = control.encode(control.mount_request("/a/./b/../mp", SPEC))
    assert answer(mount, h) == {"ok": True, "result": None}
    assert answer(b'{"op": "check", "mountpoint": "/mp/"}', h)["ok"]
    assert answer(b'{"op": "unmount", "mountpoint": "//mp"}', h)["ok"]
    assert answer(b'{"op": "status"}', h) == {"ok": True, "result": [{"mountpoint": "/mp"}]}
    ops = [(op, arg) for op, arg in h.calls if op != "ready"]
    assert ops == [("ping", None), ("mount", ("/a/mp", SPEC)), ("check", "/mp"),
                   ("unmount", "//mp"), ("status", None)]   # normpath keeps a leading "//"
    assert [op for op, _ in h.calls].count("ready") == 4
    # the image's later layers reach the handler on the spec
    later = LayerSpec(**{**SPEC.__dict__, "image_layers": [SPEC.digest, "sha256:bb"]})
    assert answer(control.encode(control.mount_request("/mp2", later)), h)["ok"]
    assert h.calls[-1][1][1].image_layers == [SPEC.digest, "sha256:bb"]


def test_malformed_json_is_invalid_argument() -> None:
    for line in (b"{not json", b"\xff\xfe", b'{"op": "ping"'):
        err = error_of(line)
        assert err["kind"] == "InvalidArgument" and err["message"].startswith("bad request:")
    err = error_of(b'["op", "ping"]')
    assert err["kind"] == "InvalidArgument" and "JSON object" in err["message"]


def test_an_unknown_op_is_invalid_argument() -> None:
    for line, shown in ((b'{"op": "format-disk"}', "'format-disk'"), (b'{}', "None"),
                        (b'{"op": 7}', "7")):
        err = error_of(line)
        assert err == {"kind": "InvalidArgument", "kinds": ["InvalidArgument", "ColdstartError"],
                       "message": f"unknown op {shown}"}


def test_bad_arguments_are_invalid_argument() -> None:
    h = FakeHandler()
    for line in (b'{"op": "check", "mountpoint": "relative/mp"}', b'{"op": "unmount"}',
                 b'{"op": "mount", "mountpoint": "/mp", "spec": {"nope": 1}}',
                 b'{"op": "mount", "mountpoint": 5, "spec": ' +
                 SPEC.to_json().encode() + b"}"):
        assert error_of(line, h)["kind"] == "InvalidArgument", line
    assert [op for op, _ in h.calls if op != "ready"] == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_handler_error_travels_as_its_kind(kind: type[errors.ColdstartError]) -> None:
    err = error_of(b'{"op": "check", "mountpoint": "/mp"}', FakeHandler(kind("no")))
    assert err["kind"] == kind.__name__ and err["message"] == "no"


def test_an_unexpected_handler_error_is_an_internal_error() -> None:
    err = error_of(b'{"op": "status"}', FakeHandler(RuntimeError("bug")))
    assert err == {"kind": "ColdstartError", "kinds": ["ColdstartError"],
                   "message": "internal error: bug"}


# -- one connection, through the server's loop ---------------------------------------------

async def _converse(*chunks: bytes) -> bytes:
    client, server = trio.testing.memory_stream_pair()
    received = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_connection, server, FakeHandler())
        with contextlib.suppress(trio.BrokenResourceError):  # it may hang up first
            for chunk in chunks:
                await client.send_all(chunk)
            await client.send_eof()
        while data := await client.receive_some(1 << 20):
            received += data
    return received


def test_a_connection_answers_every_line_in_order() -> None:
    out = trio.run(_converse, b'{"op": "ping"}\n{"op": "sta', b'tus"}\n\n{"op": "x"}\n')
    replies = [json.loads(line) for line in out.splitlines()]
    assert [r["ok"] for r in replies] == [True, True, False]
    assert replies[2]["error"]["message"] == "unknown op 'x'"


def test_an_over_long_request_line_ends_the_connection() -> None:
    out = trio.run(_converse, b'{"op": "ping"}\n', b"x" * (control.MAX_LINE + 1))
    lines = out.splitlines()
    assert json.loads(lines[0])["ok"] is True
    assert json.loads(lines[1]) == {"ok": False, "error": {
        "kind": "InvalidArgument", "kinds": ["InvalidArgument", "ColdstartError"],
        "message": "request line too long"}}
    assert len(lines) == 2
