"""Lazy mounts through the real FUSE server, a real registry and a counting proxy.

The integrity checks (TOC on open and on re-mount, corrupt chunks) are in test_lazy_integrity.py.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest

from coldstart.errors import NotFound
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs import handover
from coldstart.lazyfs.coalesce import MAX_GAP
from coldstart.lazyfs.metrics import (
    CACHE_HITS,
    FETCHED_BYTES,
    KIND_FETCHED_BYTES,
    LAYER_FETCHED_BYTES,
    READ_SECONDS,
)
from coldstart.lazyfs.mountsys import is_mountpoint, lazy_unmount
from coldstart.lazyfs.reclaim import chunk_digests
from coldstart.lazyfs.spec import LayerSpec
from coldstart.lazyfs.windows import NEIGHBOR_BYTES
from tests.fixtures.procs import free_port, wait_for
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import (
    MTIME,
    ReadLoop,
    Server,
    SourceTree,
    convert,
    fuse_server,
    in_cache,
    metadata_tar,
    needs_resend,
    push_layer,
    tar_of,
)
from tests.integration.lazy.lazy_proxy import Proxy

pytestmark = pytest.mark.integration

FORMATS = ["zstd:chunked", "estargz"]


@pytest.fixture(scope="module")
def tree() -> SourceTree:
    return metadata_tar()


def _mount(server: Server, proxy: Proxy,
           tree: SourceTree, fmt: str, repo: str, **spec_changes: object
           ) -> tuple[Path, LayerSpec, bytes]:
    """Push ``tree`` as a ``fmt`` layer and mount it through the proxy."""
    _, client, tmp = server
    blob, res = convert(tree.tar, fmt)
    spec = push_layer(proxy.upstream_host, repo, blob, res, pull_host=proxy.host)
    if spec_changes:
        spec = LayerSpec(**{**json.loads(spec.to_json()), **spec_changes})
    mp = tmp / repo.replace("/", "_")
    mp.mkdir()
    client.mount(str(mp), spec)
    return mp, spec, blob


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_and_metadata_through_the_mount(server: Server, proxy: Proxy, tree: SourceTree,
                                              fmt: str) -> None:
    mp, _spec, _ = _mount(server, proxy, tree, fmt, f"lazy/meta-{fmt.replace(':', '-')}")
    for name, data in tree.files.items():
        assert (mp / name).read_bytes() == data, name
    st = os.lstat(mp / "usr/bin/sudo")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o4755
    assert st.st_mtime == MTIME
    st = os.lstat(mp / "usr/bin/tool")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1001, 0o755)
    link = os.lstat(mp / "usr/bin/tool-link")
    assert link.st_ino == st.st_ino and st.st_nlink == 2
    assert os.readlink(mp / "usr/bin/python") == "python3.11"
    assert stat.S_ISLNK(os.lstat(mp / "usr/bin/python").st_mode)
    assert os.getxattr(mp / "usr/bin/tool", "user.origin") == b"test"
    assert "user.origin" in os.listxattr(mp / "usr/bin/tool")
    null = os.lstat(mp / "dev/null")
    assert stat.S_ISCHR(null.st_mode) and (os.major(null.st_rdev), os.minor(null.st_rdev)) == (1, 3)
    sda = os.lstat(mp / "dev/sda")
    assert stat.S_ISBLK(sda.st_mode) and os.major(sda.st_rdev) == 8 and sda.st_gid == 6
    assert stat.S_ISFIFO(os.lstat(mp / "dev/pipe").st_mode)
    assert stat.S_IMODE(os.lstat(mp / "tmp").st_mode) == 0o1777
    assert stat.S_IMODE(os.lstat(mp / "etc/shadow").st_mode) == 0o640
    # whiteouts as overlayfs expects them in a lower dir
    old = os.lstat(mp / "var/old")
    assert stat.S_ISCHR(old.st_mode) and old.st_rdev == os.makedev(0, 0)
    assert sorted(os.listdir(mp / "var")) == ["cache", "old"]
    assert os.listdir(mp / "var/cache") == ["fresh"]
    assert os.getxattr(mp / "var/cache", "trusted.overlay.opaque") == b"y"
    assert not any(n.startswith(".") for n in os.listdir(mp))    # landmarks hidden
    with pytest.raises(OSError) as exc:
        os.getxattr(mp / "etc", "user.none")
    assert exc.value.errno == errno.ENODATA
    with pytest.raises(OSError) as exc, open(mp / "etc/new", "w"):
        pass
    assert exc.value.errno in (errno.EROFS, errno.EACCES)
    vfs = os.statvfs(mp)
    assert vfs.f_blocks > 0 and vfs.f_files > 0
    assert os.lstat(mp / "usr/lib/zeros").st_size == 300_000


def test_only_toc_and_read_chunks_are_fetched(server: Server, proxy: Proxy) -> None:
    _, client, _ = server
    tree = metadata_tar(seed=1)  # no chunk in common with other tests' layers
    repo = "lazy/counted"
    before = len(proxy.blob_gets())
    mp, spec, blob = _mount(server, proxy, tree, "zstd:chunked", repo)
    layer = open_layer(BytesReadAt(blob), annotations=spec.annotations)

    def gets() -> int:
        return len(proxy.blob_gets()) - before

    def fetched() -> int:
        st = next(s for s in client.status() if s["digest"] == spec.digest)
        return int(st["fetched_bytes"])

    assert gets() == 1 and fetched() == 0            # footer + TOC: one tail read
    # a small file: one request for it and the small files stored after it (sudo among them)
    assert (mp / "etc/os-release").read_bytes() == tree.files["etc/os-release"]
    assert gets() == 2
    first = fetched()
    assert first >= sum(c.compressed_size for c in layer.resolve("usr/bin/sudo").chunks)
    assert first <= NEIGHBOR_BYTES + 2 * MAX_GAP + 4096
    assert (mp / "usr/bin/sudo").read_bytes() == tree.files["usr/bin/sudo"]
    assert gets() == 2                               # already fetched with its neighbour
    assert (mp / "usr/share/doc/f010.txt").read_bytes() == tree.files["usr/share/doc/f010.txt"]
    assert gets() == 3
    # 4 KiB in the middle of a 5 MiB file: exactly the chunk holding it, nothing else
    big = layer.resolve("usr/lib/big.so")
    off = 3 << 20
    before_big = fetched()
    with open(mp / "usr/lib/big.so", "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)   # no kernel read-ahead
        assert os.pread(f.fileno(), 4096, off) == tree.files["usr/lib/big.so"][off:off + 4096]
    assert gets() == 4
    assert fetched() - before_big == sum(c.compressed_size
                                         for c in layer.chunks_for(big, off, 4096))
    assert fetched() < len(blob) / 4


def test_spec_without_annotations_resolves_them_from_the_manifest(server: Server, proxy: Proxy,
                                                                  tree: SourceTree) -> None:
    mp, _, _ = _mount(server, proxy, tree, "estargz", "lazy/by-manifest", annotations={})
    assert (mp / "etc/os-release").read_bytes() == tree.files["etc/os-release"]


def test_hanging_registry_gives_eio_within_the_deadline(server: Server, proxy: Proxy) -> None:
    _, client, _ = server
    tree = metadata_tar(big_size=1 << 20, seed=3)
    mp, spec, _ = _mount(server, proxy, tree, "estargz", "lazy/hang")
    proxy.hang = True
    try:
        with pytest.raises(OSError) as exc:
            (mp / "usr/share/doc/f007.txt").read_bytes()
        assert exc.value.errno == errno.EIO
    finally:
        proxy.hang = False
    st = next(s for s in client.status() if s["digest"] == spec.digest)
    assert "DeadlineExceeded" in st["last_error"]


def test_unmount_and_check(server: Server, proxy: Proxy, tree: SourceTree) -> None:
    _, client, _ = server
    mp, spec, _ = _mount(server, proxy, tree, "zstd:chunked", "lazy/unmount")
    client.check(str(mp))
    client.mount(str(mp), spec)                      # same layer again: a no-op
    client.unmount(str(mp))
    assert not is_mountpoint(str(mp))
    with pytest.raises(NotFound):
        client.check(str(mp))
    with pytest.raises(NotFound):
        client.unmount(str(mp))


@needs_resend
def test_kill_9_then_restart_restores_mounts(tmp_path: Path, registry: Registry,
                                             tree: SourceTree) -> None:
    blob, res = convert(tree.tar, "zstd:chunked")
    spec = push_layer(registry.host, "lazy/restore", blob, res)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with fuse_server(tmp_path, registry_host=registry.host) as (proc, client, root):
        client.mount(str(mp), spec)
        assert (mp / "etc/os-release").read_bytes() == tree.files["etc/os-release"]
        layer = open_layer(BytesReadAt(blob), annotations=spec.annotations)
        digest = layer.resolve("etc/os-release").chunks[0].digest
        wait_for(lambda: in_cache(root / "cache", digest), timeout=30,
                 what="the chunk written to the cache")
        # a container keeps reading; a second layer is read cold while the server dies
        # (all but big.so: the third server below reads that one first)
        loop = ReadLoop(mp, {n: d for n, d in tree.files.items() if n != "usr/lib/big.so"})
        wait_for(lambda: loop.reads > 20, timeout=30, what="reads before the kill")
        cold = metadata_tar(big_size=3 << 20, seed=3)
        cblob, cres = convert(cold.tar, "zstd:chunked")
        mp_cold = tmp_path / "cold"
        mp_cold.mkdir()
        client.mount(str(mp_cold), push_layer(registry.host, "lazy/restore-cold", cblob, cres))
        mp_gone = tmp_path / "gone"                  # the same layer, mounted twice
        mp_gone.mkdir()
        client.mount(str(mp_gone), spec)
        # a layer with no extended attribute: served on the other connection, taken over too
        plain = _plain_files()
        pblob, pres = convert(tar_of(plain), "zstd:chunked")
        mp_plain = tmp_path / "plain"
        mp_plain.mkdir()
        client.mount(str(mp_plain), push_layer(registry.host, "lazy/restore-plain", pblob, pres))
        assert os.stat(mp_plain).st_dev == os.stat(root / "fuse-plain").st_dev
        plain_loop = ReadLoop(mp_plain, plain)
        cold_loop = ReadLoop(mp_cold, cold.files)
        wait_for(lambda: plain_loop.reads > 20, timeout=30, what="reads of the plain layer")
        time.sleep(0.05)                              # its first fetches are in flight
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # a bind detached while no server runs (the snapshotter's own umount -l does that):
        # the successor must not touch it before it serves, and binds it again after
        lazy_unmount(str(mp_gone))
        killed_at, plain_killed_at = loop.reads, plain_loop.reads
        time.sleep(1.0)                               # no server at all: reads wait
        with fuse_server(tmp_path, registry_host=registry.host,
                         log_name="fuse-server-2.log") as (proc2, client2, _):
            # the successor serves the same connection: nothing was unmounted, nothing failed
            wait_for(lambda: loop.reads > killed_at + 20, timeout=60,
                     what="reads served by the successor")
            wait_for(lambda: cold_loop.reads > len(cold.files), timeout=60,
                     what="the cold layer read whole")
            wait_for(lambda: plain_loop.reads > plain_killed_at + 20, timeout=60,
                     what="reads of the plain layer served by the successor")
            assert loop.stop()[1] == [] and cold_loop.stop()[1] == []
            assert plain_loop.stop()[1] == []
            log_text = (tmp_path / "fuse-server-2.log").read_text()
            assert f"took over the FUSE connection of {root / 'fuse'}" in log_text
            assert f"took over the FUSE connection of {root / 'fuse-plain'}" in log_text
            client2.unmount(str(mp_plain))
            wait_for(lambda: is_mountpoint(str(mp_gone)), timeout=30, what="the bind restored")
            assert (mp_gone / "etc/os-release").read_bytes() == tree.files["etc/os-release"]
            client2.unmount(str(mp_gone))
            client2.unmount(str(mp_cold))
            client2.check(str(mp))
            assert (mp / "usr/bin/sudo").read_bytes() == tree.files["usr/bin/sudo"]
            assert [s["mountpoint"] for s in client2.status()] == [str(mp)]
            # SIGTERM: exit 0, mount gone, record kept for the next start
            os.killpg(proc2.pid, signal.SIGTERM)
            assert proc2.wait(30) == 0
            assert not is_mountpoint(str(mp))
            assert list((root / "fuse-state").glob("*.json"))
        port = free_port()
        with fuse_server(tmp_path, registry_host=registry.host, log_name="fuse-server-3.log",
                         extra_args=("--metrics-address", f"127.0.0.1:{port}")
                         ) as (_, client3, _):
            client3.check(str(mp))
            # fetched by the first server: served from the node's chunk cache
            assert (mp / "etc/os-release").read_bytes() == tree.files["etc/os-release"]
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert _metric(metrics, CACHE_HITS + "_total") > 0
            assert _metric(metrics, FETCHED_BYTES + "_total") == 0
            assert (mp / "usr/lib/big.so").read_bytes() == tree.files["usr/lib/big.so"]
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            fetched = _metric(metrics, FETCHED_BYTES + "_total")
            assert fetched > 0
            assert _metric(metrics, LAYER_FETCHED_BYTES + "_total",
                           f'layer="{spec.digest}"') == fetched
            # all of it read on demand (this server has neither a landmark nor the fill)
            assert _metric(metrics, KIND_FETCHED_BYTES + "_total", 'kind="demand"') == fetched
            assert _metric(metrics, READ_SECONDS + "_count") > 0
            client3.unmount(str(mp))
            assert not list((root / "fuse-state").glob("*.json"))


def _plain_files() -> dict[str, bytes]:
    return {f"usr/share/plain/f{i}.txt": f"plain file {i}\n".encode() * (i + 1)
            for i in range(40)}


def test_layers_that_show_no_extended_attribute_are_served_where_none_are_asked(
        server: Server, proxy: Proxy, tree: SourceTree) -> None:
    """A layer with no extended attribute, no opaque directory and no safetensors file is bound
    from the second FUSE connection, which answers getxattr ENOSYS: the kernel then answers
    every one itself (EOPNOTSUPP: overlayfs reads that as "no attribute") without a request,
    while listxattr still answers an empty list.
    Layers that show an attribute, or hold a file a loader asks a token of, stay on the
    first."""
    _, client, tmp = server
    root = tmp / "root"
    plain = _plain_files()
    mp, _, _ = _mount(server, proxy, SourceTree(tar_of(plain), plain), "zstd:chunked",
                      "lazy/plain")
    assert os.stat(mp).st_dev == os.stat(root / "fuse-plain").st_dev
    assert os.stat(mp).st_dev != os.stat(root / "fuse").st_dev
    for name, data in plain.items():
        assert (mp / name).read_bytes() == data
    f = mp / "usr/share/plain/f3.txt"
    for path, name in ((f, "trusted.overlay.metacopy"), (mp / "usr", "trusted.overlay.opaque")):
        with pytest.raises(OSError) as err:
            os.getxattr(path, name)
        assert err.value.errno == errno.EOPNOTSUPP
    # listing is answered, as on a local disk: tools list before they ask
    assert os.listxattr(f) == [] and os.listxattr(mp / "usr") == []
    # attributes and an opaque directory: the first connection, which shows them
    full, _, _ = _mount(server, proxy, tree, "zstd:chunked", "lazy/plain-not")
    assert os.stat(full).st_dev == os.stat(root / "fuse").st_dev
    with pytest.raises(OSError) as err:
        os.getxattr(full / "usr/bin/sudo", "trusted.overlay.metacopy")
    assert err.value.errno == errno.ENODATA
    # a safetensors file (the weights loader reads it by its token, an attribute)
    weights = {"models/m.safetensors": b"\x08" + bytes(7) + b"{}      ", **plain}
    wmp, _, _ = _mount(server, proxy, SourceTree(tar_of(weights), weights), "zstd:chunked",
                       "lazy/plain-weights")
    assert os.stat(wmp).st_dev == os.stat(root / "fuse").st_dev
    for m in (mp, full, wmp):
        client.unmount(str(m))


def test_with_the_split_off_every_layer_is_served_where_getxattr_is_answered(
        tmp_path: Path, registry: Registry) -> None:
    plain = _plain_files()
    blob, res = convert(tar_of(plain), "zstd:chunked")
    spec = push_layer(registry.host, "lazy/split-off", blob, res)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with fuse_server(tmp_path, registry_host=registry.host, split_xattrs=False) as (
            _, client, root):
        client.mount(str(mp), spec)
        assert os.stat(mp).st_dev == os.stat(root / "fuse").st_dev
        assert client.status()[0]["plain"] is False
        with pytest.raises(OSError) as err:
            os.getxattr(mp / "usr/share/plain/f1.txt", "trusted.overlay.metacopy")
        assert err.value.errno == errno.ENODATA
        client.unmount(str(mp))


@needs_resend
def test_a_plain_connection_no_holder_kept_is_mounted_afresh_by_the_successor(
        tmp_path: Path, registry: Registry, tree: SourceTree) -> None:
    """The plain connection's holder is gone when the server dies: that connection dies with
    it. The successor takes the other one over (its containers never see an error), mounts
    the plain one afresh and binds its layers again; nothing waits on the dead connection."""
    plain = _plain_files()
    pblob, pres = convert(tar_of(plain), "zstd:chunked")
    pspec = push_layer(registry.host, "lazy/afresh-plain", pblob, pres)
    blob, res = convert(tree.tar, "zstd:chunked")
    spec = push_layer(registry.host, "lazy/afresh-full", blob, res)
    mp_plain, mp = tmp_path / "plain", tmp_path / "full"
    mp_plain.mkdir()
    mp.mkdir()
    with fuse_server(tmp_path, registry_host=registry.host) as (proc, client, root):
        client.mount(str(mp_plain), pspec)
        client.mount(str(mp), spec)
        assert {s["mountpoint"]: s["plain"] for s in client.status()} == {
            str(mp_plain): True, str(mp): False}
        loop = ReadLoop(mp, {n: d for n, d in tree.files.items() if n != "usr/lib/big.so"})
        wait_for(lambda: loop.reads > 20, timeout=30, what="reads before the kill")
        handover.release(root, name=handover.PLAIN_HOLDER_SOCKET)
        wait_for(lambda: not (root / handover.PLAIN_HOLDER_SOCKET).exists(), timeout=10,
                 what="the plain holder gone")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed_at = loop.reads
        with fuse_server(tmp_path, registry_host=registry.host,
                         log_name="fuse-server-2.log") as (_, client2, _):
            wait_for(lambda: loop.reads > killed_at + 20, timeout=60,
                     what="reads served by the successor")
            assert loop.stop()[1] == []
            log_text = (tmp_path / "fuse-server-2.log").read_text()
            assert f"took over the FUSE connection of {root / 'fuse'}" in log_text
            assert "is mounted afresh" in log_text
            wait_for(lambda: len(client2.status()) == 2, timeout=30, what="both restored")
            assert os.stat(mp_plain).st_dev == os.stat(root / "fuse-plain").st_dev
            for name, data in plain.items():
                assert (mp_plain / name).read_bytes() == data
            assert (root / handover.PLAIN_HOLDER_SOCKET).exists()   # held again
            client2.unmount(str(mp_plain))
            client2.unmount(str(mp))


def _metric(text: str, name: str, labels: str = "") -> float:
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {want} not exported")


def test_control_socket_rejects_bad_requests(server: Server) -> None:
    _, client, _ = server
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(client.socket_path)
        s.sendall(b'{"op": "mount", "mountpoint": "relative"}\nnot json\n{"op":"nope"}\n')
        buf = b""
        while buf.count(b"\n") < 3:
            buf += s.recv(65536)
    replies = [json.loads(line) for line in buf.splitlines()]
    assert [r["ok"] for r in replies] == [False, False, False]
    assert all(r["error"]["kind"] == "InvalidArgument" for r in replies)
    assert client.ping()["pid"] > 0


def test_unmounting_the_last_mount_of_a_layer_gives_its_cache_space_back(
        server: Server, proxy: Proxy) -> None:
    """containerd removing an image's snapshots unmounts its layers: the chunks only they had
    leave the node's cache, the ones a mounted layer shares stay."""
    _, client, tmp = server
    rnd = random.Random(15)
    shared = rnd.randbytes(300_000)
    a_files = {"app/a.bin": rnd.randbytes(400_000), "lib/shared.so": shared}
    b_files = {"srv/b.bin": rnd.randbytes(200_000), "usr/lib/shared.so": shared}
    a, b = SourceTree(tar_of(a_files), a_files), SourceTree(tar_of(b_files), b_files)
    mp_a, spec_a, blob_a = _mount(server, proxy, a, "zstd:chunked", "lazy/reclaim-a")
    mp_b, spec_b, blob_b = _mount(server, proxy, b, "zstd:chunked", "lazy/reclaim-b")
    for mp, t in ((mp_a, a), (mp_b, b)):
        for name, data in t.files.items():
            assert (mp / name).read_bytes() == data
    toc_a = open_layer(BytesReadAt(blob_a), annotations=spec_a.annotations).toc
    toc_b = open_layer(BytesReadAt(blob_b), annotations=spec_b.annotations).toc
    only_a = chunk_digests(toc_a) - chunk_digests(toc_b)
    kept = chunk_digests(toc_b)
    assert only_a and kept & chunk_digests(toc_a)
    cache_dir = tmp / "root/cache"
    wait_for(lambda: all(in_cache(cache_dir, d) for d in only_a | kept), timeout=30,
             what="the chunks read written to the cache")
    client.unmount(str(mp_a))
    wait_for(lambda: not any(in_cache(cache_dir, d) for d in only_a), timeout=30,
             what="the unmounted layer's own chunks removed")
    assert all(in_cache(cache_dir, d) for d in kept)
    for name, data in b.files.items():                    # b reads on, shared file included
        assert (mp_b / name).read_bytes() == data


