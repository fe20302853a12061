"""``coldstart.weights`` on a lazily mounted layer: the files socket, through the real FUSE
server, a real registry and a proxy that can flip bytes.

The loader finds the file's token (an attribute only a lazily mounted file has), asks the node
for whole ranges over the files socket, and gets them verified and cached; anywhere else it
reads the file as before. The token is the trust boundary: forged or foreign tokens get
nothing."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

from coldstart.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs import control, filewire
from coldstart.lazyfs.filewire import FILE_XATTR, FileToken
from coldstart.weights import LoadStats, load, load_file, safe_open
from coldstart.weights.nodefile import NodeFileSource, node_source
from tests.fixtures.procs import wait_for
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import (
    Server,
    convert,
    fuse_server,
    in_cache,
    needs_resend,
    push_layer,
    tar_of,
)
from tests.integration.lazy.lazy_proxy import Proxy
from tests.unit.weights.weights_data import assert_identical, every_dtype, save, save_sharded

pytestmark = pytest.mark.integration

FORMATS = ["zstd:chunked", "estargz"]


def files_socket(tmp: Path) -> str:
    return str(tmp / "root" / "files" / "files.sock")    # "auto": beside the control socket


@pytest.fixture
def socket_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> str:
    path = files_socket(server[2])
    monkeypatch.setenv(filewire.SOCKET_ENV, path)
    return path


def mount_files(server: Server, proxy: Proxy, files: dict[str, bytes], fmt: str, name: str,
                chunk_size: int = 64 << 10) -> tuple[Path, bytes, dict[str, str]]:
    """``files`` as one ``fmt`` layer, pushed and mounted through the proxy."""
    _, client, tmp = server
    blob, res = convert(tar_of(files), fmt, chunk_size=chunk_size)
    spec = push_layer(proxy.upstream_host, f"weights/{name}", blob, res, pull_host=proxy.host)
    mp = tmp / name
    mp.mkdir()
    client.mount(str(mp), spec)
    return mp, blob, dict(res.annotations)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fast_path_loads_every_dtype_sharded_bit_identical(
        server: Server, proxy: Proxy, socket_env: str, tmp_path: Path, fmt: str) -> None:
    tensors = every_dtype(seed=11 + FORMATS.index(fmt))
    local = save_sharded(tensors, tmp_path / "local", shards=8).parent   # > 4: pooled
    files = {f"models/m/{p.name}": p.read_bytes() for p in sorted(local.iterdir())}
    mp, _, _ = mount_files(server, proxy, files, fmt, f"sharded-{fmt.replace(':', '-')}")
    shard = next(p for p in (mp / "models/m").iterdir() if p.suffix == ".safetensors")
    assert FILE_XATTR not in os.listxattr(shard)          # never listed: copies never carry it
    assert os.getxattr(shard, FILE_XATTR).startswith(b"cs1:sha256:")

    stats = LoadStats()
    got = load(mp / "models/m", stats=stats)
    assert "files socket" in stats.path
    want = {}
    for p in sorted(local.glob("*.safetensors")):
        want.update(safetensors.torch.load_file(str(p)))
    assert_identical(want, got)
    # safetensors' own API takes the same path, and so do single tensors and slices
    want_shard = safetensors.torch.load_file(str(local / shard.name))
    assert_identical(want_shard, load_file(shard))
    with safe_open(shard, framework="pt") as f:
        assert isinstance(f._source, NodeFileSource)
        names = f.keys()            # (safe_open is not iterable, as safetensors')
        assert_identical(want_shard, {name: f.get_tensor(name) for name in names})
        sliced = [n for n in names if len(f.get_slice(n).get_shape()) > 1
                  and f.get_slice(n).get_shape()[0] > 1 and want_shard[n].dtype.itemsize]
        assert sliced
        assert_identical({n: want_shard[n][1:] for n in sliced},
                         {n: f.get_slice(n)[1:] for n in sliced})


def test_without_the_socket_the_loader_reads_through_the_mount(
        server: Server, proxy: Proxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tensors = every_dtype(seed=21)
    data = save(tensors, tmp_path / "m.safetensors").read_bytes()
    mp, _, _ = mount_files(server, proxy, {"m.safetensors": data}, "zstd:chunked", "nosocket")
    monkeypatch.setenv(filewire.SOCKET_ENV, "")           # off
    # Fetched through FUSE first, with read(2), which releases the GIL: the loader's
    # MADV_POPULATE_READ (CPython's mmap.madvise holds it) would otherwise wait on a fetch
    # through the test proxy, which runs in this very process, until the FUSE deadline.
    assert (mp / "m.safetensors").read_bytes() == data
    stats = LoadStats()
    assert_identical(tensors, load(mp / "m.safetensors", stats=stats))
    assert "files socket" not in stats.path
    monkeypatch.setenv(filewire.SOCKET_ENV, str(tmp_path / "nothing-here.sock"))
    assert node_source(mp / "m.safetensors") is None     # refused: logged, read through FUSE
    monkeypatch.setenv(filewire.SOCKET_ENV, files_socket(server[2]))
    assert node_source(tmp_path / "m.safetensors") is None   # not on a lazy mount: no token
    assert node_source(mp) is None                            # a directory has none either


def test_a_layer_without_safetensors_files_gives_no_tokens(
        server: Server, proxy: Proxy, socket_env: str, tmp_path: Path) -> None:
    """Such a layer is served on the FUSE connection that answers no getxattr (nothing there
    for overlayfs to ask): its files have no token, and a loader reads them through the
    mount, as any file off a lazy mount."""
    tensors = every_dtype(seed=22)
    data = save(tensors, tmp_path / "m.safetensors").read_bytes()
    mp, _, _ = mount_files(server, proxy, {"weights.bin": data}, "zstd:chunked", "notoken")
    with pytest.raises(OSError) as err:
        os.getxattr(mp / "weights.bin", FILE_XATTR)
    assert err.value.errno == errno.EOPNOTSUPP
    assert node_source(mp / "weights.bin") is None
    assert (mp / "weights.bin").read_bytes() == data          # fetched through FUSE first
    stats = LoadStats()
    assert_identical(tensors, load(mp / "weights.bin", stats=stats))
    assert "files socket" not in stats.path


def test_a_flipped_byte_fails_the_load_naming_file_and_tensor_and_nothing_is_cached(
        server: Server, proxy: Proxy, socket_env: str, tmp_path: Path) -> None:
    _, client, tmp = server
    gen = torch.Generator().manual_seed(5)
    # incompressible: zstd stores it in raw blocks, which decode fine when flipped, so only
    # the chunk digest can tell
    tensors = {"a.small": torch.arange(16, dtype=torch.int32),
               "b.weights": torch.randint(0, 256, (400_000,), dtype=torch.uint8, generator=gen)}
    data = save(tensors, tmp_path / "m.safetensors").read_bytes()
    mp, blob, annotations = mount_files(server, proxy, {"m.safetensors": data}, "zstd:chunked",
                                        "flip")
    layer = open_layer(BytesReadAt(blob), annotations=annotations)
    chunks = layer.resolve("m.safetensors").chunks
    bad = chunks[len(chunks) // 2]                          # inside b.weights
    assert bad.digest and not in_cache(tmp / "root/cache", bad.digest)
    mid = (bad.offset + bad.end_offset) // 2
    proxy.flip = (mid, mid + 32)
    try:
        for _ in range(2):      # the wrong bytes were not kept anywhere either
            with pytest.raises(IntegrityError) as exc:
                load(mp / "m.safetensors")
            message = str(exc.value)
            assert str(mp / "m.safetensors") in message and "'b.weights'" in message
            assert bad.digest in message
    finally:
        proxy.flip = None
    assert not in_cache(tmp / "root/cache", bad.digest)
    # the proxy behaves again: the same load succeeds, and the chunk is cached for the node
    assert_identical(tensors, load(mp / "m.safetensors"))
    wait_for(lambda: in_cache(tmp / "root/cache", bad.digest), timeout=30,
             what="the chunk written to the cache")
    client.unmount(str(mp))


def _ask(path: str, request: dict[str, object], fd: int | None = None) -> object:
    """One request on a connection of its own; the decoded reply (or its error)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        line = control.encode(request)
        if fd is None:
            s.sendall(line)
        else:
            socket.send_fds(s, [line], [fd])
        buf = b""
        while b"\n" not in buf:
            data = s.recv(4096)
            assert data
            buf += data
        return control.decode_reply(buf.partition(b"\n")[0])


