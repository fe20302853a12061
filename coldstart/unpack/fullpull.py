"""The parallel full pull of a layer that is not mounted lazily.

containerd pulls a layer with one request and unpacks it with one gunzip thread; on a node with
cores to spare that is the cold start's longest step for an unconverted image. Here:

1. the blob is fetched with parallel range requests (``jobs`` parts of ``part`` bytes in
   flight) into ``<workdir>/<digest>.part``, each finished part recorded beside it
   (``.ranges``), so a pull that a crash or a failed request stopped resumes with the parts
   still missing;
2. it is decompressed on every core (``rapidgzip`` for gzip: parallel inflate of one stream;
   zstd frames with ``zstandard``) and applied to the snapshot's directory as containerd's
   applier would (:func:`coldstart.unpack.applier.apply_tar`);
3. the tar stream's digest is checked against the chain ID containerd asked for
   (``sha256(parent_chain + " " + diffID)``, or the diffID for a base layer): the config,
   which the manifest's digest covers, says what every layer must unpack to. Without a chain
   ID to check, the blob's own digest is checked instead.

Nothing here decides whether to pull in full: the snapshotter does, per layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from coldstart.errors import FormatError, IntegrityError, Unavailable
from coldstart.files import atomic_write, read_optional
from coldstart.oci.manifest import chain_id
from coldstart.oci.reference import validate_digest
from coldstart.unpack.applier import apply_tar

__all__ = ["DEFAULT_JOBS", "DEFAULT_PART", "Pulled", "fetch_blob", "pull_layer",
           "remove_stale_parts"]

log = logging.getLogger(__name__)

#: bytes of one range request
DEFAULT_PART = 16 << 20
#: range requests in flight
DEFAULT_JOBS = 4


class _Blob(Protocol):
    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes: ...


@dataclass(frozen=True)
class Pulled:
    """One layer pulled in full: its diffID, what it held, and where the time went."""

    digest: str
    size: int
    diff_id: str
    entries: int
    file_bytes: int
    fetched_bytes: int
    resumed_bytes: int
    fetch_seconds: float
    apply_seconds: float


def fetch_blob(blob: _Blob, size: int, path: Path, *, jobs: int = DEFAULT_JOBS,
               part: int = DEFAULT_PART, timeout: float | None = None,
               progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Fetch ``size`` bytes of ``blob`` into ``path`` with ``jobs`` range requests in flight,
    resuming the parts a previous call finished (``path`` + ``.ranges``). Returns
    ``(bytes fetched now, bytes found done)``. The file is allocated first: a disk that cannot
    hold the blob fails before any request."""
    state = path.with_name(path.name + ".ranges")
    nparts = max(1, -(-size // part))
    done: set[int] = set()
    raw = read_optional(state)
    if raw and path.exists() and path.stat().st_size == size:
        try:
            doc = json.loads(raw)
            if doc.get("size") == size and doc.get("part") == part:
                done = {int(i) for i in doc.get("done", []) if 0 <= int(i) < nparts}
        except (ValueError, TypeError, AttributeError):
            done = set()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    lock = threading.Lock()
    fetched = 0
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, 0)
            done = set()
        if size:
            os.posix_fallocate(fd, 0, size)

        def one(i: int) -> None:
            nonlocal fetched
            off = i * part
            n = min(part, size - off)
            data = blob.read_at(off, n, timeout=timeout)
            view = memoryview(data)
            pos = off
            while view:
                w = os.pwrite(fd, view, pos)
                view, pos = view[w:], pos + w
            with lock:
                done.add(i)
                fetched += n
                atomic_write(state, json.dumps({"size": size, "part": part,
                                                "done": sorted(done)}).encode(), mode=0o600)
            if progress is not None:
                progress(n)

        todo = [i for i in range(nparts) if i not in done]
        resumed = sum(min(part, size - i * part) for i in done)
        if todo:
            pool = ThreadPoolExecutor(max(1, min(jobs, len(todo))),
                                      thread_name_prefix="fullpull")
            try:
                for f in [pool.submit(one, i) for i in todo]:
                    f.result()
            finally:
                # a failed part: the others not started are dropped, not waited for
                pool.shutdown(wait=True, cancel_futures=True)
    finally:
        os.close(fd)
    return fetched, resumed


_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@contextlib.contextmanager
def _decompressed(path: Path) -> Iterator[IO[bytes]]:
    """The blob's tar stream, by its magic bytes (the CRI's labels name no media type):
    gzip inflated by rapidgzip on every core, zstd by zstandard, else the tar as it is."""
    with open(path, "rb") as raw:
        magic = raw.read(4)
        raw.seek(0)
        try:
            if magic[:2] == _GZIP_MAGIC:
                import rapidgzip

                with rapidgzip.open(raw, parallelization=os.cpu_count() or 1) as f:
                    yield f
                return
            if magic == _ZSTD_MAGIC:
                import zstandard

                with zstandard.ZstdDecompressor().stream_reader(
                        raw, read_across_frames=True) as z:
                    yield z
                return
        except (ValueError, RuntimeError, OSError) as exc:
            raise FormatError(f"the blob does not decompress: {type(exc).__name__}: "
                              f"{exc}") from None
        yield raw


def remove_stale_parts(workdir: Path, older_than: float = 86400.0) -> int:
    """Remove downloads a pull left and nobody resumed for ``older_than`` seconds."""
    n = 0
    now = time.time()
    for p in workdir.glob("*.part*") if workdir.is_dir() else ():
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > older_than:
                p.unlink()
                n += 1
    return n


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return "sha256:" + h.hexdigest()


def pull_layer(blob: _Blob, *, digest: str, size: int, dest: Path,
               workdir: Path, lowers: Sequence[Path] = (), parent_chain: str = "",
               expect_chain: str = "", jobs: int = DEFAULT_JOBS, part: int = DEFAULT_PART,
               timeout: float | None = None) -> Pulled:
    """Fetch, decompress and apply layer ``digest`` to the empty directory ``dest`` (see the
    module's doc). IntegrityError when what it unpacks to is not what containerd asked for;
    FormatError for a stream that is not a complete layer; the source's errors as raised. On
    any error ``dest`` holds a partial tree (the caller removes it); the downloaded parts are
    kept for a retry unless the blob proved bad."""
    validate_digest(digest)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / (digest.replace(":", "-") + ".part")
    state = path.with_name(path.name + ".ranges")
    t0 = time.monotonic()
    try:
        fetched, resumed = fetch_blob(blob, size, path, jobs=jobs, part=part, timeout=timeout)
    except Unavailable:
        raise                           # a transport failure: the parts done are kept
    except BaseException:
        path.unlink(missing_ok=True)    # a full disk, a bad answer: start afresh next time
        state.unlink(missing_ok=True)
        raise
    t1 = time.monotonic()
    try:
        with _decompressed(path) as stream:
            applied = apply_tar(stream, dest, lowers=lowers, what=f"layer {digest}")
        if expect_chain:
            got = chain_id(parent_chain, applied.diff_id)
            if got != expect_chain:
                raise IntegrityError(
                    f"layer {digest} unpacks to diffID {applied.diff_id}: chain {got}, not the "
                    f"{expect_chain} containerd asked for")
        else:
            got = _sha256_file(path)
            if got != digest:
                raise IntegrityError(f"layer {digest}: the blob fetched is {got}")
    except BaseException:
        # the blob is bad (or lies), or the unpack failed (a full disk): not kept
        path.unlink(missing_ok=True)
        state.unlink(missing_ok=True)
        raise
    t2 = time.monotonic()
    path.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return Pulled(digest, size, applied.diff_id, applied.entries, applied.file_bytes, fetched,
                  resumed, t1 - t0, t2 - t1)
