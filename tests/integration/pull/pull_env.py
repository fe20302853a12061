"""Helpers for the pull tests: private daemons, tiny busybox images built in Python, the
registry's access log, and a file-by-file walk of mounted snapshots.

containerd and the coldstart snapshotter are started with the factories of
tests/fixtures/containerd.py, each test module getting its own (a fresh snapshotter root, so
byte counts and lazy/downloaded outcomes do not depend on other modules), in short directories
under /tmp (unix socket paths are limited to 108 bytes; /tmp is ext4 here, so overlayfs works).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from coldstart.containerd import Containerd
from coldstart.oci.manifest import OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.containerd import Containerd as ContainerdProc
from tests.fixtures.containerd import (
    SnapshotterDaemon,
    snapshotter_config,
    start_containerd,
    unmount_under,
)

BUSYBOX = Path("/bin/busybox") if Path("/bin/busybox").exists() else Path("/usr/bin/busybox")


@contextlib.contextmanager
def containerd(proxy_socket: str | None = None) -> Iterator[ContainerdProc]:
    """A private containerd (the shared fixture module's factory) in a short /tmp directory;
    ``ctr`` runs in namespace ``default`` unless told otherwise, like ``coldstart pull``."""
    base = Path(tempfile.mkdtemp(prefix="cs-ctd-", dir="/tmp"))
    try:
        with start_containerd(base, proxy_socket) as proc:
            proc.namespace = "default"
            yield proc
    finally:
        unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)


@dataclass(frozen=True)
class LazyStack:
    ctd: ContainerdProc
    snapshotter: SnapshotterDaemon

    @property
    def fuse_log(self) -> Path:
        return self.snapshotter.root / "fuse-server.log"


@contextlib.contextmanager
def lazy_stack(log_level: str = "info", background_rate: int | None = None
               ) -> Iterator[LazyStack]:
    """``coldstart snapshotter`` (which spawns its FUSE server) and a containerd that knows it
    as ``coldstart``, fresh, under one temporary directory; stopped by PID, mounts undone.

    The snapshotter's config is the fixture module's, at ``log_level`` (its default, debug,
    costs CPU on every FUSE request, which a benchmark must not pay)."""
    base = Path(tempfile.mkdtemp(prefix="cs-lz-", dir="/tmp"))
    sn_base = base / "sn"
    sn_base.mkdir()
    config = sn_base / "config.toml"
    text = snapshotter_config(sn_base).replace('log_level = "debug"', f'log_level = "{log_level}"')
    if background_rate is not None:
        text += f"[fetch]\nbackground_rate = {background_rate}\n"
    config.write_text(text)
    sn = SnapshotterDaemon(base=sn_base, root=sn_base / "root", socket=str(sn_base / "s.sock"),
                           config=config, log=sn_base / "snapshotter.log")
    try:
        sn.start()
        with start_containerd(base / "ctrd", proxy_socket=sn.socket) as ctd:
            ctd.namespace = "default"
            yield LazyStack(ctd=ctd, snapshotter=sn)
    finally:
        sn.stop()
        unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)


# -- images ------------------------------------------------------------------------------------

@dataclass
class Entry:
    """One tar member. ``kind``: file, dir, symlink, hardlink, whiteout, opaque."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    target: str = ""
    xattrs: dict[str, str] = field(default_factory=dict)
    mtime: int = 1_700_000_000


def layer_tar(entries: Sequence[Entry]) -> bytes:
    """An uncompressed PAX tar of ``entries`` (whiteouts in the OCI ``.wh.`` form)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            name = e.path
            if e.kind == "whiteout":
                head, _, base = name.rpartition("/")
                name = f"{head}/.wh.{base}" if head else f".wh.{base}"
            elif e.kind == "opaque":
                name = f"{name.rstrip('/')}/.wh..wh..opq"
            ti = tarfile.TarInfo(name)
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, e.mtime
            ti.uname = ti.gname = ""
            if e.xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            data: bytes | None = None
            if e.kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, e.target
                ti.mode = 0o777
            elif e.kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, e.target
            elif e.kind in ("whiteout", "opaque"):
                ti.type, ti.size = tarfile.REGTYPE, 0
                data = b""
            else:
                ti.type, ti.size = tarfile.REGTYPE, len(e.data)
                data = e.data
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


APPLETS = ("sh", "cat", "ls", "echo", "sha256sum", "head", "tail", "wc", "stat", "find", "sleep")


def busybox_entries(applets: Sequence[str] = APPLETS) -> list[Entry]:
    """/bin/busybox (static) and its applets as symlinks: enough for ``sh -c``."""
    out = [Entry("bin", "dir", mode=0o755),
           Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755)]
    out += [Entry(f"bin/{a}", "symlink", target="busybox") for a in applets]
    out += [Entry("tmp", "dir", mode=0o1777), Entry("proc", "dir", mode=0o555),
            Entry("dev", "dir", mode=0o755), Entry("sys", "dir", mode=0o555),
            Entry("etc", "dir", mode=0o755)]
    return out


@dataclass(frozen=True)
class PushedImage:
    ref: str
    manifest_digest: str
    layer_digests: tuple[str, ...]
    layer_sizes: tuple[int, ...]
    diff_ids: tuple[str, ...]


def push_image(client: RegistryClient, ref: str, layers: Sequence[Sequence[Entry]], *,
               gzip_level: int = 6, env: Sequence[str] = ()) -> PushedImage:
    """Build gzip layers from ``layers``, push them, a config and an OCI manifest to ``ref``."""
    reference = Reference.parse(ref)
    descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    sizes: list[int] = []
    for entries in layers:
        raw = layer_tar(entries)
        blob = gzip.compress(raw, compresslevel=gzip_level, mtime=0)
        digest = client.push_blob(reference, blob)
        descs.append({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": len(blob)})
        sizes.append(len(blob))
        diff_ids.append(digest_of(raw))
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin", *env], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = client.push_blob(reference, config_bytes)
    manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": descs,
    }
    body = json.dumps(manifest, sort_keys=True).encode()
    digest = client.push_manifest(reference, body, OCI_MANIFEST)
    return PushedImage(ref=ref, manifest_digest=digest,
                       layer_digests=tuple(str(d["digest"]) for d in descs),
                       layer_sizes=tuple(sizes),
                       diff_ids=tuple(diff_ids))


def coldstart_cli(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run the ``coldstart`` CLI in a subprocess, as a user would."""
    venv_python = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else "python3"
    return subprocess.run([python, "-c", "from coldstart.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


# -- registry access log -----------------------------------------------------------------------

_ACCESS_RE = re.compile(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[\d.]+" (\d{3}) (\d+|-)')


@dataclass(frozen=True)
class Served:
    method: str
    path: str
    status: int
    bytes: int


class AccessLog:
    """Requests a registry logged after the moment this object was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = path.stat().st_size

    def requests(self) -> list[Served]:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            text = f.read().decode(errors="replace")
        out = []
        for m in _ACCESS_RE.finditer(text):
            out.append(Served(m.group(1), m.group(2), int(m.group(3)),
                              0 if m.group(4) == "-" else int(m.group(4))))
        return out

    def blob_requests(self, digest: str) -> list[Served]:
        return [r for r in self.requests() if r.method == "GET"
                and r.path.endswith(f"/blobs/{digest}")]

    def blob_bytes(self, digest: str) -> int:
        return sum(r.bytes for r in self.blob_requests(digest))


def push_index(client: RegistryClient, ref: str, image: PushedImage) -> str:
    """Push an OCI index naming ``image``'s manifest (linux/amd64) plus a foreign-platform
    entry, under ``ref``; return the index digest."""
    reference = Reference.parse(ref)
    body, _, digest = client.get_manifest(Reference.parse(image.ref))
    index = {
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [
            {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body),
             "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
            {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body),
             "platform": {"os": "linux", "architecture": "amd64"}},
        ],
    }
    data = json.dumps(index, sort_keys=True).encode()
    return client.push_manifest(reference, data, OCI_INDEX)


# -- comparing root file systems ---------------------------------------------------------------

# what overlayfs itself keeps in xattrs (hidden through the mount anyway) and LSM labels
_IGNORED_XATTRS = ("trusted.overlay.", "security.selinux")


class Node(NamedTuple):
    mode: str                                   # ls -l style: type + permission bits
    uid: int
    gid: int
    detail: object                              # (size, sha256) | link target | (major, minor)
    xattrs: tuple[tuple[str, bytes], ...]
    links: tuple[str, ...]                      # other paths hard-linked to this one


def walk_tree(root: Path) -> dict[str, Node]:
    """Every path under ``root`` (root itself as ``.``) → what a container can observe of it:
    type, permission bits, owner, size + sha256 of content, symlink target, xattrs, and the
    other paths it is hard-linked with."""
    by_inode: dict[int, list[str]] = {}
    seen: dict[str, Node] = {}
    rows: list[tuple[str, os.stat_result]] = [(".", os.lstat(root))]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rows.append((os.path.relpath(full, root), os.lstat(full)))
    for rel, st in rows:
        full = os.path.join(root, rel)
        kind = stat.S_IFMT(st.st_mode)
        detail: object = None
        if stat.S_ISREG(kind):
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            detail = (st.st_size, h.hexdigest())
            by_inode.setdefault(st.st_ino, []).append(rel)
        elif stat.S_ISLNK(kind):
            detail = os.readlink(full)
        elif stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
            detail = (os.major(st.st_rdev), os.minor(st.st_rdev))
        xattrs = {}
        for name in sorted(os.listxattr(full, follow_symlinks=False)):
            if not name.startswith(_IGNORED_XATTRS):
                xattrs[name] = os.getxattr(full, name, follow_symlinks=False)
        seen[rel] = Node(stat.filemode(st.st_mode), st.st_uid, st.st_gid, detail,
                         tuple(xattrs.items()), ())
    for group in by_inode.values():
        if len(group) > 1:
            for rel in group:
                seen[rel] = seen[rel]._replace(links=tuple(sorted(g for g in group if g != rel)))
    return seen


@contextlib.contextmanager
def mounted_view(client: Containerd, snapshotter: str, parent: str) -> Iterator[Path]:
    """A read-only VIEW of committed snapshot ``parent`` made through containerd, mounted.

    The view lives under a lease, so containerd's GC leaves it alone until we are done."""
    key = f"view-{os.urandom(4).hex()}"
    with client.lease():
        mounts = client.view_snapshot(snapshotter, key, parent)
        target = Path(tempfile.mkdtemp(prefix="cs-view-", dir="/tmp"))
        done: list[Path] = []
        try:
            for m in mounts:
                where = target / m.target.lstrip("/") if m.target else target
                if m.type == "bind":
                    argv = ["mount", "-o", ",".join(m.options or ("bind",)), m.source,
                            str(where)]
                else:
                    argv = ["mount", "-t", m.type, "-o", ",".join(m.options), m.source,
                            str(where)]
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                if proc.returncode != 0:
                    raise AssertionError(f"{' '.join(argv)}: {proc.stderr}")
                done.append(where)
            yield target
        finally:
            for where in reversed(done):
                subprocess.run(["umount", str(where)], check=False, capture_output=True)
            with contextlib.suppress(OSError):
                target.rmdir()
            client.remove_snapshot(snapshotter, key)


# -- the image the e2e tests use ---------------------------------------------------------------

HELLO = b"hello from layer 1\n"
SMALL = b"small file in the top layer\n"
# regular files the e2e workload never opens (so their chunks must not be fetched lazily)
UNREAD = ("data/cold.bin", "data/unread.bin")


def rich_layers(seed: int = 7) -> list[list[Entry]]:
    """Three layers exercising what a rootfs can hold: modes, owners, symlinks, hardlinks,
    xattrs, an empty file and dir, multi-chunk files, whiteouts, an opaque dir."""
    import random

    rnd = random.Random(seed)

    def blob(n: int) -> bytes:
        return rnd.randbytes(n)

    base = busybox_entries()
    base += [
        Entry("etc/hello.txt", data=HELLO),
        Entry("etc/gone.txt", data=b"deleted by layer 3\n"),
        Entry("etc/secret", data=b"s3cret\n", mode=0o600, uid=1000, gid=1000),
        Entry("etc/group-owned", data=b"g\n", mode=0o640, uid=0, gid=65534),
    ]
    second = [
        Entry("data", "dir", mode=0o755, xattrs={"user.dir": "on a dir"}),
        Entry("data/cold.bin", data=blob(2 << 20), mode=0o644),
        Entry("data/a.txt", data=b"a\n" * 1000, xattrs={"user.coldstart": "yes",
                                                       "user.empty": ""}),
        Entry("data/link-to-a", "hardlink", target="data/a.txt"),
        Entry("data/b.txt", data=b"b\n" * 3000, mode=0o640, uid=1000),
        # a hardlink header carries its target's metadata, as tar writes it (containerd applies
        # a link header's mode and owner to the shared inode)
        Entry("data/link-to-b", "hardlink", target="data/b.txt", mode=0o640, uid=1000),
        Entry("data/empty", data=b""),
        Entry("data/emptydir", "dir", mode=0o700, uid=1000, gid=1000),
        Entry("data/abs-link", "symlink", target="/etc/hello.txt"),
        Entry("data/rel-link", "symlink", target="../etc/hello.txt"),
        Entry("data/dangling", "symlink", target="does/not/exist"),
        Entry("data/setuid", data=b"#!/bin/sh\n", mode=0o4755),
        Entry("data/sticky", "dir", mode=0o1777),
        Entry("data/multi.bin", data=blob(5 << 20) + b"tail", mode=0o755),
        Entry("opq", "dir", mode=0o755),
        Entry("opq/x", data=b"x\n"),
        Entry("opq/sub", "dir", mode=0o755),
        Entry("opq/sub/y", data=b"y\n"),
        Entry("rmdir", "dir", mode=0o755),
        Entry("rmdir/file", data=b"in a dir that layer 3 deletes\n"),
        Entry("etc/owned-by-nobody", data=b"n\n", uid=65534, gid=65534),
    ]
    # like docker/buildkit, every parent directory is in the tar with its metadata (a lazily
    # mounted layer cannot copy up a parent's xattrs from the layers below it)
    third = [
        Entry("etc", "dir", mode=0o755),
        Entry("data", "dir", mode=0o755, xattrs={"user.dir": "on a dir"}),
        Entry("data/unread.bin", data=blob(3 << 20)),
        Entry("data/small.txt", data=SMALL),
        Entry("etc/gone.txt", "whiteout"),
        Entry("rmdir", "whiteout"),
        Entry("opq", "dir", mode=0o755),
        Entry("opq", "opaque"),
        Entry("opq/z", data=b"z\n"),
        Entry("data/a.txt", data=b"a replaced in layer 3\n", xattrs={"user.new": "1"}),
    ]
    return [base, second, third]


def workload_expected(layers: Sequence[Sequence[Entry]]) -> str:
    """What the e2e workload prints (computed from the entries, not from a run)."""
    multi = next(e for e in layers[1] if e.path == "data/multi.bin").data
    part = multi[(4 << 20) - 10:(4 << 20) + 10]   # across the 4 MiB chunk boundary
    return (HELLO.decode() + SMALL.decode() + "opq: z\n"
            + hashlib.sha256(part).hexdigest() + "  -\n")


# reads: sh (busybox), two small files, a directory listing, 20 bytes across a chunk boundary
WORKLOAD = ("cat /etc/hello.txt /data/small.txt; echo opq: $(ls /opq); "
            "head -c 4194314 /data/multi.bin | tail -c 20 | sha256sum")
