"""A long-lived RegistryClient (the FUSE server's) with only the CRI keychain for credentials:
against Debian's docker-registry with htpasswd auth, the password changes on the registry and
the client keeps reading once the new one is in the keychain; against a scripted token server,
a cached bearer token that is refused makes the client authenticate again with the keychain's
current credentials."""

from __future__ import annotations

import base64
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from coldstart.oci.auth import AuthError
from coldstart.oci.credentials import Credentials
from coldstart.oci.keychain import Keychain
from coldstart.oci.manifest import digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.registry import AccessLog, start_registry, write_htpasswd
from tests.fixtures.registry import reply, scripted_server

pytestmark = pytest.mark.integration

BLOB = bytes(range(256)) * 512
DIGEST = digest_of(BLOB)


def test_keychain_credentials_follow_a_password_change(tmp_path: Path) -> None:
    htpasswd = write_htpasswd(tmp_path / "htpasswd", {"alice": "pw-one"})
    empty = tmp_path / "docker-config.json"
    empty.write_text("{}")
    with start_registry(tmp_path / "registry", htpasswd=htpasswd) as reg:
        first = Reference.parse(f"{reg.host}/team/first:v1")
        with RegistryClient(credentials={reg.host: ("alice", "pw-one")},
                            docker_config=empty, timeout=20) as pusher:
            pusher.push_blob(first, BLOB, DIGEST)

        kc = Keychain(tmp_path / "cri-credentials")
        reader = RegistryClient(docker_config=empty, keychain=kc, timeout=20)
        with reader:
            with pytest.raises(AuthError, match="no credentials") as nothing:
                reader.read_blob_range(first, DIGEST, 0, 16)
            assert "cri-credentials" in str(nothing.value)

            kc.put(first.name, Credentials("alice", "pw-one"))   # PullImage, first image
            assert reader.read_blob_range(first, DIGEST, 100, 50) == BLOB[100:150]

            # the password changes on the registry: the registry re-reads its htpasswd file
            # (docker-registry 2.8 checks its mtime on each request; no restart needed)
            write_htpasswd(htpasswd, {"alice": "pw-two"})
            with pytest.raises(AuthError) as refused:
                reader.read_blob_range(first, DIGEST, 0, 16)
            msg = str(refused.value)
            assert "\n" not in msg and "'alice'" in msg and reg.host in msg, msg
            assert "pw-" not in msg                       # never a secret in a message

            # a new PullImage (a second image) hands over the new password: the same client
            # reads the second image, and the first one still
            second = Reference.parse(f"{reg.host}/team/second:v1")
            with RegistryClient(credentials={reg.host: ("alice", "pw-two")},
                                docker_config=empty, timeout=20) as pusher:
                pusher.push_blob(second, BLOB[::-1], digest_of(BLOB[::-1]))
            kc.put(second.name, Credentials("alice", "pw-two"))
            assert reader.read_blob_range(second, digest_of(BLOB[::-1]), 0, 8) == \
                BLOB[::-1][:8]
            # the first image's own entry is stale (kubelet has not pulled it again): refused,
            # the client tries the registry's other, newer entry once, then keeps using it
            log = AccessLog(reg.access_log)
            for i in range(3):
                assert reader.read_blob_range(first, DIGEST, i * 64, 64) == \
                    BLOB[i * 64:(i + 1) * 64]
            codes = [r.status for r in log.requests()]
            assert codes == [401, 206, 206, 206], codes
            kc.put(first.name, Credentials("alice", "pw-two"))   # its next PullImage
            assert reader.read_blob_range(first, DIGEST, 4096, 64) == BLOB[4096:4160]

            # wrong credentials, and no other entry that works: a one-line AuthError naming
            # the first choice
            write_htpasswd(htpasswd, {"alice": "pw-three"})
            kc.put(first.name, Credentials("mallory", "guess"))
            with pytest.raises(AuthError, match="'mallory'") as wrong:
                reader.read_blob_range(first, DIGEST, 0, 16)
            assert "\n" not in str(wrong.value)


