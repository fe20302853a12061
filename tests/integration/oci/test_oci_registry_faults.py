"""RegistryClient against small real HTTP servers on loopback that misbehave on purpose:
token and Basic auth, 5xx, hangs (deadlines), redirects to blob storage, mirrors."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from coldstart.errors import DeadlineExceeded, IntegrityError, NotFound, Unavailable
from coldstart.oci.auth import AuthError
from coldstart.oci.manifest import digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.registry import reply, scripted_server

pytestmark = pytest.mark.integration

BLOB = bytes(range(256)) * 400
DIGEST = digest_of(BLOB)


def _serve_blob(h: BaseHTTPRequestHandler) -> None:
    rng = h.headers.get("Range")
    if rng:
        start_s, end_s = rng.removeprefix("bytes=").split("-")
        start = int(start_s)
        end = min(int(end_s) if end_s else len(BLOB) - 1, len(BLOB) - 1)
        reply(h, 206, BLOB[start:end + 1],
              {"Content-Range": f"bytes {start}-{end}/{len(BLOB)}"})
    else:
        reply(h, 200, BLOB, {"Docker-Content-Digest": DIGEST})


def test_bearer_token_flow_and_cache(tmp_path: Path) -> None:
    tokens: list[dict[str, list[str]]] = []

    def handler(h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        if url.path == "/token":
            tokens.append(parse_qs(url.query))
            auth = h.headers.get("Authorization", "")
            ok = auth == "Basic " + base64.b64encode(b"alice:pw").decode()
            scope = parse_qs(url.query)["scope"][0]
            body = json.dumps({"token": f"tok-{scope}", "expires_in": 300}).encode()
            reply(h, 200 if ok else 401, body if ok else b"")
            return
        repo = url.path.removeprefix("/v2/").split("/blobs/")[0]
        want = f"Bearer tok-repository:{repo}:pull"
        if h.headers.get("Authorization") != want:
            realm = f"http://{h.headers['Host']}/token"
            reply(h, 401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                "WWW-Authenticate": f'Bearer realm="{realm}",service="test",'
                                    f'scope="repository:{repo}:pull"'})
            return
        _serve_blob(h)

    config = tmp_path / "config.json"
    with scripted_server(handler) as srv:
        config.write_text(json.dumps({"auths": {srv.host: {
            "auth": base64.b64encode(b"alice:pw").decode()}}}))
        with RegistryClient(docker_config=config, timeout=10) as client:
            ref = Reference.parse(f"{srv.host}/team/app:v1")
            assert client.get_blob(ref, DIGEST) == BLOB
            for i in range(5):
                assert client.read_blob_range(ref, DIGEST, i * 100, 50) == \
                    BLOB[i * 100:i * 100 + 50]
            assert len(tokens) == 1            # token cached for the scope
            assert tokens[0]["service"] == ["test"]
            other = Reference.parse(f"{srv.host}/team2/app:v1")
            assert client.read_blob_range(other, DIGEST, 0, 4) == BLOB[:4]
            assert len(tokens) == 2            # a new scope needs a new token
            # 6 authorised requests to /v2 sent the token up front (no 401 round trip)
            unauth = [s for s in srv.seen if s.path.startswith("/v2")
                      and "Authorization" not in s.headers]
            assert len(unauth) == 2

        # wrong password: a clear auth error naming the user, not a retry storm
        config.write_text(json.dumps({"auths": {srv.host: {"username": "alice",
                                                           "password": "nope"}}}))
        with RegistryClient(docker_config=config, timeout=10) as client, \
                pytest.raises(AuthError, match="'alice'"):
            client.get_blob(Reference.parse(f"{srv.host}/team/app:v1"), DIGEST)


def test_basic_auth(tmp_path: Path) -> None:
    good = "Basic " + base64.b64encode(b"bob:secret").decode()

    def handler(h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization") != good:
            reply(h, 401, b"", {"WWW-Authenticate": 'Basic realm="reg"'})
        else:
            _serve_blob(h)

    with scripted_server(handler) as srv:
        ref = Reference.parse(f"{srv.host}/app:v1")
        with RegistryClient(credentials={srv.host: ("bob", "secret")}, timeout=10,
                            docker_config=tmp_path / "none.json") as client:
            assert client.get_blob(ref, DIGEST) == BLOB
            assert client.read_blob_range(ref, DIGEST, 5, 5) == BLOB[5:10]
        with RegistryClient(timeout=10, docker_config=tmp_path / "none.json") as client, \
                pytest.raises(AuthError, match="no credentials"):
            client.get_blob(ref, DIGEST)
        forbidden = Reference.parse(f"{srv.host}/app:v1")
        with RegistryClient(credentials={srv.host: ("bob", "wrong")}, timeout=10,
                            docker_config=tmp_path / "none.json") as client, \
                pytest.raises(AuthError):
            client.get_blob(forbidden, DIGEST)


def test_retries_then_unavailable() -> None:
    calls = {"n": 0}

    def handler(h: BaseHTTPRequestHandler) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            reply(h, 429, b"slow down", {"Retry-After": "0"})
        elif calls["n"] == 2:
            reply(h, 500, b"oops")
        else:
            _serve_blob(h)

    with scripted_server(handler) as srv, \
            RegistryClient(timeout=10, retries=3, backoff=0.01) as client:
        ref = Reference.parse(f"{srv.host}/app:v1")
        assert client.get_blob(ref, DIGEST) == BLOB
        assert calls["n"] == 3

    with scripted_server(lambda h: reply(h, 503, b"down")) as srv, \
            RegistryClient(timeout=10, retries=2, backoff=0.01) as client:
        with pytest.raises(Unavailable, match="503"):
            client.blob_size(Reference.parse(f"{srv.host}/app:v1"), DIGEST)
        assert len(srv.seen) == 3   # first try + 2 retries, then give up


def test_deadline_on_hang() -> None:
    """A server that never answers: the call's deadline ends it, not the count of retries.

    Each attempt's socket waits are cut to what is left of the call's deadline, so the hung
    attempt spends the whole budget and none of the five retries is started: the server sees
    (at most) one request per call, and the error names the call's own timeout."""
    def hang(h: BaseHTTPRequestHandler) -> None:
        srv_stop.wait(30)

    with scripted_server(hang) as srv:
        srv_stop = srv.stop
        with RegistryClient(timeout=1.0, retries=5, backoff=0.05) as client:
            with pytest.raises(DeadlineExceeded, match=r"within 1 s"):
                client.get_manifest(Reference.parse(f"{srv.host}/app:v1"))
            assert len(srv.seen) <= 1   # no retry started: the deadline, not 5 retries
            before = len(srv.seen)
            with pytest.raises(DeadlineExceeded, match=r"within 0\.5 s"):
                client.read_blob_range(Reference.parse(f"{srv.host}/app:v1"), DIGEST, 0, 10,
                                       timeout=0.5)
            assert len(srv.seen) - before <= 1


