"""A snapshot's content: CRIU's image files and the container's rootfs changes, in one
seekable layer.

The layer is a tar of ``criu/<file>`` (every file of CRIU's image directory) and, when the
container changed its root file system, ``rootfs.tar`` (:mod:`coldstart.snapshot.rootdiff`),
converted to zstd:chunked: a digest per chunk, so a node's chunk cache verifies each chunk
and keeps one copy of each, whatever snapshot, version or image it came from.

Memory pages (``pages-<n>.img``) are cut where their content says, not only every
``chunk_size`` bytes: a chunk also starts at a page whose CRC-32 has its low
:data:`CUT_BITS` bits clear (at least :data:`MIN_CHUNK` after the last start). Two snapshots
whose processes hold the same pages at other offsets (the interpreter's and the libraries'
heap after a new model version's app layer) then cut them into the same chunks, which a node
fetches once.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

from coldstart.errors import FormatError, InvalidArgument
from coldstart.format.layer import SeekableLayer
from coldstart.warmup.bundle import ReadFile

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache
    from coldstart.format.writer import LayerResult

__all__ = ["CHUNK_SIZE", "Packed", "fetch_missing", "pack", "page_cuts", "unpack"]

PAGE = 4096
#: a chunk of pages holds at most this many bytes
CHUNK_SIZE = 1 << 20
#: a content-defined cut at one page in 2**CUT_BITS: chunks of about 256 KiB
CUT_BITS = 6
MIN_CHUNK = 64 << 10
CRIU_DIR = "criu"
ROOTFS = "rootfs.tar"
#: CRIU's logs and statistics stay with the node that wrote them
_SKIP = (".log",)
MAX_FILES = 100_000


def page_cuts(f: BinaryIO, size: int) -> list[int]:
    """Offsets of ``f`` (``size`` bytes of pages) where a content-defined chunk starts."""
    cuts: list[int] = []
    last, mask, pos = 0, (1 << CUT_BITS) - 1, 0
    f.seek(0)
    while pos < size:
        block = f.read(min(1 << 20, size - pos))
        if not block:
            break
        view = memoryview(block)
        for off in range(0, len(block) - PAGE + 1, PAGE):
            at = pos + off
            if at - last >= MIN_CHUNK and zlib.crc32(view[off:off + PAGE]) & mask == 0:
                cuts.append(at)
                last = at
        pos += len(block)
    f.seek(0)
    return cuts


@dataclass(frozen=True)
class Packed:
    layer: LayerResult
    files: int
    bytes: int                 # uncompressed
    pages_bytes: int           # of which memory pages
    rootfs_bytes: int          # the rootfs changes' tar (0: none)
    sizes: dict[str, int] = field(default_factory=dict)   # CRIU file → bytes


def _criu_files(root: Path) -> Iterator[tuple[str, Path]]:
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.endswith(_SKIP) or not entry.is_file(follow_symlinks=False):
            continue
        yield entry.name, Path(entry.path)


def pack(criu_dir: Path, dst: BinaryIO, *, rootfs_tar: Path | None = None) -> Packed:
    """Write CRIU's image directory ``criu_dir`` (and the rootfs changes' tar) as one
    zstd:chunked layer to ``dst``."""
    if not (criu_dir / "inventory.img").is_file():
        raise InvalidArgument(f"{criu_dir} holds no CRIU images (no inventory.img)")
    total = pages = files = 0
    sizes: dict[str, int] = {}
    cuts: dict[str, list[int]] = {}
    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
            members = [(f"{CRIU_DIR}/{n}", p) for n, p in _criu_files(criu_dir)]
            if rootfs_tar is not None:
                members.append((ROOTFS, rootfs_tar))
            for name, path in members:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    files += 1
                    if files > MAX_FILES:
                        raise InvalidArgument(f"{criu_dir}: more than {MAX_FILES} files")
                    total += st.st_size
                    if name.startswith(f"{CRIU_DIR}/pages-"):
                        pages += st.st_size
                        cuts[name] = page_cuts(f, st.st_size)
                    if name.startswith(f"{CRIU_DIR}/"):
                        sizes[name.partition("/")[2]] = st.st_size
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = st.st_size, 0o600, 0
                    tar.addfile(info, f)
        spool.seek(0)
        from coldstart.format.writer import convert_layer

        layer = convert_layer(spool, dst, format="zstd:chunked", chunk_size=CHUNK_SIZE,
                              cuts=cuts)
    rootfs = rootfs_tar.stat().st_size if rootfs_tar is not None else 0
    return Packed(layer, files, total, pages, rootfs, sizes)


@dataclass
class Unpacked:
    files: int = 0
    size: int = 0                    # bytes written and read
    rootfs: bytes | None = None      # the rootfs changes' tar, verified; None: none


def _member(name: str) -> tuple[str, str]:
    """``("criu", file)`` or ``("rootfs", "")``; FormatError for any other name."""
    p = PurePosixPath(name.removeprefix("./"))
    if str(p) == ROOTFS:
        return "rootfs", ""
    if len(p.parts) == 2 and p.parts[0] == CRIU_DIR and p.parts[1] not in ("..", ".") and \
            "/" not in p.parts[1] and not p.is_absolute():
        return "criu", p.parts[1]
    raise FormatError(f"snapshot bundle entry {name!r} is neither criu/<file> nor {ROOTFS}")


def unpack(layer: SeekableLayer, dest: Path, *, read: ReadFile | None = None,
           into: Unpacked | None = None) -> Unpacked:
    """Write the bundle's CRIU files into the empty directory ``dest`` (created, mode 0700),
    each verified before it is written; the rootfs changes come back in memory. The whole TOC
    is checked first: a name that escapes, or an entry that is not a file, refuses the
    bundle before anything is written."""
    reader: ReadFile = read or (lambda lay, name: lay.read_file(name))
    out = into if into is not None else Unpacked()
    plan: list[tuple[str, str, str]] = []
    for name, entry in layer.toc.entries.items():
        if entry.type == "dir" and name.strip("/") in ("", ".", CRIU_DIR):
            continue
        if entry.type != "reg":
            raise FormatError(f"snapshot bundle entry {name!r} is a {entry.type}; only files")
        kind, base = _member(name)
        plan.append((name, kind, base))
    if not any(base == "inventory.img" for _, kind, base in plan if kind == "criu"):
        raise FormatError("snapshot bundle holds no criu/inventory.img")
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise InvalidArgument(f"{dest} is not empty")
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name, kind, base in plan:
            data = reader(layer, name)
            out.size += len(data)
            if kind == "rootfs":
                out.rootfs = data
                continue
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dfd)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            out.files += 1
    finally:
        with contextlib.suppress(OSError):
            os.close(dfd)
    return out


#: one range request of :func:`fetch_missing` covers at most this many bytes of the blob
SPAN = 8 << 20
#: and reads through gaps (tar headers, chunks the node has) of up to this many bytes
GAP = 64 << 10


def fetch_missing(layer: SeekableLayer, cache: ChunkCache, *, workers: int = 8,
                  span: int = SPAN) -> tuple[int, int]:
    """Put every chunk of the bundle that ``cache`` lacks into it: adjacent chunks in one
    range request of up to ``span`` bytes, ``workers`` requests at once, each chunk decoded
    and verified against its digest before it is cached (IntegrityError otherwise).
    ``(chunks already cached, chunks fetched)``."""
    from concurrent.futures import ThreadPoolExecutor

    from coldstart.format.toc import Chunk

    seen: set[str] = set()
    missing: list[Chunk] = []
    cached = 0
    for entry in layer.toc.entries.values():
        if entry.type != "reg":
            continue
        for c in layer.chunks_for(entry, 0, entry.size):
            if c.zeros or not c.digest or c.digest in seen:
                continue
            seen.add(c.digest)
            if cache.contains(c.digest):
                cached += 1
            else:
                missing.append(c)
    missing.sort(key=lambda c: c.offset)
    runs: list[list[Chunk]] = []
    for c in missing:
        last = runs[-1] if runs else None
        if last and 0 <= c.offset - last[-1].end_offset <= GAP and \
                c.end_offset - last[0].offset <= span:
            last.append(c)
        else:
            runs.append([c])

    def fetch(run: list[Chunk]) -> None:
        start = run[0].offset
        raw = layer.blob.read_at(start, run[-1].end_offset - start)
        for c in run:
            data = layer.decode_chunk(c, raw[c.offset - start:c.end_offset - start])
            cache.put(c.digest, data, verified=True)

    if runs:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(runs)))) as pool:
            for f in [pool.submit(fetch, run) for run in runs]:
                f.result()
    return cached, len(missing)