def _stat(path: str, token: str) -> object:
    return _ask(path, filewire.stat_request(token))


def test_forged_and_foreign_tokens_get_nothing(server: Server, proxy: Proxy, socket_env: str,
                                               tmp_path: Path) -> None:
    rng = random.Random(7)
    files = {"a.safetensors": rng.randbytes(50_000), "b.safetensors": rng.randbytes(60_000)}
    mp, _, _ = mount_files(server, proxy, files, "zstd:chunked", "tokens")
    good = FileToken.parse(os.getxattr(mp / "a.safetensors", FILE_XATTR).decode())
    other = FileToken.parse(os.getxattr(mp / "b.safetensors", FILE_XATTR).decode())
    assert _stat(socket_env, good.encode().decode()) == {"size": 50_000, "name": "a.safetensors"}

    def variant(**changes: object) -> str:
        fields = {**good.__dict__, **changes}
        return FileToken(**fields).encode().decode()   # type: ignore[arg-type]

    forged = [
        variant(mac=good.mac[:-1] + ("0" if good.mac[-1] != "0" else "1")),  # a guessed MAC
        variant(slot=other.slot),                   # another file of the same layer
        variant(size=other.size),
        variant(digest="sha256:" + "1" * 64),       # a layer the caller has no file of
        # a MAC made with another node's secret for the same file
        FileToken.issue(b"another node", good.digest, good.slot, good.size).encode().decode(),
    ]
    for token in forged:
        with pytest.raises(FailedPrecondition, match="not issued by this node"):
            _stat(socket_env, token)
    with pytest.raises(Exception, match="not a coldstart file token"):
        _stat(socket_env, "cs1:sha256:00:1:2:zz")
    # a real token of a layer no longer served
    client = server[1]
    client.unmount(str(mp))
    with pytest.raises(NotFound, match="not mounted"):
        _stat(socket_env, good.encode().decode())