@needs_resend
def test_sigusr2_hands_the_mounts_over_to_the_next_server(tmp_path: Path, registry: Registry,
                                                         tree: SourceTree) -> None:
    """An upgrade: the old server exits on SIGUSR2 leaving its mounts; the next one takes the
    connection over; a reader never sees an error. SIGTERM then unmounts, and the descriptor
    holder exits with the connection."""
    blob, res = convert(tree.tar, "zstd:chunked")
    spec = push_layer(registry.host, "lazy/handover", blob, res)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with fuse_server(tmp_path, registry_host=registry.host) as (proc, client, root):
        client.mount(str(mp), spec)
        loop = ReadLoop(mp, tree.files)
        wait_for(lambda: loop.reads > 20, timeout=30, what="reads before the handover")
        holder = root / "fuse-holder.sock"
        plain_holder = root / "fuse-plain-holder.sock"
        assert holder.exists() and stat.S_IMODE(holder.stat().st_mode) == 0o600
        assert plain_holder.exists() and stat.S_IMODE(plain_holder.stat().st_mode) == 0o600
        os.kill(proc.pid, signal.SIGUSR2)
        assert proc.wait(30) == 0
        assert is_mountpoint(str(mp))                 # left mounted, for the successor
        handed_at = loop.reads
        with fuse_server(tmp_path, registry_host=registry.host,
                         log_name="fuse-server-2.log") as (proc2, client2, _):
            wait_for(lambda: loop.reads > handed_at + 20, timeout=60,
                     what="reads served by the successor")
            assert loop.stop()[1] == []
            assert [s["mountpoint"] for s in client2.status()] == [str(mp)]
            os.kill(proc2.pid, signal.SIGTERM)
            assert proc2.wait(30) == 0
            assert not is_mountpoint(str(mp)) and not is_mountpoint(str(root / "fuse"))
            assert not is_mountpoint(str(root / "fuse-plain"))
            wait_for(lambda: not holder.exists() and not plain_holder.exists(), timeout=10,
                     what="the holders gone")
