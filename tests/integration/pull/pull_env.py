"""Helpers for the pull tests: private daemons, tiny busybox images built in Python, the
registry's access log, and a file-by-file walk of mounted snapshots.

containerd and the coldstart snapshotter are started with coldstart.stack's factories, each
test module getting its own (a fresh snapshotter root, so
byte counts and lazy/downloaded outcomes do not depend on other modules), in short directories
under /tmp (unix socket paths are limited to 108 bytes; /tmp is ext4 here, so overlayfs works).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from coldstart.containerd import Containerd
from coldstart.oci.manifest import OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.containerd import temp_containerd
from coldstart.stack.images import APPLETS, Entry, busybox_entries, layer_tar
from coldstart.stack.procs import coldstart_cli
from coldstart.stack.registry import AccessLog, Served
from coldstart.stack.snapshotter import LocalStack, temp_local_stack

__all__ = ["APPLETS", "HELLO", "SMALL", "UNREAD", "WORKLOAD", "AccessLog", "Entry", "LazyStack",
           "Node", "PushedImage", "Served", "busybox_entries", "coldstart_cli", "containerd",
           "layer_tar", "lazy_stack", "mounted_view", "push_image", "push_index", "rich_layers",
           "walk_tree", "workload_expected"]


# the private containerd and the snapshotter + containerd stack are coldstart.stack's
containerd = temp_containerd
LazyStack = LocalStack


def lazy_stack(log_level: str = "info", background_rate: int | None = 0,
               pull_mode: str | None = "lazy") -> contextlib.AbstractContextManager[LocalStack]:
    """coldstart.stack's snapshotter + containerd in a fresh /tmp directory (see
    :func:`coldstart.stack.snapshotter.temp_local_stack`)."""
    return temp_local_stack(log_level=log_level, background_rate=background_rate,
                            pull_mode=pull_mode)


# -- images: coldstart.stack.images (Entry, layer_tar, busybox_entries, APPLETS) --------------



@dataclass(frozen=True)
class PushedImage:
    ref: str
    manifest_digest: str
    layer_digests: tuple[str, ...]
    layer_sizes: tuple[int, ...]
    diff_ids: tuple[str, ...]


def push_image(client: RegistryClient, ref: str, layers: Sequence[Sequence[Entry] | bytes], *,
               gzip_level: int = 6, env: Sequence[str] = ()) -> PushedImage:
    """Build gzip layers from ``layers`` (entries, or a tar stream as it is), push them, a
    config and an OCI manifest to ``ref``."""
    reference = Reference.parse(ref)
    descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    sizes: list[int] = []
    for entries in layers:
        raw = entries if isinstance(entries, bytes) else layer_tar(entries)
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


def push_converted_app(host: str, repo: str, files: dict[str, bytes],
                       app: Sequence[Entry]) -> str:
    """Push ``host/repo:gzip``: busybox, a layer of ``app`` entries, a layer of ``files``
    under ``/data``; convert it to ``host/repo:zstd`` with ``coldstart convert`` and return
    that reference."""
    dirs = sorted({"/".join(n.split("/")[:k]) for n in files for k in range(1, n.count("/") + 1)})
    data = [Entry("data", "dir", mode=0o755),
            *(Entry(f"data/{d}", "dir", mode=0o755) for d in dirs),
            *(Entry(f"data/{n}", data=b) for n, b in files.items())]
    src, dst = f"{host}/{repo}:gzip", f"{host}/{repo}:zstd"
    with RegistryClient(insecure_hosts=[host]) as client:
        push_image(client, src, [busybox_entries(), list(app), data])
    proc = coldstart_cli("convert", src, dst, "--format", "zstd-chunked", timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"coldstart convert failed:\n{proc.stderr[-3000:]}")
    return dst


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
            try:
                rows.append((os.path.relpath(full, root), os.lstat(full)))
            except FileNotFoundError:
                # overlayfs lists a whiteout of a directory that only one layer holds (it does
                # not merge that directory) and then finds nothing there: what a container sees
                seen[os.path.relpath(full, root)] = Node("listed, absent", -1, -1, None, (), ())
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


def snapshot_tree(stack: LocalStack, namespace: str, snapshotter: str,
                  diff_ids: Sequence[str]) -> dict[str, Node]:
    """:func:`walk_tree` of the image whose layers have ``diff_ids``, as ``snapshotter``
    assembles it in ``namespace`` (a read-only view of its top snapshot)."""
    from coldstart.containerd.pull import chain_ids
    with Containerd(stack.ctd.address, namespace) as client, \
            mounted_view(client, snapshotter, chain_ids(diff_ids)[-1]) as root:
        return dict(walk_tree(root))


def containerd_tree(stack: LocalStack, image: PushedImage,
                    namespace: str = "reference") -> dict[str, Node]:
    """The image as containerd itself pulls and unpacks it (``ctr image pull``, overlayfs)."""
    stack.ctd.ctr("images", "pull", "--plain-http", image.ref, namespace=namespace,
                  timeout=180)
    return snapshot_tree(stack, namespace, "overlayfs", image.diff_ids)


def assert_same_tree(tree: dict[str, Node], reference: dict[str, Node]) -> None:
    """No path missing, none extra, none different (each difference shown both ways)."""
    missing = sorted(set(reference) - set(tree))
    extra = sorted(set(tree) - set(reference))
    differ = sorted(p for p in set(tree) & set(reference) if tree[p] != reference[p])
    assert (missing, extra, [(p, tree[p], reference[p]) for p in differ]) == ([], [], [])


def every_kind_layers(tag: str) -> list[list[Entry] | bytes]:
    """:func:`rich_layers` with a marker file per layer (chain IDs of their own: no other
    image's snapshot stands in), and on top a layer with every tar entry kind (devices, a
    FIFO, a char-device whiteout, an opaque dir, long and non-ASCII names)."""
    from tests.unit.format.layers import every_kind_tar
    return [*([*layer, Entry(f"etc/{tag}-{i}", data=b"marker\n")]
              for i, layer in enumerate(rich_layers())),
            every_kind_tar(portable=True)]