def test_deadline_on_body_stall() -> None:
    """Headers and a little body, then nothing: the blob's deadline cuts the body off, and the
    resume it would try has no budget left (one request, not one per retry)."""
    def stall(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(BLOB)))
        h.end_headers()
        h.wfile.write(BLOB[:1000])
        h.wfile.flush()
        stop.wait(30)

    with scripted_server(stall) as srv:
        stop = srv.stop
        with RegistryClient(timeout=1.0, retries=3, backoff=0.01) as client:
            with pytest.raises(DeadlineExceeded, match=r"timed out|not done within 1 s"):
                client.get_blob(Reference.parse(f"{srv.host}/app:v1"), DIGEST, timeout=1.0)
            assert len(srv.seen) == 1   # the stalled body was not resumed: no time was left


def test_redirect_to_storage_drops_authorization() -> None:
    good = "Basic " + base64.b64encode(b"bob:secret").decode()

    with scripted_server(_serve_blob) as storage:
        def registry(h: BaseHTTPRequestHandler) -> None:
            if h.headers.get("Authorization") != good:
                reply(h, 401, b"", {"WWW-Authenticate": 'Basic realm="reg"'})
            else:
                reply(h, 307, b"", {"Location": f"http://{storage.host}/bucket/blob?sig=1"})

        with scripted_server(registry) as srv, \
                RegistryClient(credentials={srv.host: ("bob", "secret")}, timeout=10) as client:
            ref = Reference.parse(f"{srv.host}/app:v1")
            assert client.get_blob(ref, DIGEST) == BLOB
            assert client.read_blob_range(ref, DIGEST, 1000, 24) == BLOB[1000:1024]
        assert len(storage.seen) == 2
        assert all("Authorization" not in s.headers for s in storage.seen)
        assert storage.seen[1].headers.get("Range") == "bytes=1000-1023"


