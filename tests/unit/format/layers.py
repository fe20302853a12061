"""Helpers for the format tests: build tar streams, convert them, compare against the tar."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from coldstart.format import BytesReadAt, LayerResult, SeekableLayer, convert_layer, open_layer
from coldstart.format.footer import estargz_footer, skippable_frame, zstd_chunked_footer
from coldstart.format.layer import ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM
from coldstart.format.toc import normalize_name

FORMATS = ["zstd:chunked", "estargz"]


def add(tf: tarfile.TarFile, name: str, data: bytes | None = None, *, type: bytes = tarfile.REGTYPE,
        mode: int = 0o644, link: str = "", xattrs: dict[str, str] | None = None,
        dev: tuple[int, int] = (0, 0), mtime: float = 1_700_000_000, uid: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.type = type
    info.mode = mode
    info.linkname = link
    info.mtime = mtime
    info.uid = uid
    info.uname = "user" if uid else "root"
    info.devmajor, info.devminor = dev
    if xattrs:
        info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
    info.size = len(data) if data is not None else 0
    tf.addfile(info, io.BytesIO(data) if data is not None else None)


def every_kind_tar(tmp: Path | None = None, *, portable: bool = False) -> bytes:
    """A tar with every entry kind the converter must keep (GNU sparse added when tmp is given).

    ``portable`` leaves out what Go tools cannot carry or a kernel refuses to set: the
    non-UTF-8 name (Go writes U+FFFD) and a made-up security.capability xattr.
    """
    buf = io.BytesIO()
    rnd = hashlib.sha256(b"seed").digest() * 4096  # 128 KiB, poorly compressible-ish
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tf:
        add(tf, "./", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "./etc/", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "./etc/hostname", b"coldstart\n", mtime=1_700_000_000.123456789)
        add(tf, "./etc/empty", b"")
        add(tf, "./etc/setuid", b"#!/bin/sh\n", mode=0o4755, uid=1000)
        add(tf, "./usr/lib/big.bin", rnd + b"tail" * 1000)
        add(tf, "./usr/lib/zeros.bin", bytes(300_000))
        xattrs = {"user.note": "hé"} if portable else {"security.capability": "\x01\x02",
                                                          "user.note": "hé"}
        add(tf, "./usr/lib/libfoo.so", b"\x7fELF" + rnd[:5000], xattrs=xattrs)
        add(tf, "./usr/lib/hard", type=tarfile.LNKTYPE, link="./usr/lib/libfoo.so")
        add(tf, "./usr/bin/sh", type=tarfile.SYMTYPE, link="/bin/busybox")
        add(tf, "./dev/null", type=tarfile.CHRTYPE, mode=0o666, dev=(1, 3))
        add(tf, "./dev/sda", type=tarfile.BLKTYPE, mode=0o660, dev=(8, 0))
        add(tf, "./run/fifo", type=tarfile.FIFOTYPE)
        add(tf, "./var/.wh.cache", b"")
        add(tf, "./opt/app/", type=tarfile.DIRTYPE, mode=0o1777)
        add(tf, "./opt/app/.wh..wh..opq", b"")
        add(tf, "./gone", type=tarfile.CHRTYPE, mode=0, dev=(0, 0))
        long = "./" + "/".join(["d" * 60] * 5) + "/" + "f" * 200
        add(tf, long, b"long name")
        if not portable:
            add(tf, "./name-\udcff\udcfe.bin", b"latin-1 name")  # not UTF-8 on disk
        add(tf, "./unicode-名前.txt", "日本".encode())
    if tmp is not None and shutil.which("tar"):
        sparse_dir = tmp / "sparse"
        sparse_dir.mkdir()
        with open(sparse_dir / "holes.img", "wb") as f:
            f.seek(1 << 20)
            f.write(b"island")
            f.seek(3 << 20)
            f.write(b"end")
        gnu = subprocess.run(["tar", "--sparse", "--format=gnu", "-C", str(sparse_dir), "-cf",
                              "-", "holes.img"], check=True, capture_output=True).stdout
        # Concatenate: drop our end-of-archive blocks, append GNU tar's members.
        raw = buf.getvalue().rstrip(b"\0")
        raw += bytes(-len(raw) % 512)
        return raw + gnu
    return buf.getvalue()


@dataclass
class Converted:
    blob: bytes
    result: LayerResult
    layer: SeekableLayer


def convert(tar: bytes, fmt: str, **kw: Any) -> Converted:
    out = io.BytesIO()
    result = convert_layer(io.BytesIO(tar), out, format=fmt, **kw)
    blob = out.getvalue()
    assert len(blob) == result.size
    assert result.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    return Converted(blob, result, open_layer(BytesReadAt(blob), annotations=result.annotations))


def decompress(blob: bytes, fmt: str) -> bytes:
    """What a runtime without coldstart unpacks: the whole blob, decompressed."""
    if fmt == "estargz":
        return gzip.decompress(blob)
    dctx = zstandard.ZstdDecompressor()
    return dctx.stream_reader(io.BytesIO(blob), read_across_frames=True).read()


def tar_members(tar: bytes) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return tar_members_and_end(tar)[0]


def tar_members_and_end(tar: bytes) -> tuple[list[tuple[tarfile.TarInfo, bytes | None]], int]:
    """Each member with its data (regular files), and the offset where tarfile stopped."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:", encoding="utf-8",
                      errors="surrogateescape") as tf:
        for m in tf:
            f = tf.extractfile(m) if m.isreg() else None
            out.append((m, f.read() if f else None))
        return out, tf.offset


