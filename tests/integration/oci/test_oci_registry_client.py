"""RegistryClient against a real docker-registry: uploads, mounts, manifests, ranges, skopeo."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from coldstart.errors import FormatError, IntegrityError, InvalidArgument, NotFound, Unavailable
from coldstart.oci.auth import AuthError
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import OCI_INDEX, OCI_MANIFEST, Platform, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote import RegistryBlob, open_blob
from tests.fixtures.registry import AuthRegistry, Registry, TLSRegistry, faulty_proxy, reply
from tests.integration.oci.oci_testimages import (
    base_layer,
    build_image,
    push_image,
    push_index,
    upper_layer,
    write_layout,
)

pytestmark = pytest.mark.integration

BLOB = hashlib.shake_256(b"blob").digest(1_500_000)


def _ref(registry: Registry, repo: str, tag: str = "latest") -> Reference:
    return Reference.parse(f"{registry.host}/{repo}:{tag}")


@pytest.fixture
def client() -> Iterator[RegistryClient]:
    with RegistryClient(timeout=20) as c:
        yield c


def test_monolithic_and_chunked_uploads(registry: Registry, client: RegistryClient,
                                        tmp_path: Path) -> None:
    ref = _ref(registry, "client/uploads")
    d = digest_of(BLOB)
    assert not client.blob_exists(ref, d)
    assert client.push_blob(ref, BLOB) == d
    assert client.blob_size(ref, d) == len(BLOB)
    assert client.get_blob(ref, d) == BLOB

    other = BLOB[::-1]
    path = tmp_path / "blob"
    path.write_bytes(other)
    od = client.push_blob(ref, path, chunk_size=256 * 1024)   # 6 PATCHes then PUT
    assert od == digest_of(other)
    buf = io.BytesIO()
    assert client.download_blob(ref, od, buf, size=len(other)) == len(other)
    assert buf.getvalue() == other
    log = registry.access_log.read_text()
    assert log.count("PATCH /v2/client/uploads/blobs/uploads/") >= 6

    # a wrong digest is refused by the registry and nothing is stored under it
    wrong = digest_of(b"something else")
    with pytest.raises(IntegrityError):
        client.push_blob(ref, b"payload", wrong)
    assert not client.blob_exists(ref, wrong)


def test_cross_repository_mount(registry: Registry, client: RegistryClient) -> None:
    src, dst = _ref(registry, "client/mount-src"), _ref(registry, "client/mount-dst")
    data = b"mount me" * 1000
    d = client.push_blob(src, data)
    assert not client.blob_exists(dst, d)
    assert client.mount_blob(dst, d, "client/mount-src") is True
    assert client.get_blob(dst, d) == data
    # not in the source repository: the registry declines and we report False
    assert client.mount_blob(dst, digest_of(b"absent"), "client/mount-src") is False


def test_manifest_push_get_resolve_index(registry: Registry, client: RegistryClient) -> None:
    ref = _ref(registry, "client/multi", "v1")
    amd = build_image([upper_layer()], arch="amd64")
    arm = build_image([upper_layer(), b"\0" * 1024], arch="arm64")
    index_digest = push_index(client, ref, [("amd64", amd), ("arm64", arm)])
    body, media, digest = client.get_manifest(ref)
    assert media == OCI_INDEX and digest == index_digest and digest_of(body) == digest
    r = client.resolve(ref, Platform.parse("linux/arm64"))
    assert r.digest == arm.manifest_digest and r.index_digest == index_digest
    assert len(r.manifest.layers) == 2 and r.ref.digest == arm.manifest_digest
    assert client.resolve(ref, Platform.parse("linux/amd64")).manifest_bytes == amd.manifest
    with pytest.raises(NotFound, match="s390x"):
        client.resolve(ref, Platform.parse("linux/s390x"))
    with pytest.raises(NotFound):
        client.get_manifest(ref.with_tag("missing"))
    with pytest.raises(NotFound):
        client.get_manifest(Reference.parse(f"{registry.host}/client/no-such-repo:x"))
    head = client.head_manifest(ref)
    assert head.digest == index_digest and head.size == len(body)


def test_range_reads_and_blob_source(registry: Registry, client: RegistryClient) -> None:
    ref = _ref(registry, "client/ranges")
    d = client.push_blob(ref, BLOB)
    assert client.read_blob_range(ref, d, 0, 10) == BLOB[:10]
    assert client.read_blob_range(ref, d, 1000, 70_000) == BLOB[1000:71_000]
    assert client.read_blob_range(ref, d, len(BLOB) - 5, 100) == BLOB[-5:]  # short at the end

    blob = open_blob(client, ref, d)
    assert isinstance(blob, RegistryBlob)
    assert blob.size() == len(BLOB)
    parts = blob.read_ranges([(500, 10), (0, 100), (120, 30), (1_000_000, 5)], max_gap=64)
    assert parts == [BLOB[500:510], BLOB[:100], BLOB[120:150], BLOB[1_000_000:1_000_005]]
    assert blob.requests == 1 + 3      # HEAD, then (0..150) + (500..510) + (1e6..)
    requests = blob.requests
    with pytest.raises(FormatError, match="outside"):
        blob.read_at(len(BLOB) - 1, 2)
    assert blob.requests == requests   # refused from the known size, nothing asked

    # many threads share the client and the blob
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(5):
                off = (i * 7919 + j * 104_729) % (len(BLOB) - 4096)
                assert blob.read_at(off, 4096) == BLOB[off:off + 4096]
        except BaseException as exc:  # report from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert blob.bytes >= 40 * 4096


def test_range_read_when_server_ignores_range(registry: Registry) -> None:
    with RegistryClient(timeout=20) as client:
        ref = _ref(registry, "client/norange")
        d = client.push_blob(ref, BLOB)
    with faulty_proxy(registry.host, ignore_range=True) as proxy, \
            RegistryClient(timeout=20) as client:
        pref = Reference.parse(f"{proxy.host}/client/norange:latest")
        assert client.read_blob_range(pref, d, 777_777, 1234) == BLOB[777_777:777_777 + 1234]
        assert client.read_blob_range(pref, d, 0, 3) == BLOB[:3]
        gets = [s for s in proxy.seen if s.method == "GET"]
        assert len(gets) == 2 and all(s.headers.get("Range") for s in gets)


def test_several_ranges_in_one_request_where_the_registry_answers_those(
        registry: Registry, client: RegistryClient) -> None:
    ref = _ref(registry, "client/multirange")
    d = client.push_blob(ref, BLOB)
    want = [(100, 1000), (50_000, 4096), (1_400_000, 65_536), (len(BLOB) - 7, 7)]
    assert not client.reads_many(ref)       # range reads do not go direct yet
    client.read_blob_range(ref, d, 0, 10)   # the first through the general client, then direct
    assert client.reads_many(ref)
    got, requests = client.read_blob_ranges(ref, d, want)
    assert got == [BLOB[a:a + n] for a, n in want] and requests == 1

    # a registry that fails one (503) is asked range by range that time, and again after
    busy = [1]

    def once_busy(h: BaseHTTPRequestHandler, n: int) -> bool:
        if "," in h.headers.get("Range", "") and busy:
            busy.pop()
            reply(h, 503, b"busy")
            return True
        return False

    with faulty_proxy(registry.host, once_busy) as proxy, RegistryClient(timeout=20) as other:
        pref = Reference.parse(f"{proxy.host}/client/multirange:latest")
        other.read_blob_range(pref, d, 0, 10)
        assert other.read_blob_ranges(pref, d, want) == ([BLOB[a:a + n] for a, n in want], 4)
        assert other.reads_many(pref)
        assert other.read_blob_ranges(pref, d, want) == ([BLOB[a:a + n] for a, n in want], 1)

    # a registry that answers them with the whole blob (an object store behind it: S3 does)
    # is asked one range per request, and not asked a multi-range request again
    def whole(h: BaseHTTPRequestHandler, n: int) -> bool:
        if "," in h.headers.get("Range", ""):
            reply(h, 200, BLOB)
            return True
        return False

    with faulty_proxy(registry.host, whole) as proxy, RegistryClient(timeout=20) as other:
        pref = Reference.parse(f"{proxy.host}/client/multirange:latest")
        other.read_blob_range(pref, d, 0, 10)
        for _ in range(2):
            got, requests = other.read_blob_ranges(pref, d, want)
            assert got == [BLOB[a:a + n] for a, n in want] and requests == len(want)
        assert len([s for s in proxy.seen if "," in s.headers.get("Range", "")]) == 1
        assert not other.reads_many(pref)


def test_retries_transient_errors_on_real_registry(registry: Registry) -> None:
    def fault(h: object, n: int) -> bool:
        from tests.fixtures.registry import reply
        if n % 3 == 0:          # every third request fails with 503
            reply(h, 503, b"busy")  # type: ignore[arg-type]
            return True
        return False

    with faulty_proxy(registry.host, fault) as proxy, \
            RegistryClient(timeout=20, retries=4, backoff=0.01) as client:
        ref = Reference.parse(f"{proxy.host}/client/flaky:v1")
        image = build_image([upper_layer()])
        push_image(client, ref, image)
        assert client.resolve(ref).manifest_bytes == image.manifest
        blob = image.blobs[0]
        assert client.get_blob(ref, digest_of(blob)) == blob


def test_upload_restarts_after_a_failed_patch(registry: Registry, tmp_path: Path) -> None:
    failed: list[str] = []

    def fault(h: object, n: int) -> bool:
        from tests.fixtures.registry import reply
        assert isinstance(h, BaseHTTPRequestHandler)
        if h.command == "PATCH" and not failed:
            failed.append(h.path)
            reply(h, 500, b"disk full")
            return True
        return False

    data = hashlib.shake_256(b"restart").digest(700_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with faulty_proxy(registry.host, fault) as proxy, \
            RegistryClient(timeout=20, retries=2, backoff=0.01) as client:
        ref = Reference.parse(f"{proxy.host}/client/restart:v1")
        d = client.push_blob(ref, path, chunk_size=300_000)
        assert failed and client.get_blob(ref, d) == data
        posts = [s for s in proxy.seen if s.method == "POST"]
        assert len(posts) == 2     # the failed session was abandoned, a new one finished


def test_errors_are_clear(registry: Registry, client: RegistryClient) -> None:
    ref = _ref(registry, "client/errors")
    with pytest.raises(NotFound, match="404"):
        client.get_blob(ref, digest_of(b"nope"))
    with pytest.raises(InvalidArgument):
        client.get_blob(ref, "sha256:xyz")
    with pytest.raises(InvalidArgument):
        client.push_manifest(ref, b"{not json", OCI_MANIFEST)


def _skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(["skopeo", "--insecure-policy", *args], capture_output=True,
                          text=True, timeout=120, env=env, check=False)


def test_skopeo_interop(registry: Registry, client: RegistryClient, tmp_path: Path) -> None:
    image = build_image([base_layer(busybox=False, big=50_000), upper_layer()])
    write_layout(tmp_path / "src", image, "v1")
    # skopeo pushes an oci: layout we wrote; our client reads what it pushed
    out = _skopeo("copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'src'}:v1",
                  f"docker://{registry.host}/interop/from-skopeo:v1")
    assert out.returncode == 0, out.stderr
    r = client.resolve(Reference.parse(f"{registry.host}/interop/from-skopeo:v1"))
    assert [layer.digest for layer in r.manifest.layers] == \
        [d.digest for d in image.descriptors()]
    assert client.get_blob(r.ref, image.descriptors()[1].digest) == image.blobs[1]

    # we push; skopeo inspects and copies it back into an oci: layout
    ref = Reference.parse(f"{registry.host}/interop/from-us:v2")
    digest = push_image(client, ref, image)
    out = _skopeo("inspect", "--tls-verify=false", "--raw", f"docker://{ref}")
    assert out.returncode == 0, out.stderr
    assert digest_of(out.stdout.encode()) == digest
    out = _skopeo("copy", "--src-tls-verify=false", f"docker://{ref}",
                  f"oci:{tmp_path / 'back'}:v2")
    assert out.returncode == 0, out.stderr
    back = OciLayout(tmp_path / "back")
    entry = back.resolve("v2")
    manifest = json.loads(back.read_blob(entry.digest))
    assert [layer["digest"] for layer in manifest["layers"]] == \
        [d.digest for d in image.descriptors()]
    assert back.read_blob(manifest["config"]["digest"]) == image.config


def test_basic_auth_registry(auth_registry: AuthRegistry, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    secret = f"{auth_registry.username}:{auth_registry.password}".encode()
    config.write_text(json.dumps({"auths": {auth_registry.host: {
        "auth": base64.b64encode(secret).decode()}}}))
    ref = Reference.parse(f"{auth_registry.host}/private/app:v1")
    image = build_image([upper_layer()])
    with RegistryClient(docker_config=config, timeout=20) as client:
        digest = push_image(client, ref, image)
        assert client.resolve(ref).digest == digest
        assert client.read_blob_range(ref, image.descriptors()[0].digest, 0, 2) == b"\x1f\x8b"
    with RegistryClient(docker_config=tmp_path / "none.json", timeout=20) as client, \
            pytest.raises(AuthError, match="no credentials"):
        client.get_manifest(ref)
    with RegistryClient(credentials={auth_registry.host: ("coldstart", "wrong")},
                        docker_config=tmp_path / "none.json", timeout=20) as client, \
            pytest.raises(AuthError, match="'coldstart'"):
        client.get_manifest(ref)
    # skopeo reads what we pushed with the same credentials
    out = _skopeo("inspect", "--tls-verify=false", "--raw",
                  "--creds", f"{auth_registry.username}:{auth_registry.password}",
                  f"docker://{ref}")
    assert out.returncode == 0, out.stderr
    assert digest_of(out.stdout.encode()) == digest


def test_tls_registry_with_hosts_toml(tls_registry: TLSRegistry, tmp_path: Path) -> None:
    certs = tmp_path / "certs.d"
    (certs / tls_registry.host).mkdir(parents=True)
    hosts = certs / tls_registry.host / "hosts.toml"
    ref = Reference.parse(f"{tls_registry.host}/tls/app:v1")
    image = build_image([upper_layer()])

    # the CA named in hosts.toml (relative to the file) is trusted
    shutil.copy(tls_registry.ca, hosts.parent / "ca.pem")
    hosts.write_text(f'server = "https://{tls_registry.host}"\nca = "ca.pem"\n')
    with RegistryClient(hosts_dir=certs, timeout=20) as client:
        digest = push_image(client, ref, image)
        assert client.resolve(ref).digest == digest

    # without it the certificate is refused at once, with a hint
    hosts.write_text(f'server = "https://{tls_registry.host}"\n')
    with RegistryClient(hosts_dir=certs, timeout=20, retries=3) as client, \
            pytest.raises(Unavailable, match="TLS verification"):
        client.get_manifest(ref)

    # skip_verify trusts anything
    hosts.write_text(f'server = "https://{tls_registry.host}"\nskip_verify = true\n')
    with RegistryClient(hosts_dir=certs, timeout=20) as client:
        assert client.get_manifest(ref)[2] == digest