def test_integrity_errors() -> None:
    def liar(h: BaseHTTPRequestHandler) -> None:
        reply(h, 200, BLOB[::-1])

    with scripted_server(liar) as srv, RegistryClient(timeout=5) as client:
        ref = Reference.parse(f"{srv.host}/app:v1")
        with pytest.raises(IntegrityError):
            client.get_blob(ref, DIGEST)
        with pytest.raises(IntegrityError):
            client.get_manifest(ref.with_digest(DIGEST))


def test_mirror_first_then_server(tmp_path: Path) -> None:
    with scripted_server(lambda h: reply(h, 404, b"")) as mirror, \
            scripted_server(_serve_blob) as upstream:
        hosts = tmp_path / "certs.d" / upstream.host
        hosts.mkdir(parents=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{upstream.host}"\n'
            f'[host."http://{mirror.host}"]\n  capabilities = ["pull", "resolve"]\n'
            f'  [host."http://{mirror.host}".header]\n    x-mirror-key = "k1"\n')
        with RegistryClient(hosts_dir=tmp_path / "certs.d", timeout=10) as client:
            ref = Reference.parse(f"{upstream.host}/app:v1")
            assert client.get_blob(ref, DIGEST) == BLOB
        assert len(mirror.seen) == 1
        assert parse_qs(urlsplit(mirror.seen[0].path).query)["ns"] == [upstream.host]
        assert mirror.seen[0].headers.get("x-mirror-key") == "k1"
        assert len(upstream.seen) == 1 and "ns=" not in upstream.seen[0].path


def test_not_found_and_unreachable(tmp_path: Path) -> None:
    with scripted_server(lambda h: reply(h, 404, b'{"errors":[{"code":"BLOB_UNKNOWN",'
                                                 b'"message":"blob unknown"}]}')) as srv, \
            RegistryClient(timeout=5) as client:
        with pytest.raises(NotFound, match="BLOB_UNKNOWN"):
            client.get_blob(Reference.parse(f"{srv.host}/app:v1"), DIGEST)
        assert not client.blob_exists(Reference.parse(f"{srv.host}/app:v1"), DIGEST)
        port = srv.port
    # the server is gone: connection refused, retried, then Unavailable
    with RegistryClient(timeout=5, retries=1, backoff=0.01) as client, \
            pytest.raises(Unavailable, match="cannot reach"):
        client.blob_size(Reference.parse(f"127.0.0.1:{port}/app:v1"), DIGEST)


