"""Small OCI test images built in Python: tar layers (every kind of entry), gzip, a config.

Used by the registry, convert and e2e tests; everything stays a few hundred KB to a few MB.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import (
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Descriptor,
    canonical_json,
)
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient

BUSYBOX = "/bin/busybox"
MTIME = 1_700_000_000


def _info(name: str, kind: bytes = tarfile.REGTYPE, *, mode: int = 0o644, uid: int = 0,
          gid: int = 0, size: int = 0, link: str = "",
          xattrs: dict[str, str] | None = None) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.uid, ti.gid = uid, gid
    ti.size = size
    ti.linkname = link
    ti.mtime = MTIME
    if xattrs:
        ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    return ti


class TarBuilder:
    """Append entries to an in-memory PAX tar."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(  # noqa: SIM115 (closed by bytes())
            fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def dir(self, name: str, mode: int = 0o755, **kw: object) -> TarBuilder:
        self.tar.addfile(_info(name, tarfile.DIRTYPE, mode=mode, **kw))  # type: ignore[arg-type]
        return self

    def file(self, name: str, data: bytes, mode: int = 0o644, **kw: object) -> TarBuilder:
        ti = _info(name, mode=mode, size=len(data), **kw)  # type: ignore[arg-type]
        self.tar.addfile(ti, io.BytesIO(data))
        return self

    def symlink(self, name: str, target: str) -> TarBuilder:
        self.tar.addfile(_info(name, tarfile.SYMTYPE, mode=0o777, link=target))
        return self

    def hardlink(self, name: str, target: str) -> TarBuilder:
        self.tar.addfile(_info(name, tarfile.LNKTYPE, link=target))
        return self

    def fifo(self, name: str) -> TarBuilder:
        self.tar.addfile(_info(name, tarfile.FIFOTYPE, mode=0o600))
        return self

    def chardev(self, name: str, major: int, minor: int) -> TarBuilder:
        ti = _info(name, tarfile.CHRTYPE, mode=0o666)
        ti.devmajor, ti.devminor = major, minor
        self.tar.addfile(ti)
        return self

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def base_layer(*, busybox: bool = True, big: int = 300_000) -> bytes:
    """A root filesystem with busybox as /bin/sh and files of every kind."""
    t = TarBuilder()
    for d in ("bin", "etc", "data", "data/sub", "empty", "keep", "keep/old", "tmp"):
        t.dir(d)
    t.dir("private", mode=0o700, uid=1000, gid=1000)
    if busybox:
        t.file("bin/busybox", Path(BUSYBOX).read_bytes(), mode=0o755)
        for tool in ("sh", "ls", "cat", "find", "stat", "sha256sum", "readlink", "xargs",
                     "sort", "echo", "true"):
            t.symlink(f"bin/{tool}", "busybox")
    t.file("etc/hostname", b"coldstart\n")
    t.file("etc/empty.conf", b"")
    t.file("data/setuid", b"#!/bin/sh\n", mode=0o4755)
    t.file("data/owned", b"owned by 1234:5678\n", uid=1234, gid=5678)
    t.file("data/xattr", b"has xattr\n", xattrs={"user.coldstart": "yes"})
    # not compressible: exercises chunking (several chunks with a small --chunk-size)
    big_data = hashlib.shake_256(b"coldstart").digest(big)
    t.file("data/big.bin", big_data)
    t.file("data/zeros.bin", b"\0" * 200_000)
    t.hardlink("data/big-link.bin", "data/big.bin")
    t.symlink("data/abs-link", "/etc/hostname")
    t.symlink("data/rel-link", "../etc/hostname")
    t.symlink("data/dangling", "nowhere")
    t.fifo("data/fifo")
    t.file("private/secret", b"s3cret\n", mode=0o600, uid=1000, gid=1000)
    t.file("keep/old/a", b"a\n")
    t.file("keep/old/b", b"b\n")
    t.file("keep/gone.txt", b"to be deleted\n")
    t.file("data/sub/" + "long-name-" * 12, b"long name\n")
    t.file("data/sub/unicodé ünï.txt", "ünïcode\n".encode())
    return t.bytes()


def upper_layer() -> bytes:
    """A second layer: a whiteout, an opaque directory, changed and new files."""
    t = TarBuilder()
    t.dir("keep")
    t.file("keep/.wh.gone.txt", b"")
    t.dir("keep/old")
    t.file("keep/old/.wh..wh..opq", b"")
    t.file("keep/old/c", b"c (after opaque)\n")
    t.file("etc/hostname", b"converted\n")
    t.file("data/new.txt", b"new in layer 2\n" * 100)
    return t.bytes()


@dataclass
class BuiltImage:
    layers: list[bytes]          # uncompressed tars
    blobs: list[bytes]           # gzip-compressed
    config: bytes
    manifest: bytes

    @property
    def manifest_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor(OCI_LAYER_GZIP, _d(b), len(b)) for b in self.blobs]


def _d(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_image(layers: Sequence[bytes], *, arch: str = "amd64",
                cmd: Sequence[str] = ("/bin/sh",)) -> BuiltImage:
    blobs = [gzip.compress(layer, compresslevel=6, mtime=0) for layer in layers]
    config = canonical_json({
        "architecture": arch, "os": "linux",
        "config": {"Cmd": list(cmd), "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [_d(layer) for layer in layers]},
        "history": [{"created_by": "coldstart test"} for _ in layers],
    })
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": _d(config), "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": _d(b), "size": len(b)}
                   for b in blobs],
    })
    return BuiltImage(list(layers), blobs, config, manifest)


def write_layout(root: Path, image: BuiltImage, tag: str = "latest") -> OciLayout:
    layout = OciLayout.create(root)
    for blob in [*image.blobs, image.config]:
        layout.put_blob(blob, "x")
    desc = layout.put_blob(image.manifest, OCI_MANIFEST)
    layout.add_manifest(desc, tag)
    return layout


def push_image(client: RegistryClient, ref: Reference, image: BuiltImage) -> str:
    for blob in [*image.blobs, image.config]:
        client.push_blob(ref, blob)
    return client.push_manifest(ref, image.manifest, OCI_MANIFEST)


def push_index(client: RegistryClient, ref: Reference,
               images: Sequence[tuple[str, BuiltImage]]) -> str:
    entries = []
    for arch, image in images:
        child = Reference(ref.registry, ref.repository, None, image.manifest_digest)
        push_image(client, child, image)
        entries.append({"mediaType": OCI_MANIFEST, "digest": image.manifest_digest,
                        "size": len(image.manifest),
                        "platform": {"os": "linux", "architecture": arch}})
    body = canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
    return client.push_manifest(ref, body, OCI_INDEX)


def have_busybox() -> bool:
    return os.path.exists(BUSYBOX)
