"""Nothing readable where it does not belong: a user of the node that is not root reads no
cached chunk and connects to neither socket of the two daemons (issue 15 item 5).

The snapshotter (which spawns the FUSE server) runs on a root that a previous install left
``0755``, under a directory every user may enter, with both sockets and the chunk cache outside
that root: the modes of what coldstart makes are what keeps the user out, not a private temp
dir above them. A non-root user of an overlay mount built on the lazy layer (what a container
sees) still reads what the image's modes allow. The user is ``nobody`` (uid 65534), in a
process of its own; the same process reads a world-readable file and connects to a
world-writable socket beside them first, so a refusal is coldstart's modes and not a harness
that cannot read anything.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.lazyfs.client import FuseServerClient
from coldstart.stack.snapshotter import SnapshotterDaemon, start_snapshotter
from tests.fixtures.procs import wait_for
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import convert, metadata_tar, push_layer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (daemons, nobody)")]

NOBODY = 65534

# run as nobody: try each path (open for reading) and socket (connect); print what happened
_PROBE = r"""
import json, socket, sys
out = {}
for kind, path in json.loads(sys.argv[1]):
    try:
        if kind == "file":
            open(path, "rb").close()
        else:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            try:
                s.connect(path)
            finally:
                s.close()
        out[path] = "ok"
    except OSError as exc:
        out[path] = exc.__class__.__name__
print(json.dumps(out))
"""


def _as_nobody(targets: list[tuple[str, str]]) -> dict[str, str]:
    proc = subprocess.run(["/usr/bin/python3", "-I", "-c", _PROBE, json.dumps(targets)],
                          user=NOBODY, group=NOBODY, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, str] = json.loads(proc.stdout)
    return result


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def node() -> Iterator[SnapshotterDaemon]:
    base = Path(tempfile.mkdtemp(prefix="cs-priv-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)                    # every user may enter it
        (base / "root").mkdir(mode=0o755)        # left wide by an earlier install
        os.chmod(base / "root", 0o755)
        with start_snapshotter(base, background_rate=0) as d:
            yield d
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_user_that_is_not_root_reads_no_chunk_and_reaches_no_socket(
        node: SnapshotterDaemon, registry: Registry) -> None:
    base = node.base
    # a layer mounted lazily and read: its chunks are in the node's cache
    tree = metadata_tar()
    # 1 MiB chunks: the big file's go to files of their own, the small files' to packs
    blob, res = convert(tree.tar, "zstd:chunked", chunk_size=1 << 20)
    spec = push_layer(registry.host, "private/layer", blob, res)
    # mounted below the private root, as containerd's snapshots are
    mp = node.root / "t" / "lower"
    mp.mkdir(parents=True)
    client = FuseServerClient(node.fuse_socket, timeout=30.0)
    wait_for(lambda: os.path.exists(node.fuse_socket), timeout=30, what="the FUSE server")
    client.mount(str(mp), spec)
    for name, data in tree.files.items():
        assert (mp / name).read_bytes() == data
    cache = base / "cache"
    wait_for(lambda: any(p.is_file() for p in (cache / "sha256").rglob("*"))
             and any(p.is_file() for p in (cache / "packs").rglob("*")), timeout=30,
             what="chunks written to the node cache (files and packs)")

    # modes: directories 0700, files and sockets 0600
    assert _mode(node.root) == 0o700              # narrowed...
    assert "was mode 0755" in node.log.read_text() + (node.root / "fuse-server.log").read_text()
    assert [_mode(cache / d) for d in ("", "sha256", "wip", "packs")] == [0o700] * 4
    assert _mode(node.root / "metadata.db") == 0o600
    chunks = [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "wip"]
    assert chunks and all(_mode(p) == 0o600 for p in chunks), [
        (p, oct(_mode(p))) for p in chunks]
    for sock in (node.socket, node.fuse_socket):
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and _mode(Path(sock)) == 0o600

    # what nobody can do beside them (the harness works) and cannot do to them
    public = base / "public"
    public.write_bytes(b"anyone\n")
    os.chmod(public, 0o644)
    open_sock = socket.socket(socket.AF_UNIX)
    open_sock.bind(str(base / "open.sock"))
    open_sock.listen(1)
    os.chmod(base / "open.sock", 0o666)
    try:
        got = _as_nobody([("file", str(public)), ("socket", str(base / "open.sock")),
                          *[("file", str(p)) for p in chunks[:20]],
                          ("file", str(node.root / "metadata.db")),
                          ("socket", node.socket), ("socket", node.fuse_socket)])
    finally:
        open_sock.close()
    assert got.pop(str(public)) == "ok" and got.pop(str(base / "open.sock")) == "ok"
    assert got and set(got.values()) == {"PermissionError"}, got

    # a container's user that is not root still reads what the image's modes allow: overlayfs
    # reaches its lower layers (below the 0700 root) with the mounter's credentials, as it
    # does on containerd's own 0700 snapshot root
    rootfs = base / "rootfs"
    rootfs.mkdir(mode=0o755)
    (node.root / "t" / "up").mkdir()
    (node.root / "t" / "work").mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={mp},upperdir={node.root / 't' / 'up'},"
                    f"workdir={node.root / 't' / 'work'}", str(rootfs)], check=True)
    try:
        got = _as_nobody([("file", str(rootfs / "etc/os-release")),
                          ("file", str(rootfs / "etc/shadow"))])
        assert got == {str(rootfs / "etc/os-release"): "ok",            # 0644
                       str(rootfs / "etc/shadow"): "PermissionError"}   # 0640 root:42
        assert (rootfs / "etc/os-release").read_bytes() == tree.files["etc/os-release"]
    finally:
        subprocess.run(["umount", str(rootfs)], check=True)
    client.unmount(str(mp))