def test_download_resumes_after_connection_loss() -> None:
    def flaky(h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Range"):
            _serve_blob(h)
            return
        h.send_response(200)
        h.send_header("Content-Length", str(len(BLOB)))
        h.end_headers()
        h.wfile.write(BLOB[:40_000])
        h.wfile.flush()
        h.close_connection = True   # the connection drops mid-body

    with scripted_server(flaky) as srv, \
            RegistryClient(timeout=10, retries=2, backoff=0.01) as client:
        assert client.get_blob(Reference.parse(f"{srv.host}/app:v1"), DIGEST) == BLOB
        assert [s.headers.get("Range") for s in srv.seen] == [None, "bytes=40000-"]


def test_range_reads_reuse_one_connection() -> None:
    with scripted_server(_serve_blob) as srv, RegistryClient(timeout=10) as client:
        ref = Reference.parse(f"{srv.host}/app:v1")
        for i in range(6):
            assert client.read_blob_range(ref, DIGEST, i * 1000, 100) == \
                BLOB[i * 1000:i * 1000 + 100]
        # every 206 body is read to its end, so the pooled connection is reused: the general
        # client's for the first read, then the direct path's (coldstart.remote.rangeconn)
        peers = [s.peer for s in srv.seen]
        assert len(peers) == 6 and len(set(peers)) == 2 and len(set(peers[1:])) == 1


def test_identity_token_uses_oauth2_refresh_flow(tmp_path: Path) -> None:
    forms: list[dict[str, list[str]]] = []

    def handler(h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/oauth"):
            body = h.rfile.read(int(h.headers["Content-Length"]))
            forms.append(parse_qs(body.decode()))
            reply(h, 200, json.dumps({"access_token": "acc-1", "expires_in": 60}).encode())
        elif h.headers.get("Authorization") == "Bearer acc-1":
            _serve_blob(h)
        else:
            reply(h, 401, b"", {"WWW-Authenticate": f'Bearer realm="http://'
                                f'{h.headers["Host"]}/oauth",service="reg"'})

    config = tmp_path / "config.json"
    with scripted_server(handler) as srv:
        config.write_text(json.dumps({"auths": {srv.host: {"identitytoken": "refresh-xyz"}}}))
        with RegistryClient(docker_config=config, timeout=10) as client:
            assert client.get_blob(Reference.parse(f"{srv.host}/app:v1"), DIGEST) == BLOB
    assert forms == [{"grant_type": ["refresh_token"], "refresh_token": ["refresh-xyz"],
                      "service": ["reg"], "scope": ["repository:app:pull"],
                      "client_id": ["coldstart"]}]


def test_direct_range_reads_stop_at_a_stall_and_fall_back_on_refusal() -> None:
    """After the first read, ranges go over the direct path (coldstart.remote.rangeconn): a
    body that stalls ends at the deadline (retried), a 500 is retried through the general
    client, and each read still returns the right bytes.

    The stalled body is held until the test ends (30 s at most): a read that comes back with
    DeadlineExceeded while the server still holds it gave up at its own deadline; one that
    waited the stall out would find ``stall_ran_out`` set."""
    state: dict[str, int | bool] = {"n": 0}

    def handler(h: BaseHTTPRequestHandler) -> None:
        state["n"] += 1
        rng = h.headers["Range"].removeprefix("bytes=").split("-")
        start, end = int(rng[0]), int(rng[1])
        if state["n"] == 2:         # the first direct read: 500
            reply(h, 500, b"oops")
            return
        body = BLOB[start:end + 1]
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{end}/{len(BLOB)}")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if state["n"] == 4:         # a direct read whose body stalls after 10 bytes
            h.wfile.write(body[:10])
            h.wfile.flush()
            state["stall_ran_out"] = not stop.wait(30)     # held until the test ends
            h.close_connection = True
            return
        h.wfile.write(body)

    # a deadline no ordinary read meets on a busy machine (one that did was retried, and the
    # request counts below were off by it); the stall outlasts it
    with scripted_server(handler) as srv, \
            RegistryClient(timeout=5.0, retries=2, backoff=0.01) as client:
        stop = srv.stop
        ref = Reference.parse(f"{srv.host}/app:v1")
        for i in range(2):
            assert client.read_blob_range(ref, DIGEST, i * 100, 100) == \
                BLOB[i * 100:i * 100 + 100]
        assert state["n"] == 3      # the 500 went to the general client, which got the bytes
        with pytest.raises(DeadlineExceeded, match=r"stalled|deadline"):
            client.read_blob_range(ref, DIGEST, 200, 100)
        # ended by its deadline while the body was still stalled, not by the server's close
        assert state["n"] == 4 and "stall_ran_out" not in state, state
        assert client.read_blob_range(ref, DIGEST, 300, 100) == BLOB[300:400]
        assert state["n"] == 5      # one request each, direct again
