"""Fuzz the FUSE server's control protocol: request lines, framing, layer specs, replies.

Properties:

* :func:`check_dispatch`: ``dispatch`` answers any line (a valid request of each op, mutated as
  JSON and as bytes) with exactly one reply line that ``decode_reply`` reads back as a result or
  as a ColdstartError, never the ``internal error`` of an unexpected exception; the handler is
  only ever called with an absolute, normalized mountpoint and a well-typed LayerSpec;
* :func:`check_line_buffer`: ``LineBuffer`` returns the same lines however the stream is cut into
  reads, and refuses (InvalidArgument) exactly the streams with a line over ``max_line``;
* :func:`check_layer_spec`: ``LayerSpec.from_json`` returns a spec whose fields have their
  declared types, or raises InvalidArgument;
* :func:`check_decode_reply`: ``decode_reply`` on any line returns, raises a ColdstartError, or
  raises ValueError (what the client turns into Unavailable), nothing else.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from coldstart import errors
from coldstart.errors import ColdstartError, InvalidArgument
from coldstart.lazyfs import control
from coldstart.lazyfs.spec import LayerSpec
from tests.unit.fuzz.common import (
    JsonEdit,
    Mutation,
    Property,
    apply_edits,
    byte_mutations,
    emit,
    fuzz_settings,
    json_edits,
    json_values,
    mutate_bytes,
    outcome,
    time_limit,
    to_pairs,
)

_KEYS = ["op", "mountpoint", "spec", "on", "seconds", "reference", "digest", "size", "media_type",
         "manifest_digest", "annotations", "ok", "result", "error", "kind", "kinds", "message"]
_STRINGS = [*control.OPS, "/mp", "/a/./b/../mp", "//mp", "/mp/", "relative/mp", "/\x00",
            "/\udcff", "NotFound", "IntegrityError", "ColdstartError", "Exception", "__class__",
            "AuthError", "registry.test/x:1", "sha256:" + "ab" * 32]
_VALUES = json_values(_STRINGS, _KEYS)
_SPEC_FIELDS: dict[str, type] = {"reference": str, "digest": str, "size": int, "media_type": str,
                                 "manifest_digest": str}


# -- the handler: checks what dispatch hands it, as the real server relies on -------------------


class CheckingHandler:
    """A ControlHandler that answers every op and asserts its arguments are well formed (an
    AssertionError here surfaces as dispatch's ``internal error``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def ready(self) -> None:
        pass

    async def ping(self) -> dict[str, Any]:
        self.calls.append("ping")
        return {"pid": 1}

    async def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        self._mountpoint(mountpoint)
        assert isinstance(spec, LayerSpec)
        assert_well_typed(spec)
        self.calls.append("mount")

    async def check(self, mountpoint: str) -> None:
        self._mountpoint(mountpoint)
        self.calls.append("check")

    async def unmount(self, mountpoint: str) -> None:
        self._mountpoint(mountpoint)
        self.calls.append("unmount")

    def status(self) -> list[dict[str, Any]]:
        self.calls.append("status")
        return [{"mountpoint": "/mp"}]

    def record(self, on: bool, mountpoint: str | None) -> int:
        assert isinstance(on, bool)
        if mountpoint is not None:
            self._mountpoint(mountpoint)
        self.calls.append("record")
        return 0

    def profile(self) -> list[dict[str, Any]]:
        self.calls.append("profile")
        return []

    def hold(self, seconds: float) -> None:
        assert isinstance(seconds, float) and 0 <= seconds <= 600, seconds
        self.calls.append("hold")

    @staticmethod
    def _mountpoint(mp: str) -> None:
        assert isinstance(mp, str) and os.path.isabs(mp) and os.path.normpath(mp) == mp, mp


def assert_well_typed(spec: LayerSpec) -> None:
    """Every field of ``spec`` has its declared type (bool is not an int here)."""
    for name, kind in _SPEC_FIELDS.items():
        value = getattr(spec, name)
        assert isinstance(value, kind) and not isinstance(value, bool), (name, value)
    assert isinstance(spec.annotations, dict)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in spec.annotations.items())