# map the file and copy it out in file order, a MiB at a time (a page fault per page); print
# its sha256
_WALK = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    if sys.argv[2] == "random":
        m.madvise(mmap.MADV_RANDOM)     # the kernel reads no page ahead: a fault, a page
    h = hashlib.sha256()
    for off in range(0, len(m), 1 << 20):
        h.update(m[off:off + (1 << 20)])
print(h.hexdigest())
"""


@pytest.mark.parametrize("advice", ["normal", "random"])
def test_a_mapped_file_walked_in_order_by_page_faults_is_fetched_ahead_in_parallel(
        server: Server, proxy: Proxy, tmp_path: Path, advice: str) -> None:
    """What a safetensors loader does with a file through the mount: map it and copy it out
    in file order, page fault after page fault. The faults reach the FUSE server as small
    reads; the server sees a sequential reader and fetches the chunks ahead of it, several
    range requests at once, each far larger than a fault's read. ``random``: the mapping
    advised MADV_RANDOM, so the kernel reads nothing ahead (each fault: one 4 KiB read) and
    what is fetched ahead is the server's doing alone."""
    rng = random.Random(f"walk-{advice}")
    data = rng.randbytes(24 << 20)
    chunk = 256 << 10
    mp, blob, ann = mount_files(server, proxy, {"walk.safetensors": data}, "zstd:chunked",
                                f"walked-{advice}", chunk_size=chunk)
    layer = open_layer(BytesReadAt(blob), annotations=ann)
    chunks = [c for c in layer.resolve("walk.safetensors").chunks if not c.zeros]
    before = len(proxy.requests)
    proxy.max_in_flight = 0
    # in a process of its own: a page fault holds the GIL, and the proxy is a thread of ours
    walked = subprocess.run([sys.executable, "-c", _WALK, str(mp / "walk.safetensors"), advice],
                            capture_output=True, text=True, timeout=120, check=True)
    assert walked.stdout.strip() == hashlib.sha256(data).hexdigest()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    gets = [r for m, path, r in proxy.requests[before:] if m == "GET" and digest in path]
    # every chunk came, in requests of several chunks each (the faults read 4 KiB to 128 KiB)
    assert 0 < len(gets) <= len(chunks) // 2, (len(gets), len(chunks))
    assert proxy.max_in_flight >= 2                    # fetched ahead, in parallel


