"""Every source (local, S3 on moto_server, HTTP with Range, registry blob) loads identically."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coldstart.errors import FailedPrecondition, FormatError, NotFound, Unavailable
from coldstart.weights import LoadStats, Slice, load
from tests.fixtures.registry import Registry
from tests.fixtures.s3 import s3_client
from tests.integration.weights.conftest import RangeServer, url_of
from tests.unit.weights.weights_data import assert_identical, every_dtype, save, save_sharded

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return every_dtype(seed=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor]) -> Path:
    root = tmp_path_factory.mktemp("src")
    save(tensors, root / "model.safetensors")
    save_sharded(tensors, root / "sharded")
    return root


def _reference(files: Path) -> dict[str, torch.Tensor]:
    return load_file(str(files / "model.safetensors"))


@pytest.fixture
def bucket(s3: str, files: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
           ) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    name: str = "weights-" + str(request.node.name).lower().replace("_", "-")[:40]
    client = s3_client(s3)
    client.create_bucket(Bucket=name)
    for path in files.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), name, str(path.relative_to(files)))
    return name


def test_http_single_file_and_sharded(http_files: RangeServer, files: Path) -> None:
    for p in files.rglob("*"):
        if p.is_file():
            dest = http_files.root / p.relative_to(files)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(p.read_bytes())
    ref = _reference(files)
    assert_identical(ref, load(url_of(http_files, "model.safetensors"), chunk_bytes=8192,
                               concurrency=4))
    assert any("bytes=" in r for r in http_files.requests)  # really ranged GETs
    assert_identical(ref, load(url_of(http_files, "sharded/model.safetensors.index.json")))
    assert_identical(ref, load(url_of(http_files, "sharded/")))  # index found by convention
    part = load(url_of(http_files, "model.safetensors"),
                select=lambda t: Slice(0, 1, 2) if t.name == "big.F32" else False)
    assert_identical({"big.F32": ref["big.F32"][1:2]}, part)
    with pytest.raises(NotFound):
        load(url_of(http_files, "absent.safetensors"))


def test_http_server_without_range_is_refused(http_files: RangeServer, files: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (http_files.root / "m.safetensors").write_bytes((files / "model.safetensors").read_bytes())
    from tests.integration.weights import conftest

    original = conftest._Handler.do_GET

    def no_range(self: conftest._Handler) -> None:
        del self.headers["Range"]
        original(self)

    monkeypatch.setattr(conftest._Handler, "do_GET", no_range)
    with pytest.raises(FailedPrecondition, match="ignored Range"):
        load(url_of(http_files, "m.safetensors"))


def test_http_connection_cut_mid_body_is_retried(http_files: RangeServer, files: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (http_files.root / "m.safetensors").write_bytes((files / "model.safetensors").read_bytes())
    from tests.integration.weights import conftest

    original = conftest._Handler.do_GET
    cuts: list[str] = []
    size = (http_files.root / "m.safetensors").stat().st_size

    def flaky(self: conftest._Handler) -> None:
        spec = self.headers.get("Range", "")
        if not cuts and spec and not spec.startswith("bytes=0-"):
            cuts.append(spec)  # first data range: promise the bytes, send half, hang up
            start, end = (int(x) for x in spec[len("bytes="):].split("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            self.wfile.write(b"\0" * ((end - start + 1) // 2))
            self.wfile.flush()
            self.close_connection = True
            return
        original(self)

    monkeypatch.setattr(conftest._Handler, "do_GET", flaky)
    got = load(url_of(http_files, "m.safetensors"), chunk_bytes=1 << 20, concurrency=1)
    assert cuts, "the cut was not exercised"
    assert_identical(_reference(files), got)


def test_s3_file_prefix_and_index(bucket: str, files: Path) -> None:
    ref = _reference(files)
    stats = LoadStats()
    got = load(f"s3://{bucket}/model.safetensors", chunk_bytes=8192, concurrency=4, stats=stats)
    assert_identical(ref, got)
    assert stats.reads > 1
    assert_identical(ref, load(f"s3://{bucket}/sharded/"))
    assert_identical(ref, load(f"s3://{bucket}/sharded/model.safetensors.index.json"))
    with pytest.raises(NotFound):
        load(f"s3://{bucket}/nothing.safetensors")
    with pytest.raises(NotFound):
        load(f"s3://{bucket}/empty-prefix/")


def test_s3_truncated_object_refused(bucket: str, files: Path, s3: str) -> None:
    data = (files / "model.safetensors").read_bytes()
    s3_client(s3).put_object(Bucket=bucket, Key="cut.safetensors", Body=data[: len(data) // 2])
    with pytest.raises(FormatError, match="MetadataIncompleteBuffer"):
        load(f"s3://{bucket}/cut.safetensors")


def test_s3_unreachable_endpoint_is_unavailable(files: Path, monkeypatch: pytest.MonkeyPatch,
                                                ) -> None:
    from tests.fixtures.procs import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(Unavailable):
        load("s3://b/model.safetensors", timeout=2.0)


def test_registry_blob(registry: Registry, files: Path) -> None:
    import hashlib

    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient

    data = (files / "model.safetensors").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    host = registry.host
    ref = Reference.parse(f"{host}/weights/model")
    client = RegistryClient()
    try:
        assert client.push_blob(ref, data, digest) == digest
    finally:
        client.close()
    got = load(f"registry://{host}/weights/model@{digest}", chunk_bytes=8192, concurrency=4)
    assert_identical(_reference(files), got)
    # A partial load is verified too: the bytes it skipped are read once, in order, to check.
    part = load(f"registry://{host}/weights/model@{digest}", select=["big.F32"], timeout=5.0)
    assert_identical({"big.F32": _reference(files)["big.F32"]}, part)
    missing = "sha256:" + "0" * 64
    with pytest.raises(NotFound):
        load(f"registry://{host}/weights/model@{missing}")


def test_registry_blob_tampered_in_storage_is_refused(registry: Registry, files: Path) -> None:
    """The registry's own storage is changed behind its back (same size): the load fails with
    IntegrityError naming the blob and hands out no tensor, whole or partial."""
    import hashlib

    from coldstart.errors import IntegrityError
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient
    from coldstart.weights import iter_load

    data = (files / "model.safetensors").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    host = registry.host
    client = RegistryClient()
    try:
        client.push_blob(Reference.parse(f"{host}/weights/tampered"), data, digest)
    finally:
        client.close()
    hexd = digest.split(":", 1)[1]
    stored = registry.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    assert stored.read_bytes() == data
    bad = bytearray(data)
    bad[-5] ^= 0xFF  # inside the last tensor: the header still parses
    stored.write_bytes(bytes(bad))
    url = f"registry://{host}/weights/tampered@{digest}"
    try:
        with pytest.raises(IntegrityError, match=f"{url}: blob content is sha256:"):
            load(url, chunk_bytes=8192, concurrency=4)
        names: list[str] = []
        with pytest.raises(IntegrityError):
            for name, _ in iter_load(url, chunk_bytes=8192, concurrency=4):
                names.append(name)
        assert names == []
        with pytest.raises(IntegrityError):  # the change is outside the selected tensor
            load(url, select=["scalar.F32"])
    finally:
        stored.write_bytes(data)  # the session-wide registry stays sound for other tests


def test_local_o_direct_read_matches(files: Path) -> None:
    from coldstart.weights import LocalSource

    src = LocalSource(files / "model.safetensors", direct=True)
    stats = LoadStats()
    got = load(src, stats=stats)
    assert_identical(_reference(files), got)
    if src.direct_refused is None:  # this filesystem takes O_DIRECT: it really ran
        assert src.direct_reads > 0 and stats.path.endswith("(O_DIRECT)")
    else:
        assert src.direct_reads == 0 and "O_DIRECT not used" in stats.path


def test_http_server_that_never_answers_hits_the_deadline() -> None:
    """A listener that accepts and stays silent: the load fails within its deadline, no hang."""
    import socket

    from coldstart.errors import DeadlineExceeded

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        with pytest.raises(DeadlineExceeded):
            load(f"http://127.0.0.1:{port}/m.safetensors", timeout=0.5)


def _dribbling(http_files: RangeServer, monkeypatch: pytest.MonkeyPatch, *, every: bool,
               seconds: float = 8.0) -> list[str]:
    """Make data ranges (not the header's ``bytes=0-``) dribble: one byte each 20 ms, so no
    socket read ever waits long enough to time out; after ``seconds`` the rest comes at once
    (so a loader without a deadline finishes, slowly, instead of hanging the test).
    ``every`` False: only the first data range dribbles. Returns the dribbled ranges."""
    import time

    from tests.integration.weights import conftest

    original = conftest._Handler.do_GET
    dribbled: list[str] = []
    lock = __import__("threading").Lock()

    def slow(self: conftest._Handler) -> None:
        spec = self.headers.get("Range", "")
        with lock:
            go = bool(spec) and not spec.startswith("bytes=0-") and (every or not dribbled)
            if go:
                dribbled.append(spec)
        if not go:
            original(self)
            return
        path = self._file()
        if path is None:
            return
        data = path.read_bytes()
        start, end = (int(x) for x in spec[len("bytes="):].split("-"))
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        stop = time.monotonic() + seconds
        try:
            pos = 0
            while pos < len(body) and time.monotonic() < stop:
                self.wfile.write(body[pos : pos + 1])
                self.wfile.flush()
                pos += 1
                time.sleep(0.02)
            self.wfile.write(body[pos:])
        except OSError:
            pass  # the client gave up on us: that is the point
        self.close_connection = True

    monkeypatch.setattr(conftest._Handler, "do_GET", slow)
    return dribbled


def test_http_dribbling_range_is_cut_off_and_retried(http_files: RangeServer, files: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that sends a byte every 20 ms never trips a per-read timeout; the range's own
    deadline cuts it off, and the retry (a healthy answer) completes the load.

    A loader without that deadline would also finish, slowly (the dribble ends after 8 s), but
    in one request: the second request for the same range is the evidence of the cut-off."""
    (http_files.root / "m.safetensors").write_bytes((files / "model.safetensors").read_bytes())
    dribbled = _dribbling(http_files, monkeypatch, every=False)
    got = load(url_of(http_files, "m.safetensors"), chunk_bytes=1 << 20, concurrency=1,
               timeout=1.0)
    assert dribbled, "the dribble was not exercised"
    assert_identical(_reference(files), got)
    retried = [r for r in http_files.requests if r.endswith(dribbled[0])]
    assert len(retried) == 2  # the cut-off range was asked for again, once


def test_http_dribbling_server_hits_the_deadline(http_files: RangeServer, files: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every data range dribbles: each attempt is cut off (a dribble that ran its 8 s would
    complete the load), and the range's budget of twice the timeout ends the retries: at most
    two attempts of one timeout each, of the 1 + 3 the retry count would allow."""
    from coldstart.errors import DeadlineExceeded

    (http_files.root / "m.safetensors").write_bytes((files / "model.safetensors").read_bytes())
    dribbled = _dribbling(http_files, monkeypatch, every=True)
    with pytest.raises(DeadlineExceeded, match=r"too slowly|timed out"):
        load(url_of(http_files, "m.safetensors"), chunk_bytes=1 << 20, concurrency=1,
             timeout=1.0)
    assert dribbled, "the dribble was not exercised"
    assert max(Counter(dribbled).values()) <= 2, dribbled


def test_s3_dribbling_body_hits_the_deadline(http_files: RangeServer, files: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """S3Source against a loopback server speaking just enough S3 (a ranged GET of
    ``/bucket/key``) that dribbles the body: cut off by the range deadline, not hung."""
    from coldstart.errors import DeadlineExceeded
    from coldstart.remote.s3 import S3Source
    from coldstart.remote.s3 import s3_client as make_client

    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    (http_files.root / "b").mkdir()
    (http_files.root / "b" / "m.safetensors").write_bytes(
        (files / "model.safetensors").read_bytes())
    dribbled = _dribbling(http_files, monkeypatch, every=True)
    client = make_client(timeout=1.0, endpoint_url=url_of(http_files).rstrip("/"))
    src = S3Source("s3://b/m.safetensors", client=client, timeout=1.0)
    buf = bytearray(64 << 10)
    with pytest.raises(DeadlineExceeded, match=r"too slowly|timed out"):
        src.read_into(4096, [memoryview(buf)])
    # cut off (not waited out), within the range's budget: at most two attempts
    assert 1 <= len(dribbled) <= 2, dribbled
    # A healthy range through the same client still reads (the pool's sockets are sound).
    monkeypatch.undo()
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    src.read_into(0, [memoryview(buf)])
    assert bytes(buf) == (files / "model.safetensors").read_bytes()[: len(buf)]