# -- dispatch -----------------------------------------------------------------------------------


_mountpoints = st.sampled_from(["/mp", "/a/./b/../mp", "//mp", "/mp/", "relative", "", "/",
                                "/\x00x", "/\udcff", "/" + "x" * 5000])
_specs = st.builds(
    LayerSpec, st.sampled_from(["registry.test/lazy/x:v1", "", "é"]),
    st.sampled_from(["sha256:" + "ab" * 32, "sha256:", ""]), st.sampled_from([-1, 0, 123]),
    st.sampled_from(["", "application/vnd.oci.image.layer.v1.tar+zstd"]), st.just(""),
    st.dictionaries(st.sampled_from(["k", "containerd.io/snapshot/stargz/toc.digest"]),
                    st.text(max_size=8), max_size=2))


@st.composite
def _requests(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from([*control.OPS, control.MOUNT, control.MOUNT, control.RECORD]))
    mp = draw(_mountpoints)
    if op == control.MOUNT:
        return control.mount_request(mp, draw(_specs))
    if op in (control.CHECK, control.UNMOUNT):
        return {"op": op, "mountpoint": mp}
    if op == control.RECORD:
        return control.record_request(draw(st.booleans()), draw(st.none() | st.just(mp)))
    if op == control.HOLD:
        return control.hold_request(draw(st.floats(0, control.MAX_HOLD)))
    return {"op": op}


@dataclass(frozen=True)
class RequestCase:
    """A valid request, then JSON edits, then byte mutations of its line."""

    request: dict[str, Any]
    edits: list[JsonEdit] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)

    def line(self) -> bytes:
        doc = apply_edits(to_pairs(self.request), self.edits) if self.edits else self.request
        return mutate_bytes(emit(doc).encode(), self.mutations)


def request_cases() -> st.SearchStrategy[RequestCase]:
    """Requests of every op, edited as JSON (often), as bytes (sometimes)."""
    edits = json_edits(_VALUES, _KEYS)
    return st.builds(RequestCase, _requests(), st.just([]) | edits | edits,
                     st.just([]) | st.just([]) | byte_mutations(3))


def check_dispatch(case: RequestCase) -> None:
    """One reply line, decodable, never an internal error; handler arguments well formed."""
    line = case.line()
    with time_limit():
        reply = trio.run(control.dispatch, line, CheckingHandler())
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1, reply
    try:
        control.decode_reply(reply)
    except ColdstartError as exc:
        assert not str(exc).startswith("internal error"), str(exc)
        outcome(f"control: {type(exc).__name__}")
        return
    outcome("control: ok")


# -- framing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamCase:
    """Lines (some blank, some long) joined with newlines, cut into reads at ``cuts``."""

    lines: list[bytes]
    tail: bytes
    cuts: list[int]
    max_line: int

    def stream(self) -> bytes:
        return b"".join(line + b"\n" for line in self.lines) + self.tail

    def reads(self) -> list[bytes]:
        data = self.stream()
        points = sorted({c % (len(data) + 1) for c in self.cuts} | {0, len(data)})
        return [data[a:b] for a, b in itertools.pairwise(points)]


_line = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")) | st.sampled_from(
    [b"", b"  ", b"\t", b'{"op": "ping"}', b"x" * 33])


def stream_cases() -> st.SearchStrategy[StreamCase]:
    """Up to six lines and a partial tail, cut into reads, with a small line limit."""
    return st.builds(StreamCase, st.lists(_line, max_size=6), _line,
                     st.lists(st.integers(0, 400), max_size=8), st.integers(1, 40))