# Run in a mount namespace of its own: unmount every mount below ROOT (the layer's mountpoint,
# the FUSE file system's own directories), then, by HOW: "gone" nothing more; "forged" a
# tmpfs at each of those paths again, holding a file of the layer's file's name (what any
# container can do with a volume); "impostor" a root of its own (a tmpfs, chrooted into) whose
# file at that path carries the token as its user.* attribute; "container" an overlay whose
# lower layer is the layer's mountpoint (mounted before the unmounting, as a container's root
# is), chrooted into. Then
# ask the files socket with a token the parent read. Prints "served", or the error.
_ELSEWHERE = """
import ctypes, os, socket, sys
from coldstart.lazyfs import control, filewire
root, mp, name, token, sock, how, work = sys.argv[1:8]
libc = ctypes.CDLL(None, use_errno=True)

def mount(src, target, fstype, opts):
    assert libc.mount(src.encode(), target.encode(), fstype.encode(), 0, opts.encode()) == 0, \\
        os.strerror(ctypes.get_errno())

if how == "container":
    os.makedirs(work + "/empty"); os.makedirs(work + "/merged")
    mount("overlay", work + "/merged", "overlay", f"lowerdir={mp}:{work}/empty")
points = [line.split(" ")[4] for line in open("/proc/self/mountinfo")]
gone = [p for p in points if p.startswith(root + "/") and not p.startswith(work)]
for point in sorted(gone, key=len, reverse=True):
    libc.umount2(point.encode(), 2)         # MNT_DETACH
left = [line.split(" ")[4] for line in open("/proc/self/mountinfo")]
assert not [p for p in left if p.startswith(root + "/") and not p.startswith(work)]
if how == "forged":
    for point in sorted(set(gone), key=len):
        mount("tmpfs", point, "tmpfs", "size=1m")
    os.makedirs(os.path.dirname(os.path.join(mp, name)), exist_ok=True)
    with open(os.path.join(mp, name), "w") as f:
        f.write("not the layer's")
if how == "impostor":
    # a root of its own whose file at that path carries the stolen token as its attribute
    os.makedirs(work + "/fake")
    mount("tmpfs", work + "/fake", "tmpfs", "size=1m")
    os.makedirs(os.path.dirname(os.path.join(work, "fake", name)))
    with open(os.path.join(work, "fake", name), "w") as f:
        f.write("not the layer's")
    os.setxattr(os.path.join(work, "fake", name), filewire.FILE_XATTR, token.encode())
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sock)
if how in ("container", "impostor"):
    os.chroot(work + ("/merged" if how == "container" else "/fake"))
    os.chdir("/")
    assert os.path.exists("/" + name)
s.sendall(control.encode(filewire.stat_request(token)))
buf = b""
while b"\\n" not in buf:
    buf += s.recv(4096)
try:
    control.decode_reply(buf.partition(b"\\n")[0])
    print("served")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def test_a_token_serves_only_a_caller_that_can_see_its_file_itself(
        server: Server, proxy: Proxy, socket_env: str, tmp_path: Path) -> None:
    """A token is a bearer credential: one handed to (or stolen by) a process that cannot
    see the file itself (another container) reads nothing, even one that names the node's
    paths in its own mounts; a container whose root is an overlay over the layer (the file
    at the same path in its root) is served."""
    rng = random.Random(9)
    mp, _, _ = mount_files(server, proxy, {"m/w.safetensors": rng.randbytes(70_000)},
                           "zstd:chunked", "elsewhere")
    token = os.getxattr(mp / "m/w.safetensors", FILE_XATTR).decode()
    root = str(server[2])

    def ask(how: str) -> str:
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
             _ELSEWHERE, root, str(mp), "m/w.safetensors", token, socket_env, how,
             str(tmp_path / how)],
            capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert _stat(socket_env, token) == {"size": 70_000, "name": "m/w.safetensors"}  # here
    for how in ("gone", "forged", "impostor"):
        refused = ask(how)
        assert refused.startswith("FailedPrecondition") and "can see itself" in refused, \
            (how, refused)
    assert ask("container") == "served"


def memfd(size: int, *, faulted: bool = True, sealed: bool = True) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if faulted:
        os.pwrite(fd, bytes(size), 0)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, filewire.SEALS)
    return fd


def test_reads_past_the_end_and_bad_requests_are_refused(server: Server, proxy: Proxy,
                                                         socket_env: str,
                                                         tmp_path: Path) -> None:
    rng = random.Random(8)
    data = rng.randbytes(300_000)
    mp, _, _ = mount_files(server, proxy, {"f.safetensors": data}, "estargz", "ranges")
    src = node_source(mp / "f.safetensors")
    assert isinstance(src, NodeFileSource)
    try:
        assert src.size() == len(data)
        assert src.read_at(1000, 200_000) == data[1000:201_000]
        assert src.read_at(len(data) - 7, 7) == data[-7:]
        with pytest.raises(Exception, match="outside"):
            src.read_at(len(data) - 7, 8)
    finally:
        src.close()
    with pytest.raises(Unavailable, match="closed"):
        src.read_at(0, 1)                   # closed: at once, not after a deadline
    token = os.getxattr(mp / "f.safetensors", FILE_XATTR).decode()

    def read(fd: int | None, offset: int = 0, length: int = 4096, at: int = 0) -> object:
        return _ask(socket_env, filewire.read_request(token, offset, length, at), fd)

    fd = memfd(8192)
    other = tmp_path / "a-file-on-disk"
    other.write_bytes(bytes(8192))
    disk = os.open(other, os.O_RDWR)
    holes = memfd(8192, faulted=False)
    unsealed = memfd(8192, sealed=False)
    try:
        assert read(fd, 10, 100, 50) == 100
        assert os.pread(fd, 100, 50) == data[10:110]
        assert read(fd, len(data) - 5, 100) == 5        # short only at the end of the file
        with pytest.raises(InvalidArgument, match="do not fit the memfd"):
            read(fd, 0, 4096, 8000)
        with pytest.raises(InvalidArgument, match="at most"):
            read(fd, 0, filewire.MAX_READ + 1)
        with pytest.raises(InvalidArgument, match="must be a memfd"):
            read(disk)                      # never a file on a disk
        with pytest.raises(InvalidArgument, match="sealed"):
            read(unsealed)                  # whose size could change under the node
        with pytest.raises(InvalidArgument, match="no pages"):
            read(holes)                     # never memory the node would allocate
        assert os.fstat(holes).st_blocks == 0
        with pytest.raises(InvalidArgument, match="one descriptor"):
            read(None)
        with pytest.raises(InvalidArgument, match="integers >= 0"):
            read(fd, -1)
        with pytest.raises(InvalidArgument, match="unknown op"):
            _ask(socket_env, {"op": "nope", "token": token})
        # one connection, many requests, errors in between: it stays usable
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(socket_env)
            for request, want in ((filewire.read_request(token, 0, 10**9, 0), b'"ok": false'),
                                  (filewire.read_request(token, 0, 16, 0), b'"result": 16')):
                socket.send_fds(s, [control.encode(request)], [fd])
                reply = b""
                while not reply.endswith(b"\n"):
                    reply += s.recv(4096)
                assert want in reply
            # a request cut in two, its descriptor sent with the first part
            line = control.encode(filewire.read_request(token, 100, 16, 0))
            socket.send_fds(s, [line[:10]], [fd])
            s.sendall(line[10:])
            reply = b""
            while not reply.endswith(b"\n"):
                reply += s.recv(4096)
            assert b'"result": 16' in reply and os.pread(fd, 16, 0) == data[100:116]
    finally:
        for x in (fd, disk, holes, unsealed):
            os.close(x)


@needs_resend
def test_a_loader_goes_on_across_a_fuse_server_handover(tmp_path: Path, registry: Registry,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The old server exits on SIGUSR2 (an upgrade); a read started meanwhile waits for the
    successor, which issues new tokens: the source reads the attribute again and goes on."""
    rng = random.Random(9)
    data = rng.randbytes(3 << 20)
    blob, res = convert(tar_of({"w.safetensors": data}), "zstd:chunked")
    spec = push_layer(registry.host, "weights/handover", blob, res)
    mp = tmp_path / "mnt"
    mp.mkdir()
    monkeypatch.setenv(filewire.SOCKET_ENV, files_socket(tmp_path))
    with fuse_server(tmp_path, registry_host=registry.host) as (proc, client, _root):
        client.mount(str(mp), spec)
        src = node_source(mp / "w.safetensors")
        assert isinstance(src, NodeFileSource)
        try:
            assert src.read_at(0, 1 << 20) == data[: 1 << 20]
            before = os.getxattr(mp / "w.safetensors", FILE_XATTR)
            os.kill(proc.pid, signal.SIGUSR2)
            assert proc.wait(30) == 0
            got: list[bytes | BaseException] = []
            reader = threading.Thread(target=lambda: got.append(
                src.read_at(1 << 20, 2 << 20, timeout=60)))
            reader.start()                      # no server now: it waits for the next one
            with fuse_server(tmp_path, registry_host=registry.host,
                             log_name="fuse-server-2.log"):
                reader.join(60)
                assert got == [data[1 << 20:]]
                assert os.getxattr(mp / "w.safetensors", FILE_XATTR) != before    # a new secret
                assert src.read_at(0, 100) == data[:100]
        finally:
            src.close()


def test_a_layer_cannot_bring_its_own_token(server: Server, proxy: Proxy) -> None:
    """An image whose file carries an attribute of the token's name: it is neither listed
    (copies would carry it) nor answered; the node's own token is."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("w.bin")
        ti.size, ti.mode = 4, 0o644
        ti.pax_headers = {f"SCHILY.xattr.{FILE_XATTR}": "cs1:forged",
                          "SCHILY.xattr.user.kept": "yes"}
        tf.addfile(ti, io.BytesIO(b"data"))
    _, client, tmp = server
    blob, res = convert(buf.getvalue(), "zstd:chunked")
    spec = push_layer(proxy.upstream_host, "weights/own-token", blob, res, pull_host=proxy.host)
    mp = tmp / "own-token"
    mp.mkdir()
    client.mount(str(mp), spec)
    assert os.listxattr(mp / "w.bin") == ["user.kept"]
    token = FileToken.parse(os.getxattr(mp / "w.bin", FILE_XATTR).decode())
    assert token.digest == spec.digest and token.size == 4
