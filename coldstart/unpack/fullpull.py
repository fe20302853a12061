"""The parallel full pull of a layer that is not mounted lazily.

containerd pulls a layer with one request and unpacks it with one gunzip thread; on a node with
cores to spare that is the cold start's longest step for an unconverted image. Here:

1. the blob is fetched with parallel range requests (``jobs`` parts of ``part`` bytes in
   flight) into ``<workdir>/<digest>.part``, each finished part recorded beside it
   (``.ranges``), so a pull that a crash or a failed request stopped resumes with the parts
   still missing;
2. as the parts arrive, in order, it is decompressed in threads of its own while it is
   applied to the snapshot's directory
   as containerd's applier would (:func:`coldstart.unpack.applier.apply_tar`): gzip by ISA-L
   (``isal``) in one thread, or by ``rapidgzip`` on every core where there are many
   (:func:`gzip_reader`); zstd frames with ``zstandard``;
3. the tar stream's digest is checked against the chain ID containerd asked for
   (``sha256(parent_chain + " " + diffID)``, or the diffID for a base layer): the config,
   which the manifest's digest covers, says what every layer must unpack to. Without a chain
   ID to check, the blob's own digest is checked instead.

Nothing here decides whether to pull in full: the snapshotter does, per layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from coldstart.errors import FormatError, IntegrityError, Unavailable
from coldstart.files import atomic_write, read_optional
from coldstart.oci.manifest import chain_id
from coldstart.oci.reference import validate_digest
from coldstart.unpack.applier import apply_tar

__all__ = ["DEFAULT_JOBS", "DEFAULT_PART", "Arrivals", "Pulled", "fetch_blob", "pull_layer",
           "remove_stale_parts"]

log = logging.getLogger(__name__)

#: bytes of one range request
DEFAULT_PART = 16 << 20
#: range requests in flight
DEFAULT_JOBS = 4
#: bytes of one read of the blob's file
_READ = 1 << 20


class _Blob(Protocol):
    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes: ...


@dataclass(frozen=True)
class Pulled:
    """One layer pulled in full: its diffID, what it held, and where the time went (the
    fetch, and the whole pull: the unpack follows the fetch as the parts arrive)."""

    digest: str
    size: int
    diff_id: str
    entries: int
    file_bytes: int
    fetched_bytes: int
    resumed_bytes: int
    fetch_seconds: float
    seconds: float


class _Stopped(Exception):
    """What a reader waiting on :class:`Arrivals` gets once the pull gave up."""


class Arrivals:
    """Which parts of a blob's file are written, for a reader that follows the fetch
    (:class:`_Following`): it waits for a part, and gets an error if the fetch failed.
    :meth:`stop`: the pull gave up; the fetch starts no more requests, waiting readers
    wake."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done: set[int] = set()
        self._error: BaseException | None = None
        self.stopped = False
        #: a reader was refused a part because the fetch failed: the fetch's error is why
        #: the unpack failed (the fetch may fail well ahead of where the reader is)
        self.refused = False

    @property
    def error(self) -> BaseException | None:
        """What ended the fetch, if it failed."""
        with self._cond:
            return self._error

    def add(self, i: int) -> None:
        with self._cond:
            self._done.add(i)
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def wait_for(self, i: int) -> None:
        with self._cond:
            while i not in self._done:
                if self._error is not None:
                    self.refused = True
                    raise Unavailable(f"the blob's fetch failed: {self._error}")
                if self.stopped:
                    raise _Stopped("the pull was stopped")
                self._cond.wait()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


class _Following(io.RawIOBase):
    """The blob's file read while :func:`fetch_blob` writes it: a read waits for the part it
    needs. Seekable (rapidgzip's parallel inflate reads ahead at offsets of its choosing)."""

    def __init__(self, path: Path, size: int, part: int, arrivals: Arrivals) -> None:
        self._path, self._size, self._part, self._arrivals = path, size, part, arrivals
        self._fd = -1            # opened once a part is written: the fetch creates the file
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR, os.SEEK_END):
            raise ValueError(f"invalid whence {whence}")
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        if self._pos >= self._size:
            return 0
        i = self._pos // self._part
        self._arrivals.wait_for(i)
        if self._fd < 0:
            self._fd = os.open(self._path, os.O_RDONLY)
        n = min(len(b), (i + 1) * self._part - self._pos, self._size - self._pos)
        got = os.preadv(self._fd, [memoryview(b)[:n]], self._pos)
        if got == 0:
            raise FormatError("the blob's file is shorter than the blob")
        self._pos += got
        return got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def fetch_blob(blob: _Blob, size: int, path: Path, *, jobs: int = DEFAULT_JOBS,
               part: int = DEFAULT_PART, timeout: float | None = None,
               progress: Callable[[int], None] | None = None,
               arrivals: Arrivals | None = None) -> tuple[int, int]:
    """Fetch ``size`` bytes of ``blob`` into ``path`` with ``jobs`` range requests in flight,
    resuming the parts a previous call finished (``path`` + ``.ranges``). Returns
    ``(bytes fetched now, bytes found done)``. The file is allocated first: a disk that cannot
    hold the blob fails before any request. ``arrivals`` is told of each part written, and of
    the error that ends the fetch."""
    try:
        return _fetch(blob, size, path, jobs, part, timeout, progress,
                      arrivals or Arrivals())
    except BaseException as exc:
        if arrivals is not None:
            arrivals.fail(exc)
        raise