def check_line_buffer(case: StreamCase) -> None:
    """However the stream is cut into reads: every non-blank line, in order, when no line (nor
    the unfinished tail) is over ``max_line``; else InvalidArgument before any line over it is
    returned. Nothing else."""
    buf = control.LineBuffer(max_line=case.max_line)
    got: list[bytes] = []
    refused = False
    for data in case.reads():
        try:
            got += buf.feed(data)
        except InvalidArgument:
            refused = True
            break
    too_long = any(len(line) > case.max_line for line in [*case.lines, case.tail])
    want = [line for line in case.lines if line.strip()]
    assert refused == too_long, (got, refused)
    if refused:
        assert all(len(line) <= case.max_line for line in got)
        assert got == want[: len(got)]
        outcome("line buffer: refused")
    else:
        assert got == want
        outcome("line buffer: lines")


# -- layer specs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCase:
    """A valid spec's JSON, then JSON edits, then byte mutations."""

    spec: LayerSpec
    edits: list[JsonEdit] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)

    def text(self) -> bytes:
        doc = to_pairs(json.loads(self.spec.to_json()))
        if self.edits:
            doc = apply_edits(doc, self.edits)
        return mutate_bytes(emit(doc).encode(), self.mutations)


def spec_cases() -> st.SearchStrategy[SpecCase]:
    """Specs edited as JSON, as bytes, or both."""
    return st.builds(SpecCase, _specs, json_edits(_VALUES, _KEYS) | st.just([]),
                     st.just([]) | byte_mutations(2))


def check_layer_spec(case: SpecCase) -> None:
    """A well-typed LayerSpec (the same one when the JSON was not edited), or InvalidArgument."""
    text = case.text()
    try:
        spec = LayerSpec.from_json(text)
    except InvalidArgument:
        outcome("spec: refused")
        return
    assert_well_typed(spec)
    if not case.edits and not case.mutations:
        assert spec == case.spec
    outcome("spec: accepted")


# -- replies ------------------------------------------------------------------------------------


_replies = st.sampled_from([
    control.ok_reply({"pid": 1}), control.ok_reply(None),
    control.error_reply(errors.NotFound("gone")), control.error_reply(RuntimeError("boom")),
    control.error_reply(errors.DeadlineExceeded("slow"))])


@dataclass(frozen=True)
class ReplyCase:
    """A valid reply line, then JSON edits, then byte mutations."""

    reply: bytes
    edits: list[JsonEdit] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)

    def line(self) -> bytes:
        doc = to_pairs(json.loads(self.reply))
        if self.edits:
            doc = apply_edits(doc, self.edits)
        return mutate_bytes(emit(doc).encode(), self.mutations)


def reply_cases() -> st.SearchStrategy[ReplyCase]:
    """Replies of both kinds, edited as JSON, as bytes, or both."""
    return st.builds(ReplyCase, _replies, json_edits(_VALUES, _KEYS) | st.just([]),
                     st.just([]) | byte_mutations(2))


def check_decode_reply(case: ReplyCase) -> None:
    """A result, a ColdstartError, or ValueError; nothing else."""
    try:
        control.decode_reply(case.line())
    except ColdstartError as exc:
        outcome(f"reply: {type(exc).__name__}")
        return
    except ValueError:
        outcome("reply: not a reply")
        return
    outcome("reply: result")


PROPERTIES = [
    Property("control-dispatch", request_cases, check_dispatch),
    Property("control-framing", stream_cases, check_line_buffer),
    Property("control-spec", spec_cases, check_layer_spec),
    Property("control-reply", reply_cases, check_decode_reply),
]


@fuzz_settings(600)
@given(case=request_cases())
def test_dispatch_answers_every_line_with_a_decodable_reply(case: RequestCase) -> None:
    """Mutated request lines: one decodable reply, never an internal error."""
    check_dispatch(case)


@fuzz_settings(500)
@given(case=stream_cases())
def test_line_buffer_does_not_depend_on_how_reads_cut_the_stream(case: StreamCase) -> None:
    """Any cut of a stream into reads: the same lines, or the same refusal."""
    check_line_buffer(case)


