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

from coldstart.errors import FormatError, IntegrityError
from coldstart.files import atomic_write, read_optional
from coldstart.unpack.applier import apply_tar

__all__ = ["DEFAULT_JOBS", "DEFAULT_PART", "Pulled", "chain_id", "fetch_blob", "pull_layer"]

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


def chain_id(parent_chain: str, diff_id: str) -> str:
    """The OCI chain ID of a layer over ``parent_chain`` ("" for a base layer)."""
    if not parent_chain:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent_chain} {diff_id}".encode()).hexdigest()


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
            with ThreadPoolExecutor(max(1, min(jobs, len(todo))),
                                    thread_name_prefix="fullpull") as pool:
                for f in [pool.submit(one, i) for i in todo]:
                    f.result()
    finally:
        os.close(fd)
    return fetched, resumed


@contextlib.contextmanager
def _decompressed(path: Path, media_type: str) -> Iterator[IO[bytes]]:
    if media_type.endswith(("gzip", "+gzip")) or media_type.endswith("tar.gzip"):
        import rapidgzip

        with rapidgzip.open(str(path), parallelization=os.cpu_count() or 1) as f:
            yield f
    elif media_type.endswith("zstd"):
        import zstandard

        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(
                raw, read_across_frames=True) as f:
            yield f
    elif media_type.endswith(".tar") or not media_type:
        with open(path, "rb") as f:
            yield f
    else:
        raise FormatError(f"media type {media_type!r} is not a layer this pull knows")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return "sha256:" + h.hexdigest()


def pull_layer(blob: _Blob, *, digest: str, size: int, media_type: str, dest: Path,
               workdir: Path, lowers: Sequence[Path] = (), parent_chain: str = "",
               expect_chain: str = "", jobs: int = DEFAULT_JOBS, part: int = DEFAULT_PART,
               timeout: float | None = None) -> Pulled:
    """Fetch, decompress and apply layer ``digest`` to the empty directory ``dest`` (see the
    module's doc). IntegrityError when what it unpacks to is not what containerd asked for;
    FormatError for a stream that is not a complete layer; the source's errors as raised. On
    any error ``dest`` holds a partial tree (the caller removes it); the downloaded parts are
    kept for a retry unless the blob proved bad."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / (digest.replace(":", "-") + ".part")
    state = path.with_name(path.name + ".ranges")
    t0 = time.monotonic()
    fetched, resumed = fetch_blob(blob, size, path, jobs=jobs, part=part, timeout=timeout)
    t1 = time.monotonic()
    try:
        with _decompressed(path, media_type) as stream:
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
    except (FormatError, IntegrityError):
        # the blob is bad (or lies): do not resume from it
        path.unlink(missing_ok=True)
        state.unlink(missing_ok=True)
        raise
    t2 = time.monotonic()
    path.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    return Pulled(digest, size, applied.diff_id, applied.entries, applied.file_bytes, fetched,
                  resumed, t1 - t0, t2 - t1)
