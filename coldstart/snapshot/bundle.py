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

import os
import stat
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO

from coldstart.errors import FormatError, IntegrityError, InvalidArgument
from coldstart.format.layer import SeekableLayer

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache
    from coldstart.format.writer import LayerResult

__all__ = ["CHUNK_SIZE", "TOUCHED", "Packed", "Unpacked", "cache_later", "materialize", "pack",
           "page_cuts"]

PAGE = 4096
#: a chunk of pages holds at most this many bytes
CHUNK_SIZE = 1 << 20
#: a content-defined cut at one page in 2**CUT_BITS: chunks of about 256 KiB
CUT_BITS = 6
MIN_CHUNK = 64 << 10
CRIU_DIR = "criu"
ROOTFS = "rootfs.tar"
#: what the process had read of its mapped files (:mod:`coldstart.snapshot.touched`)
TOUCHED = "touched.json"
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


def pack(criu_dir: Path, dst: BinaryIO, *, rootfs_tar: Path | None = None,
         touched: Path | None = None) -> Packed:
    """Write CRIU's image directory ``criu_dir`` (and the rootfs changes' tar, and the list of
    what the process read of its mapped files, first) as one zstd:chunked layer to ``dst``."""
    if not (criu_dir / "inventory.img").is_file():
        raise InvalidArgument(f"{criu_dir} holds no CRIU images (no inventory.img)")
    total = pages = files = 0
    sizes: dict[str, int] = {}
    cuts: dict[str, list[int]] = {}
    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
            members = [(TOUCHED, touched)] if touched is not None else []
            members += [(f"{CRIU_DIR}/{n}", p) for n, p in _criu_files(criu_dir)]
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
    size: int = 0                    # bytes of CRIU's files
    rootfs: bytes | None = None      # the rootfs changes' tar, verified; None: none
    chunks_cached: int = 0           # chunks the node's cache held
    chunks_fetched: int = 0          # fetched from the registry, verified
    #: ``defer_cache``: the fetched chunks, for :func:`cache_later` (digest, file, offset, size)
    uncached: list[tuple[str, str, int, int]] = field(default_factory=list)


def _member(name: str) -> tuple[str, str]:
    """``("criu", file)``, ``("rootfs", "")`` or ``("touched", "")``; FormatError for any
    other name."""
    p = PurePosixPath(name.removeprefix("./"))
    if str(p) == ROOTFS:
        return "rootfs", ""
    if str(p) == TOUCHED:
        return "touched", ""
    if len(p.parts) == 2 and p.parts[0] == CRIU_DIR and p.parts[1] not in ("..", ".") and \
            "/" not in p.parts[1] and not p.is_absolute():
        return "criu", p.parts[1]
    raise FormatError(f"snapshot bundle entry {name!r} is none of criu/<file>, {ROOTFS}, "
                      f"{TOUCHED}")


#: one range request of :func:`materialize` covers at most this many bytes of the blob
SPAN = 8 << 20
#: and reads through gaps (tar headers, chunks the node has) of up to this many bytes
GAP = 64 << 10