@fuzz_settings(400)
@given(case=spec_cases())
def test_layer_spec_is_well_typed_or_refused(case: SpecCase) -> None:
    """Mutated layer specs: well typed, or InvalidArgument."""
    check_layer_spec(case)


@fuzz_settings(400)
@given(case=reply_cases())
def test_decode_reply_raises_only_what_the_client_handles(case: ReplyCase) -> None:
    """Mutated replies: a result, a ColdstartError or ValueError."""
    check_decode_reply(case)


# -- regressions: what the fuzzers found, as plain tests -----------------------------------------

_DEEP = b"[" * 100_000 + b"]" * 100_000


def _reply(line: bytes) -> dict[str, Any]:
    reply: bytes = trio.run(control.dispatch, line, CheckingHandler())
    out: dict[str, Any] = json.loads(reply)
    return out


@pytest.mark.parametrize("line", [
    _DEEP,                                                    # was the internal-error path
    b'{"op": "mount", "mountpoint": "/mp", "spec": {"reference": "r", "digest": null}}',
    b'{"op": "mount", "mountpoint": "/mp", "spec": {"reference": "r", "digest": "d", '
    b'"annotations": [1]}}',                                  # were mounted as they were
    b'{"op": "mount", "mountpoint": "/mp", "spec": {"reference": "r", "digest": "d"}, '
    b'"image_layers": "sha256:a"}',
    b'{"op": "mount", "mountpoint": "/mp", "spec": {"reference": "r", "digest": "d"}, '
    b'"image_layers": [1]}',
], ids=["deep-nesting", "digest-null", "annotations-list", "image-layers-string",
        "image-layers-ints"])
def test_regression_bad_requests_are_invalid_argument(line: bytes) -> None:
    reply = _reply(line)
    assert reply["ok"] is False and reply["error"]["kind"] == "InvalidArgument", reply
    assert not reply["error"]["message"].startswith("internal error")


@pytest.mark.parametrize("text", [
    _DEEP, b'{"reference": "r", "digest": null}', b'{"reference": 1, "digest": "d"}',
    b'{"reference": "r", "digest": "d", "size": true}',
    b'{"reference": "r", "digest": "d", "size": "12"}',
    b'{"reference": "r", "digest": "d", "annotations": null}',
    b'{"reference": "r", "digest": "d", "annotations": {"k": 1}}',
    b'[1, 2]',
])
def test_regression_layer_spec_refuses_fields_of_the_wrong_type(text: bytes) -> None:
    """Were accepted (all but the first, a RecursionError), and would have failed in the
    mounter (``spec.digest.rpartition``, ``spec.size >= 0``) as an internal error."""
    with pytest.raises(InvalidArgument, match="bad layer spec"):
        LayerSpec.from_json(text)


def test_regression_line_limit_does_not_depend_on_the_reads() -> None:
    """A line over the limit was accepted when its newline came in the same read, and a tail
    over the limit waited for the next read."""
    for data in (b"xx\n", b"\n\x00\x00"):
        with pytest.raises(InvalidArgument, match="too long"):
            control.LineBuffer(max_line=1).feed(data)
    b = control.LineBuffer(max_line=2)
    assert b.feed(b"ab\ncd") == [b"ab"]
    assert b.feed(b"\n") == [b"cd"]


@pytest.mark.parametrize("line", [b'{"ok": false, "error": 1e999}',
                                  b'{"ok": false, "error": [1]}', _DEEP])
def test_regression_a_reply_that_is_not_one_is_a_value_error(line: bytes) -> None:
    """Were AttributeError (an error that is not an object) and RecursionError, which the
    client does not turn into Unavailable."""
    with pytest.raises(ValueError):
        control.decode_reply(line)


def test_regression_kinds_that_are_not_a_list() -> None:
    """Was TypeError (iterating an int); now the single ``kind`` decides."""
    with pytest.raises(errors.NotFound, match="gone"):
        control.decode_reply(b'{"ok": false, "error": {"kind": "NotFound", "kinds": 5, '
                             b'"message": "gone"}}')
