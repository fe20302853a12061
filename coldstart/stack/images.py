"""Small images built from Python for tests, benchmarks and the demo: tar layers, data.

``layer_tar`` writes an uncompressed PAX tar of :class:`Entry` members (files, directories,
links, OCI whiteouts, xattrs); ``busybox_entries`` is a minimal rootfs (Debian's static
busybox and its applets) that ``sh -c`` runs in; ``realistic_bytes`` is compressible but
not trivial data (random bytes mixed with text), so compression ratios resemble code.
"""

from __future__ import annotations

import io
import random
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["APPLETS", "BUSYBOX", "Entry", "busybox_entries", "layer_tar", "realistic_bytes"]

BUSYBOX = Path("/bin/busybox") if Path("/bin/busybox").exists() else Path("/usr/bin/busybox")
APPLETS = ("sh", "cat", "ls", "echo", "sha256sum", "head", "tail", "wc", "stat", "find", "sleep")


def realistic_bytes(n: int, seed: int) -> bytes:
    """Compressible but not trivial: random bytes mixed with text."""
    rng = random.Random(seed)
    words = [b"torch", b"cuda", b"import", b"def ", b"return", b"self", b"\n", b"    ",
             b"tensor", b"0x7f", b"lib", b".so", b"python3"]
    out = bytearray()
    while len(out) < n:
        if rng.random() < 0.3:
            out += rng.randbytes(rng.randint(16, 256))
        else:
            out += b" ".join(rng.choice(words) for _ in range(rng.randint(4, 40)))
    return bytes(out[:n])


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


def busybox_entries(applets: Sequence[str] = APPLETS) -> list[Entry]:
    """/bin/busybox (static) and its applets as symlinks: enough for ``sh -c``."""
    out = [Entry("bin", "dir", mode=0o755),
           Entry("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755)]
    out += [Entry(f"bin/{a}", "symlink", target="busybox") for a in applets]
    out += [Entry("tmp", "dir", mode=0o1777), Entry("proc", "dir", mode=0o555),
            Entry("dev", "dir", mode=0o755), Entry("sys", "dir", mode=0o555),
            Entry("etc", "dir", mode=0o755)]
    return out
