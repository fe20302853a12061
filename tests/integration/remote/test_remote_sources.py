"""Every source of coldstart.remote through the same cases (CONVENTIONS §11).

Sources: a local file; an HTTP URL on a real loopback HTTP server started here; an S3 object on
the ``moto_server`` fixture; a registry blob on the ``docker-registry`` fixture. Cases: ranges
(start, middle, end, zero length), out-of-range and short reads, 5xx then success, a stalled
body cut off at its deadline, a ``200`` answer to a range request, redirects.

What a healthy moto_server or docker-registry never does (5xx, stalls, short bodies, ignoring
``Range``, redirecting) is injected by a fault proxy in front of it (``faulty_proxy`` of
``tests.fixtures.registry``): it forwards every request to the real server except the ranged
GETs a case takes over, which it answers itself from the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import DeadlineExceeded, FailedPrecondition, FormatError, Unavailable
from coldstart.format.readat import ReadAt
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote import LocalFileBlob, RegistryBlob, Source
from coldstart.remote.http import HttpSource
from coldstart.remote.s3 import S3Source
from coldstart.remote.s3 import s3_client as make_s3_client
from tests.fixtures.registry import Registry, faulty_proxy, scripted_server
from tests.fixtures.s3 import s3_client

pytestmark = pytest.mark.integration

DATA = bytes((i * 7 + i // 251) % 256 for i in range(300_000))
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()
KINDS = ["local", "http", "s3", "registry"]
NETWORK = ["http", "s3", "registry"]
TIMEOUT = 1.0

# A fault: "5xx" (the first ranged GET answers 503), "stall" (ranged GETs send a few bytes, then
# nothing), "short" (ranged GETs send half the range, well-formed), "ignore-range" (ranged GETs
# answered 200 with the whole blob), "redirect" (ranged GETs answered 307 to the real server).
Fault = str | None


def _range_of(h: BaseHTTPRequestHandler) -> tuple[int, int] | None:
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", h.headers.get("Range", ""))
    if m is None:
        return None
    start = int(m.group(1))
    end = min(int(m.group(2)) if m.group(2) else len(DATA) - 1, len(DATA) - 1)
    return start, end


def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str],
          length: int | None = None) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body) if length is None else length))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)
        h.wfile.flush()


def serve_range(h: BaseHTTPRequestHandler, ignore_range: bool = False) -> None:
    """Answer like a plain static file server: HEAD, GET, GET with ``Range`` (206)."""
    rng = None if ignore_range else _range_of(h)
    if rng is None or h.command == "HEAD":
        _send(h, 200, DATA if h.command != "HEAD" else b"", {"Accept-Ranges": "bytes"},
              length=len(DATA))
        return
    start, end = rng
    if start >= len(DATA):
        _send(h, 416, b"", {"Content-Range": f"bytes */{len(DATA)}"})
        return
    _send(h, 206, DATA[start : end + 1], {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"})


class FaultState:
    def __init__(self, fault: Fault, real: str | None) -> None:
        self.fault = fault
        self.real = real          # the real server's base URL, for redirects
        self.injected = 0

    def take(self, h: BaseHTTPRequestHandler, stop: Callable[[], bool]) -> bool:
        """Answer ``h`` with the fault when it applies (a GET with Range); True if answered."""
        rng = _range_of(h) if h.command == "GET" else None
        if self.fault is None or rng is None:
            return False
        start, end = rng
        if self.fault == "5xx":
            if self.injected:
                return False
            self.injected += 1
            _send(h, 503, b"try again", {})
            return True
        self.injected += 1
        head = {"Content-Range": f"bytes {start}-{end}/{len(DATA)}"}
        if self.fault == "short":
            body = DATA[start : start + (end - start + 1) // 2]
            _send(h, 206, body, {"Content-Range": f"bytes {start}-{start + len(body) - 1}"
                                                  f"/{len(DATA)}"})
        elif self.fault == "stall":
            h.send_response(206)
            for k, v in head.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(end - start + 1))
            h.end_headers()
            h.wfile.write(DATA[start : start + 10])
            h.wfile.flush()
            until = time.monotonic() + 20
            while time.monotonic() < until and not stop():
                time.sleep(0.05)
            h.close_connection = True
        elif self.fault == "ignore-range":
            _send(h, 200, DATA, {})
        elif self.fault == "redirect":
            assert self.real is not None
            _send(h, 307, b"", {"Location": self.real + h.path})
        else:
            raise AssertionError(self.fault)
        return True


@contextlib.contextmanager
def http_source(fault: Fault) -> Iterator[tuple[Source, FaultState]]:
    state = FaultState(fault, None)
    box: dict[str, Callable[[], bool]] = {}

    def handler(h: BaseHTTPRequestHandler) -> None:
        if h.path == "/moved":
            _send(h, 302, b"", {"Location": "/blob"})
        elif not state.take(h, box["stop"]):
            serve_range(h)

    with scripted_server(handler) as info:
        box["stop"] = info.stop.is_set
        state.real = info.url
        if fault == "redirect":
            state.fault = None  # plain HTTP redirects: the URL itself moved
            url = f"{info.url}/moved"
        else:
            url = f"{info.url}/blob"
        src = HttpSource(url, timeout=TIMEOUT, concurrency=4)
        try:
            yield src, state
        finally:
            src.close()


@contextlib.contextmanager
def s3_source(endpoint: str, fault: Fault) -> Iterator[tuple[Source, FaultState]]:
    bucket = "remote-suite"
    real = s3_client(endpoint)
    with contextlib.suppress(Exception):
        real.create_bucket(Bucket=bucket)
    real.put_object(Bucket=bucket, Key="blob", Body=DATA)
    state = FaultState(fault, endpoint)
    box: dict[str, Callable[[], bool]] = {}
    upstream = endpoint.removeprefix("http://")

    def fault_or_head(h: BaseHTTPRequestHandler, n: int) -> bool:
        if h.command == "HEAD":  # the proxy would forward HEAD's length as 0: answer it here
            serve_range(h)
            return True
        return state.take(h, box["stop"])

    with faulty_proxy(upstream, fault_or_head) as proxy:
        box["stop"] = proxy.stop.is_set
        client = make_s3_client(timeout=TIMEOUT, concurrency=4,
                                endpoint_url=proxy.url if fault else endpoint)
        yield S3Source(f"s3://{bucket}/blob", client=client, timeout=TIMEOUT), state


@contextlib.contextmanager
def registry_source(registry: Registry, fault: Fault) -> Iterator[tuple[Source, FaultState]]:
    with RegistryClient() as pusher:
        pusher.push_blob(Reference.parse(f"{registry.host}/remote/suite"), DATA, DIGEST)
    state = FaultState(fault, registry.url)
    box: dict[str, Callable[[], bool]] = {}
    with faulty_proxy(registry.host, lambda h, n: state.take(h, box["stop"])) as proxy, \
            RegistryClient(timeout=TIMEOUT * 5) as client:
        box["stop"] = proxy.stop.is_set
        host = proxy.host if fault else registry.host
        ref = Reference.parse(f"{host}/remote/suite")
        yield RegistryBlob(client, ref, DIGEST, len(DATA), timeout=TIMEOUT), state


@pytest.fixture
def open_kind(request: pytest.FixtureRequest, tmp_path: Path,
              ) -> Iterator[Callable[[str, Fault], tuple[Source, FaultState]]]:
    with contextlib.ExitStack() as stack:
        def make(kind: str, fault: Fault = None) -> tuple[Source, FaultState]:
            if kind == "local":
                path = tmp_path / "blob"
                path.write_bytes(DATA)
                src = stack.enter_context(LocalFileBlob(path))
                return src, FaultState(None, None)
            if kind == "http":
                return stack.enter_context(http_source(fault))
            if kind == "s3":
                return stack.enter_context(s3_source(request.getfixturevalue("s3"), fault))
            if kind == "registry":
                return stack.enter_context(
                    registry_source(request.getfixturevalue("registry"), fault))
            raise AssertionError(kind)

        yield make


@pytest.mark.parametrize("kind", KINDS)
def test_ranges_start_middle_end_and_zero_length(open_kind: Callable[..., tuple[Source, Any]],
                                                 kind: str) -> None:
    src, _ = open_kind(kind)
    assert isinstance(src, Source) and isinstance(src, ReadAt)
    n = len(DATA)
    assert src.size() == n
    for off, length in [(0, 1), (0, 4096), (12_345, 70_000), (n - 7, 7), (n - 1, 1)]:
        assert src.read_at(off, length) == DATA[off : off + length], (off, length)
        assert src.read_at(off, length, timeout=5.0) == DATA[off : off + length]
    assert src.read_at(0, 0) == b"" and src.read_at(n, 0) == b""
    # read_into fills several buffers back to back
    bufs = [bytearray(3), bytearray(0), bytearray(5000), bytearray(17)]
    src.read_into(1000, [memoryview(b) for b in bufs], timeout=5.0)
    assert b"".join(bufs) == DATA[1000 : 1000 + 5020]
    src.read_into(5, [])  # nothing asked, nothing read


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_is_a_format_error(open_kind: Callable[..., tuple[Source, Any]],
                                        kind: str) -> None:
    src, _ = open_kind(kind)
    n = len(DATA)
    for off, length in [(n - 1, 2), (n, 1), (n + 100, 10)]:
        with pytest.raises(FormatError):
            src.read_at(off, length)


@pytest.mark.parametrize("kind", KINDS)
def test_short_read_is_unavailable(open_kind: Callable[..., tuple[Source, Any]],
                                   kind: str, tmp_path: Path) -> None:
    if kind == "local":
        src, _ = open_kind(kind)
        src.size()
        (tmp_path / "blob").write_bytes(DATA[: len(DATA) // 2])  # truncated behind its back
        buf = bytearray(100_000)
        with pytest.raises(Unavailable):
            src.read_into(len(DATA) // 2 - 10, [memoryview(buf)])
        with pytest.raises(FormatError, match="shrank"):
            src.read_at(len(DATA) // 2 - 10, 100)
        return
    src, state = open_kind(kind, "short")
    with pytest.raises(Unavailable):
        src.read_at(1000, 50_000)
    assert state.injected >= 1


@pytest.mark.parametrize("kind", NETWORK)
def test_5xx_then_success(open_kind: Callable[..., tuple[Source, Any]], kind: str) -> None:
    src, state = open_kind(kind, "5xx")
    assert src.read_at(2000, 30_000) == DATA[2000:32_000]
    assert state.injected == 1


@pytest.mark.parametrize("kind", NETWORK)
def test_stalled_body_is_cut_off_at_its_deadline(open_kind: Callable[..., tuple[Source, Any]],
                                                 kind: str) -> None:
    """The stalled attempt is cut off at its deadline (DeadlineExceeded, not the error of a
    body the server ends short 20 s later), and its retries share the read's budget (twice
    the timeout for HTTP and S3, one timeout for a registry blob): at most two stalled
    attempts, not the 1 + 3 the retry count allows."""
    src, state = open_kind(kind, "stall")
    src.size()
    with pytest.raises(DeadlineExceeded):
        src.read_at(4096, 100_000, timeout=TIMEOUT)
    assert 1 <= state.injected <= 2


@pytest.mark.parametrize("kind", NETWORK)
def test_200_to_a_range_request_is_never_taken_as_the_range(
        open_kind: Callable[..., tuple[Source, Any]], kind: str) -> None:
    src, state = open_kind(kind, "ignore-range")
    try:
        got = src.read_at(10_000, 20_000)
    except FailedPrecondition as exc:
        assert "ignored Range" in str(exc)  # a clear error: HTTP and S3 refuse such servers
        assert kind in ("http", "s3")
    else:
        assert got == DATA[10_000:30_000]   # the registry client skips to the range
        assert kind == "registry"
    assert state.injected >= 1


@pytest.mark.parametrize("kind", NETWORK)
def test_redirects(open_kind: Callable[..., tuple[Source, Any]], kind: str) -> None:
    """HTTP and the registry follow them (blob storage behind a CDN); botocore follows only S3's
    own region redirects, so any other redirect is a clear error, never wrong bytes."""
    src, state = open_kind(kind, "redirect")
    if kind == "s3":
        with pytest.raises(Unavailable, match="307"):
            src.read_at(123, 4567)
    else:
        assert src.read_at(123, 4567) == DATA[123 : 123 + 4567]
    if kind != "http":
        assert state.injected >= 1
