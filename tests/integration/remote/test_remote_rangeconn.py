"""coldstart.remote.rangeconn against real HTTP servers on loopback: exact bytes, redirects
that carry nothing but the range to another origin, a dribbling server cut off at the deadline,
and answers it will not take (declined, for the general client)."""

from __future__ import annotations

import functools
import os
import re
import time
from http.server import BaseHTTPRequestHandler

import pytest

from coldstart.errors import DeadlineExceeded, Unavailable
from coldstart.remote.rangeconn import Declined, RangeConnections
from tests.fixtures.registry import reply, scripted_server

pytestmark = pytest.mark.integration

BLOB = os.urandom(300_000)


def _ranged(h: BaseHTTPRequestHandler, *, lie: int = 0) -> None:
    first, last = (int(x) for x in h.headers["Range"].removeprefix("bytes=").split("-"))
    last = min(last, len(BLOB) - 1)
    body = BLOB[first:last + 1]
    reply(h, 206, body[: len(body) - lie],
          {"Content-Range": f"bytes {first}-{last}/{len(BLOB)}"})


def test_exact_bytes_over_one_kept_alive_connection() -> None:
    pool = RangeConnections()
    try:
        with scripted_server(_ranged) as srv:
            url = f"http://{srv.host}/blob"
            for off, n in ((0, 1000), (123_456, 65_536), (299_000, 5000)):
                got = pool.get(url, off, n, headers={}, deadline=time.monotonic() + 5,
                               what="t")
                assert got == BLOB[off:off + n]         # the last one ends with the blob
            assert len({s.peer for s in srv.seen}) == 1
    finally:
        pool.close()


def test_a_redirect_elsewhere_carries_only_the_range() -> None:
    pool = RangeConnections()
    try:
        with scripted_server(_ranged) as cdn:
            def registry(h: BaseHTTPRequestHandler) -> None:
                reply(h, 307, b"", {"Location": f"http://{cdn.host}/signed?x=1"})

            with scripted_server(registry) as reg:
                got = pool.get(f"http://{reg.host}/v2/r/blobs/sha256:x", 10, 100,
                               headers={"Authorization": "Bearer secret",
                                        "X-Api-Key": "k"},
                               deadline=time.monotonic() + 5, what="t")
                assert got == BLOB[10:110]
                assert reg.seen[0].headers.get("Authorization") == "Bearer secret"
                sent = cdn.seen[0].headers
                assert "Authorization" not in sent and "X-Api-Key" not in sent
                assert sent["Range"] == "bytes=10-109" and cdn.seen[0].path == "/signed?x=1"
    finally:
        pool.close()