def test_a_refused_bearer_token_is_replaced_using_the_rotated_keychain(tmp_path: Path) -> None:
    state = {"password": "pw-one", "generation": 1}
    tokens: list[str] = []

    def handler(h: BaseHTTPRequestHandler) -> None:
        url = urlsplit(h.path)
        if url.path == "/token":
            want = "Basic " + base64.b64encode(f"ci:{state['password']}".encode()).decode()
            if h.headers.get("Authorization") != want:
                reply(h, 401, b"")
                return
            tokens.append(h.headers["Authorization"])
            scope = parse_qs(url.query)["scope"][0]
            body = json.dumps({"token": f"tok{state['generation']}-{scope}",
                               "expires_in": 3600}).encode()
            reply(h, 200, body)
            return
        repo = url.path.removeprefix("/v2/").split("/blobs/")[0]
        if h.headers.get("Authorization") != \
                f"Bearer tok{state['generation']}-repository:{repo}:pull":
            realm = f"http://{h.headers['Host']}/token"
            reply(h, 401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                "WWW-Authenticate": f'Bearer realm="{realm}",service="test",'
                                    f'scope="repository:{repo}:pull"'})
            return
        rng = h.headers["Range"].removeprefix("bytes=").split("-")
        start, end = int(rng[0]), int(rng[1])
        reply(h, 206, BLOB[start:end + 1],
              {"Content-Range": f"bytes {start}-{end}/{len(BLOB)}"})

    kc = Keychain(tmp_path / "kc")
    with scripted_server(handler) as srv, \
            RegistryClient(docker_config=tmp_path / "none.json", keychain=kc,
                           timeout=10) as client:
        ref = Reference.parse(f"{srv.host}/app:v1")
        kc.put(ref.name, Credentials("ci", "pw-one"))
        for i in range(3):
            assert client.read_blob_range(ref, DIGEST, i, 4) == BLOB[i:i + 4]
        assert len(tokens) == 1                           # cached for the scope
        # the credentials rotate: old tokens are revoked, the old password refused
        state.update(password="pw-two", generation=2)
        kc.put(ref.name, Credentials("ci", "pw-two"))
        assert client.read_blob_range(ref, DIGEST, 10, 4) == BLOB[10:14]
        assert len(tokens) == 2 and "pw-two" not in tokens[0]
        assert client.read_blob_range(ref, DIGEST, 20, 4) == BLOB[20:24]
        assert len(tokens) == 2


def test_basic_auth_retries_once_when_the_keychain_changed_in_flight(tmp_path: Path) -> None:
    kc = Keychain(tmp_path / "kc")

    def basic(pw: str) -> str:
        return "Basic " + base64.b64encode(f"ci:{pw}".encode()).decode()

    state = {"good": basic("pw-one")}
    sent: list[str] = []

    def handler(h: BaseHTTPRequestHandler) -> None:
        auth = h.headers.get("Authorization", "")
        sent.append(auth)
        if auth != state["good"]:
            if auth:    # the CRI proxy writes the new password while this request is refused
                kc.put(f"{h.headers['Host']}/app:v1", Credentials("ci", "pw-two"))
            reply(h, 401, b"", {"WWW-Authenticate": 'Basic realm="reg"'})
            return
        rng = h.headers["Range"].removeprefix("bytes=").split("-")
        start, end = int(rng[0]), int(rng[1])
        reply(h, 206, BLOB[start:end + 1],
              {"Content-Range": f"bytes {start}-{end}/{len(BLOB)}"})

    with scripted_server(handler) as srv, \
            RegistryClient(docker_config=tmp_path / "none.json", keychain=kc,
                           timeout=10) as client:
        ref = Reference.parse(f"{srv.host}/app:v1")
        kc.put(ref.name, Credentials("ci", "pw-one"))
        assert client.read_blob_range(ref, DIGEST, 0, 4) == BLOB[:4]
        assert sent == ["", basic("pw-one")]       # learnt Basic, then sent it up front
        state["good"] = basic("pw-two")             # the password changes on the registry
        assert client.read_blob_range(ref, DIGEST, 4, 4) == BLOB[4:8]
        # pw-one refused (the keychain got pw-two meanwhile): one more try, with pw-two
        assert sent[2:] == [basic("pw-one"), basic("pw-two")]
        # the same client refused with unchanged credentials: no second try, a clear error
        state["good"] = basic("pw-three")
        n = len(sent)
        kc.put(ref.name, Credentials("ci", "pw-two"))
        with pytest.raises(AuthError, match="'ci'"):
            client.read_blob_range(ref, DIGEST, 8, 4)
        assert len(sent) == n + 1