KINDS = {tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.GNUTYPE_SPARSE: "reg",
         tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink",
         tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo"}


def assert_same_as_tar(layer: SeekableLayer, tar: bytes) -> None:
    """Every file's bytes and metadata in ``layer`` equal those of the tar stream ``tar``."""
    seen = set()
    for m, data in tar_members(tar):
        name = normalize_name(m.name)
        seen.add(name)
        e = layer.toc.entries[name]
        assert e.type == KINDS[m.type], name
        assert e.mode == m.mode & 0o7777, name
        assert (e.uid, e.gid, e.uname, e.gname) == (m.uid, m.gid, m.uname, m.gname), name
        assert e.mtime_ns // 1_000_000_000 == int(m.mtime), name
        if e.type == "hardlink":
            assert e.link_name == normalize_name(m.linkname)
        elif e.type == "symlink":
            assert e.link_name == m.linkname
        if e.type in ("char", "block"):
            assert (e.dev_major, e.dev_minor) == (m.devmajor, m.devminor), name
        xattrs = {k[len("SCHILY.xattr."):]: v.encode("utf-8", "surrogateescape")
                  for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
        assert e.xattrs == xattrs, name
        if data is not None:
            assert e.size == len(data), name
            assert layer.read_file(name) == data, name
            assert e.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    landmarks = {".prefetch.landmark", ".no.prefetch.landmark"}
    extra = {n for n in layer.toc.order if n not in seen} - landmarks
    assert not extra, extra


# -- crafting hostile layers --------------------------------------------------------------------


def toc_doc(c: Converted) -> dict[str, Any]:
    """The TOC JSON of a converted layer, as a mutable document."""
    if c.layer.format == "estargz":
        member = c.blob[c.layer.toc_offset : len(c.blob) - 51]
        tar = gzip.decompress(member)
        size = int(tar[124:136].strip(b"\0 "), 8)
        return json.loads(tar[512 : 512 + size])  # type: ignore[no-any-return]
    start = c.layer.toc_offset + 8
    comp = c.blob[start : start + c.layer.footer.toc_length]
    return json.loads(zstandard.ZstdDecompressor().decompress(comp))  # type: ignore[no-any-return]


def with_toc(c: Converted, doc: dict[str, Any] | bytes, data: bytes | None = None,
             ) -> tuple[bytes, dict[str, str]]:
    """The layer's data area (or ``data``) followed by TOC ``doc``, and matching annotations."""
    body = c.blob[: c.layer.toc_offset] if data is None else data
    toc_json = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    if c.layer.format == "estargz":
        ti = tarfile.TarInfo("stargz.index.json")
        ti.size = len(toc_json)
        tar = ti.tobuf(tarfile.USTAR_FORMAT) + toc_json + bytes(-len(toc_json) % 512) + bytes(1024)
        co = zlib.compressobj(6, zlib.DEFLATED, 31)
        blob = body + co.compress(tar) + co.flush() + estargz_footer(len(body))
        return blob, {ESTARGZ_TOC_DIGEST: "sha256:" + hashlib.sha256(toc_json).hexdigest()}
    comp = zstandard.ZstdCompressor().compress(toc_json)
    blob = body + skippable_frame(comp)
    blob += zstd_chunked_footer(len(body) + 8, len(comp), len(toc_json), 0, 0, 0)
    return blob, {ZSTD_CHUNKED_MANIFEST_CHECKSUM: "sha256:" + hashlib.sha256(comp).hexdigest()}



def raw_index(index: bytes) -> bytes:
    """A gzip index blob (coldstart.format.gzindex), decompressed."""
    return zstandard.ZstdDecompressor().decompressobj().decompress(index)


def rewrite_index(index: bytes, *, meta: Any = None, toc: Any = None) -> bytes:
    """A gzip index blob with its metadata and TOC (parsed JSON) passed through ``meta`` and
    ``toc`` (functions that change them in place): a lying index for the tests."""
    import struct
    raw = raw_index(index)
    (mlen,) = struct.unpack_from("<Q", raw, 8)
    m = json.loads(raw[16 : 16 + mlen])
    (tlen,) = struct.unpack_from("<Q", raw, 16 + mlen)
    t = json.loads(raw[24 + mlen : 24 + mlen + tlen])
    windows = raw[24 + mlen + tlen :]
    if meta:
        meta(m)
    if toc:
        toc(t)
    mj, tj = json.dumps(m).encode(), json.dumps(t).encode()
    out = raw[:8] + struct.pack("<Q", len(mj)) + mj + struct.pack("<Q", len(tj)) + tj + windows
    return zstandard.ZstdCompressor().compress(out)