def test_a_dribbling_server_is_cut_off_at_the_deadline() -> None:
    """A byte every 0.2 s: each ``recv`` alone would not time out, but the call's deadline
    (1 s) ends it while the server is still sending (it would go on for 30 s, then close)."""
    sent = {"bytes": 0, "done": False}

    def dribble(h: BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Range", f"bytes 0-9999/{len(BLOB)}")
        h.send_header("Content-Length", "10000")
        h.end_headers()
        try:
            for i in range(150):        # a byte every 0.2 s, until the test ends (30 s at most)
                h.wfile.write(BLOB[i:i + 1])
                h.wfile.flush()
                sent["bytes"] += 1
                if srv.stop.wait(0.2):
                    return
        except OSError:
            return                      # the client hung up: what the deadline does
        sent["done"] = True             # dribbled all it would: nobody cut it off
        h.close_connection = True

    pool = RangeConnections()
    try:
        with scripted_server(dribble) as srv:
            with pytest.raises(DeadlineExceeded, match="within the deadline"):
                pool.get(f"http://{srv.host}/blob", 0, 10000, headers={},
                         deadline=time.monotonic() + 1.0, what="t")
            # cut off mid-body, while the server was still dribbling
            assert not sent["done"] and sent["bytes"] >= 1, sent
    finally:
        pool.close()


@pytest.mark.parametrize("where", ["answer", "body"])
def test_a_stall_longer_than_the_limit_fails_early_for_a_retry(where: str) -> None:
    """``stall``: a server silent for longer (before its answer, or in the middle of its body)
    fails the call with Unavailable after about that long, not at the deadline: the caller's
    retries get the rest of it.

    The server stays silent until the test ends (30 s at most, past the call's 10 s deadline):
    an Unavailable that is no DeadlineExceeded, while the server is still silent, came from
    the stall limit (0.5 s), neither from the deadline nor from waiting the silence out."""
    silence = {"ran_out": False}

    def stall(h: BaseHTTPRequestHandler) -> None:
        if where == "body":
            h.send_response(206)
            h.send_header("Content-Range", f"bytes 0-9999/{len(BLOB)}")
            h.send_header("Content-Length", "10000")
            h.end_headers()
            h.wfile.write(BLOB[:100])
            h.wfile.flush()
        silence["ran_out"] = not srv.stop.wait(30)

    pool = RangeConnections()
    try:
        with scripted_server(stall) as srv:
            t0 = time.monotonic()
            with pytest.raises(Unavailable) as err:
                pool.get(f"http://{srv.host}/blob", 0, 10000, headers={},
                         deadline=time.monotonic() + 10.0, what="t", stall=0.5)
            waited = time.monotonic() - t0
            assert not isinstance(err.value, DeadlineExceeded), err.value   # not the deadline
            assert not silence["ran_out"]               # nor the server's end of its silence
            assert re.fullmatch(r"t: no answer within 0\.5 s" if where == "answer" else
                                r"t: connection lost after \d+ of 10000 bytes: TimeoutError: "
                                r"timed out", str(err.value)), err.value
            # it did wait out the limit first: a lower bound, which a busy machine only makes
            # longer (the socket's timeout never fires early)
            assert waited >= 0.5, waited
    finally:
        pool.close()


@pytest.mark.parametrize("case", ["200", "short", "wrong-start", "500"])
def test_answers_it_does_not_take_are_declined(case: str) -> None:
    def handler(h: BaseHTTPRequestHandler) -> None:
        if case == "200":
            reply(h, 200, BLOB)
        elif case == "short":       # a 206 that ends early inside the blob
            _ranged(h, lie=10)
        elif case == "wrong-start":
            reply(h, 206, BLOB[5:105], {"Content-Range": f"bytes 5-104/{len(BLOB)}"})
        else:
            reply(h, 500, b"oops")

    pool = RangeConnections()
    try:
        with scripted_server(handler) as srv:
            got = pool.get(f"http://{srv.host}/blob", 0, 100, headers={},
                           deadline=time.monotonic() + 5, what="t")
            assert isinstance(got, Declined), got
    finally:
        pool.close()


def _asked(h: BaseHTTPRequestHandler) -> list[tuple[int, int]]:
    spans = h.headers["Range"].removeprefix("bytes=").split(",")
    return [(int(a), int(b)) for a, b in (s.split("-") for s in spans)]


def _multipart(h: BaseHTTPRequestHandler, *, blob: bytes = BLOB, boundary: str = "XyZ",
               drop: int = -1, cut: int = 0, backwards: bool = False) -> None:
    """A multipart/byteranges answer as Go's http.ServeContent writes it (distribution's)."""
    body = b"a preamble to skip\r\n"
    asked = _asked(h)
    for i, (a, b) in (reversed(list(enumerate(asked))) if backwards else enumerate(asked)):
        if i == drop:
            continue
        body += (f"--{boundary}\r\nContent-Type: application/octet-stream\r\n"
                 f"Content-Range: bytes {a}-{b}/{len(blob)}\r\n\r\n").encode()
        body += blob[a:b + 1 - cut] + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    reply(h, 206, body, {"Content-Type": f"multipart/byteranges; boundary={boundary}"})


def test_several_ranges_in_one_request_whatever_the_parts_hold() -> None:
    # the parts' bytes hold the boundary itself: each part's length comes from its
    # Content-Range, its bytes are never searched
    blob = BLOB[:150_000] + b"\r\n--XyZ\r\n" + BLOB[150_000:]
    pool = RangeConnections()
    try:
        want = [(0, 100), (149_990, 40), (200_000, 65_536), (len(blob) - 10, 10)]
        with scripted_server(functools.partial(_multipart, blob=blob)) as srv:
            got = pool.get_ranges(f"http://{srv.host}/blob", want, headers={},
                                  deadline=time.monotonic() + 5, what="t")
            assert got == [blob[a:a + n] for a, n in want]
            assert len(srv.seen) == 1
            assert srv.seen[0].headers["Range"] == \
                f"bytes=0-99,149990-150029,200000-265535,{len(blob) - 10}-{len(blob) - 1}"

        with scripted_server(functools.partial(_multipart, blob=blob, backwards=True)) as srv:
            got = pool.get_ranges(f"http://{srv.host}/blob", want, headers={},
                                  deadline=time.monotonic() + 5, what="t")
            assert got == [blob[a:a + n] for a, n in want]      # parts in any order

        def merged(h: BaseHTTPRequestHandler) -> None:   # one part for all (RFC 9110 allows)
            (a, _), (_, b) = _asked(h)[0], _asked(h)[-1]
            reply(h, 206, blob[a:b + 1], {"Content-Range": f"bytes {a}-{b}/{len(blob)}"})

        close = [(1000, 60_000), (62_000, 30_000), (100_000, 10_000)]
        with scripted_server(merged) as srv:
            got = pool.get_ranges(f"http://{srv.host}/blob", close, headers={},
                                  deadline=time.monotonic() + 5, what="t")
            assert got == [blob[a:a + n] for a, n in close]
    finally:
        pool.close()


@pytest.mark.parametrize("case", ["200", "missing-part", "cut-part", "no-boundary",
                                  "one-part-too-short", "one-part-much-more"])
def test_multi_range_answers_it_does_not_take_are_declined(case: str) -> None:
    def handler(h: BaseHTTPRequestHandler) -> None:
        if case == "200":                   # an object store: the whole blob
            reply(h, 200, BLOB)
        elif case == "missing-part":
            _multipart(h, drop=1)
        elif case == "cut-part":            # a part shorter than its Content-Range says
            _multipart(h, cut=3)
        elif case == "no-boundary":
            reply(h, 206, b"--XyZ\r\n", {"Content-Type": "multipart/byteranges"})
        elif case == "one-part-too-short":  # one part that does not reach the last range
            reply(h, 206, BLOB[0:200], {"Content-Range": f"bytes 0-199/{len(BLOB)}"})
        else:                               # one part holding all between: far more bytes
            reply(h, 206, BLOB[0:250_100], {"Content-Range": f"bytes 0-250099/{len(BLOB)}"})

    pool = RangeConnections()
    try:
        with scripted_server(handler) as srv:
            last = 250_000 if case == "one-part-much-more" else 5000
            got = pool.get_ranges(f"http://{srv.host}/blob", [(0, 100), (last, 100)],
                                  headers={}, deadline=time.monotonic() + 5, what="t")
            assert isinstance(got, Declined), got
            assert (got.status == 200) == (case == "200")
    finally:
        pool.close()