def _fetch(blob: _Blob, size: int, path: Path, jobs: int, part: int, timeout: float | None,
           progress: Callable[[int], None] | None, arrivals: Arrivals) -> tuple[int, int]:
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
            if arrivals.stopped:
                return
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
            arrivals.add(i)
            if progress is not None:
                progress(n)

        todo = [i for i in range(nparts) if i not in done]
        resumed = sum(min(part, size - i * part) for i in done)
        for i in done:
            arrivals.add(i)
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


#: from this many cores on, gzip is inflated by rapidgzip on all of them
PARALLEL_INFLATE_CORES = 8


def gzip_reader(raw: IO[bytes], cores: int) -> IO[bytes]:
    """A reader of the gzip stream ``raw`` that inflates in threads of its own.

    Below :data:`PARALLEL_INFLATE_CORES`: ISA-L in one thread, beside the applier's. rapidgzip's
    parallel inflate spends about 2.5x the CPU of ISA-L's serial one for a stream (torch's big
    layer: 4.6 against 1.8 core-seconds for 960 MB), and the applier needs a core of its own,
    so on a few cores ISA-L finishes first (that layer's apply: 6.4-6.9 s against 7.4-7.7 s
    with rapidgzip on 2 cores). With many cores rapidgzip's inflate runs ahead of one thread."""
    if cores >= PARALLEL_INFLATE_CORES:
        import rapidgzip

        return rapidgzip.open(raw, parallelization=cores)  # type: ignore[no-any-return]
    from isal import igzip_threaded

    return igzip_threaded.open(raw, "rb", threads=1)  # type: ignore[no-untyped-call,no-any-return]


@contextlib.contextmanager
def _decompressed(raw: io.BufferedReader[Any]) -> Iterator[IO[bytes]]:
    """The blob's tar stream, by its magic bytes (the CRI's labels name no media type):
    gzip by :func:`gzip_reader`, zstd by zstandard, else the tar as it is."""
    magic = raw.peek(4)[:4]
    f: Any = raw
    try:
        if magic[:2] == _GZIP_MAGIC:
            f = gzip_reader(raw, os.cpu_count() or 1)
        elif magic == _ZSTD_MAGIC:
            import zstandard

            f = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    except (ValueError, RuntimeError) as exc:
        raise FormatError(f"the blob does not decompress: {type(exc).__name__}: "
                          f"{exc}") from None
    with f:
        yield f


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
    # the blob is unpacked as it arrives: parts are fetched in parallel into the file,
    # which is read in order, each part once it is written
    t0 = time.monotonic()
    arrivals = Arrivals()
    fetch: dict[str, Any] = {}

    def run_fetch() -> None:
        try:
            fetch["result"] = fetch_blob(blob, size, path, jobs=jobs, part=part,
                                         timeout=timeout, arrivals=arrivals)
        except BaseException as exc:
            fetch["error"] = exc
        fetch["seconds"] = time.monotonic() - t0

    fetcher = threading.Thread(target=run_fetch, name="fullpull-fetch", daemon=True)
    fetcher.start()
    # when the unpack fails, the fetch's error is why if the unpack was refused a part it
    # needed (it may have failed for its own reason while the fetch failed further ahead)
    judged: list[BaseException | None] = []
    try:
        try:
            with io.BufferedReader(_Following(path, size, part, arrivals), _READ) as raw, \
                    _decompressed(raw) as stream:
                try:
                    applied = apply_tar(stream, dest, lowers=lowers, what=f"layer {digest}")
                except BaseException:
                    judged.append(arrivals.error if arrivals.refused else None)
                    arrivals.stop()     # no more requests; the inflate's reader wakes
                    raise
        except BaseException:
            if not judged:              # the stream failed before the unpack began
                judged.append(arrivals.error if arrivals.refused else None)
            arrivals.stop()
            raise
        finally:
            fetcher.join()              # the requests in flight end (their deadline bounds it)
        if "error" in fetch:
            raise fetch["error"]
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
    except BaseException as exc:
        arrivals.stop()                 # (an interrupted join: the fetch starts no more)
        cause = judged[0] if judged else fetch.get("error")
        if isinstance(cause, Unavailable):
            # the registry went away: the parts done are kept for a retry
            if cause is not exc:
                raise cause from None
            raise
        # the blob is bad (or lies), or the unpack failed (a full disk): not kept
        path.unlink(missing_ok=True)
        state.unlink(missing_ok=True)
        if cause is not None and cause is not exc:
            raise cause from None
        raise
    t2 = time.monotonic()
    path.unlink(missing_ok=True)
    state.unlink(missing_ok=True)
    fetched, resumed = fetch["result"]
    return Pulled(digest, size, applied.diff_id, applied.entries, applied.file_bytes, fetched,
                  resumed, fetch["seconds"], t2 - t0)