def materialize(layer: SeekableLayer, dest: Path, cache: ChunkCache | None, *,
                workers: int = 8, span: int = SPAN, into: Unpacked | None = None,
                deadline: float | None = None, defer_cache: bool = False) -> Unpacked:
    """Write the bundle's CRIU files into the empty directory ``dest`` (created, mode 0700),
    chunk by chunk where they belong: each chunk from ``cache`` when it holds it, else
    fetched (adjacent chunks in one range request of up to ``span`` bytes, ``workers``
    requests at once), decoded and verified against its digest, written, and handed to the
    cache's writer. The rootfs changes come back in memory. The whole TOC is checked first (a
    name that escapes, an entry that is not a file, chunks that do not cover their file
    exactly): nothing is written for a bundle that fails. IntegrityError for a chunk whose
    digest does not match: the caller removes ``dest``. ``deadline`` (``time.monotonic()``):
    DeadlineExceeded once it passes, checked before each range request. ``defer_cache``: the
    fetched chunks are not handed to ``cache`` but listed in ``uncached``, for
    :func:`cache_later` once the restore no longer waits on them."""
    from concurrent.futures import ThreadPoolExecutor

    from coldstart.format.toc import Chunk

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
    # where each chunk goes: (file descriptor, offset), by digest (a chunk held twice is
    # fetched once)
    where: dict[str, list[tuple[int, int]]] = {}
    first: dict[str, Chunk] = {}
    names: dict[int, str] = {}
    files: list[tuple[str, Any]] = []
    for name, kind, _ in plan:
        if kind != "criu":
            continue
        entry = layer.resolve(name)
        chunks = layer.chunks_for(entry, 0, entry.size)
        pos = 0
        for c in chunks:
            if c.chunk_offset != pos or c.chunk_size <= 0:
                raise FormatError(f"snapshot bundle entry {name!r}: its chunks do not cover "
                                  "it in order")
            pos += c.chunk_size
        if pos != entry.size:
            raise FormatError(f"snapshot bundle entry {name!r}: chunks hold {pos} bytes, "
                              f"the entry {entry.size}")
        files.append((name, chunks))
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise InvalidArgument(f"{dest} is not empty")
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fds: list[int] = []
    try:
        for (name, chunks), (_, _, base) in zip(
                files, [p for p in plan if p[1] == "criu"], strict=True):
            fd = os.open(base, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dfd)
            fds.append(fd)
            names[fd] = base
            size = layer.resolve(name).size
            os.ftruncate(fd, size)
            out.files += 1
            out.size += size
            for c in chunks:
                if c.zeros or not c.digest:
                    continue           # a hole reads as zeros
                where.setdefault(c.digest, []).append((fd, c.chunk_offset))
                first.setdefault(c.digest, c)
        missing: list[Chunk] = []
        for digest, c in first.items():
            got = cache.get(digest, c.chunk_size) if cache is not None else None
            if got is None:
                missing.append(c)
                continue
            out.chunks_cached += 1
            for fd, off in where[digest]:
                os.pwrite(fd, got, off)
        missing.sort(key=lambda c: c.offset)
        runs: list[list[Chunk]] = []
        for c in missing:
            last = runs[-1] if runs else None
            if last and 0 <= c.offset - last[-1].end_offset <= GAP and \
                    c.end_offset - last[0].offset <= span:
                last.append(c)
            else:
                runs.append([c])

        import threading

        listed = threading.Lock()

        def fetch(run: list[Chunk]) -> None:
            if deadline is not None and time.monotonic() > deadline:
                from coldstart.errors import DeadlineExceeded

                raise DeadlineExceeded("fetching the snapshot's chunks passed its deadline")
            start = run[0].offset
            raw = layer.blob.read_at(start, run[-1].end_offset - start)
            for c in run:
                data = layer.decode_chunk(c, raw[c.offset - start:c.end_offset - start])
                for fd, off in where[c.digest]:
                    os.pwrite(fd, data, off)
                if cache is not None and not defer_cache:
                    cache.put_async(c.digest, data, verified=True)
                elif defer_cache:       # listed as it lands: a deadline keeps what came
                    fd, off = where[c.digest][0]
                    with listed:
                        out.uncached.append((c.digest, names[fd], off, c.chunk_size))

        if runs:
            with ThreadPoolExecutor(max_workers=max(1, min(workers, len(runs)))) as pool:
                for f in [pool.submit(fetch, run) for run in runs]:
                    f.result()
        out.chunks_fetched = len(missing)
        for name, kind, _ in plan:
            if kind == "rootfs":
                out.rootfs = layer.read_file(name)      # verified: chunks and whole file
    finally:
        for fd in fds:
            os.close(fd)
        os.close(dfd)
    return out


def cache_later(dest: Path, uncached: list[tuple[str, str, int, int]], cache: ChunkCache) -> int:
    """Hand the chunks :func:`materialize` wrote into ``dest`` (``defer_cache``) to ``cache``,
    read back from their files and verified against their digests again (one that no longer
    matches is left out); the bytes handed. A file gone or short ends it: what is left is not
    cached."""
    done = 0
    for digest, base, offset, size in uncached:
        try:
            with open(dest / base, "rb") as f:
                data = os.pread(f.fileno(), size, offset)
        except OSError:
            break
        if len(data) != size:
            break
        # hashed again: the file is the node's, but anything may have changed it since (a
        # disk error, CRIU's auto-dedup punching holes into restored pages)
        try:
            cache.put_async(digest, data)
        except IntegrityError:
            continue
        done += size
    return done
