"""Where safetensors bytes come from: local files, S3 objects, HTTP(S) URLs, registry blobs.

Every source answers one small protocol, :class:`Source`: its ``size()`` and
``read_into(offset, buffers)``, which fills the given buffers back to back with the bytes starting
at ``offset``. Buffers are the destination tensors' own memory (or pinned staging memory), so the
local source reads with ``os.preadv`` straight into them; network sources copy socket chunks in.
Every method is safe to call from many threads at once, and blocking calls release the GIL.
Network range reads have a deadline per attempt, checked between socket reads (a server that
dribbles bytes is cut off), and are retried within a total budget. Registry blobs are verified
against their digest (:meth:`RegistrySource.verify`).
Third-party errors are mapped here, once, to :mod:`coldstart.errors`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from coldstart.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)

__all__ = [
    "HttpSource",
    "LocalSource",
    "RegistrySource",
    "S3Source",
    "Source",
    "open_source",
]

# Linux IOV_MAX: preadv takes at most this many buffers per call.
_IOV_MAX = 1024
_NET_PIECE = 1 << 20
_ALIGN = 4096
# O_DIRECT bounce buffer: one per thread, shared by every file that thread reads, this size
# (a longer span is read in pieces of it). Kept: a fresh one per read would pay a page fault for
# every page it receives; freed when the thread ends.
_BOUNCE_BYTES = 8 << 20
_bounce = threading.local()
_bounce_made = [0]  # buffers made so far in this process (tests check they are reused)
_bounce_lock = threading.Lock()


def _bounce_buffer() -> mmap.mmap:
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    if buf is None:
        # Anonymous mmap memory is page aligned, which O_DIRECT requires of the buffer.
        buf = _bounce.buf = mmap.mmap(-1, _BOUNCE_BYTES,
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with _bounce_lock:
            _bounce_made[0] += 1
    return buf


def bounce_buffers_made() -> int:
    """How many O_DIRECT bounce buffers this process has made (one per reading thread)."""
    return _bounce_made[0]
# Registry blobs: size of each read when verifying the ranges a load did not read.
_VERIFY_PIECE = 8 << 20
log = logging.getLogger(__name__)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


@runtime_checkable
class Source(Protocol):
    """A byte source that many threads may read at once."""

    name: str

    def size(self) -> int:
        """Total size in bytes."""
        ...

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order with the bytes at ``offset``; short data is an error."""
        ...

    def close(self) -> None:
        """Release connections and file descriptors."""
        ...


def _fill_from_chunks(name: str, offset: int, buffers: Sequence[memoryview],
                      chunks: Any) -> None:
    """Copy an iterator of byte chunks into ``buffers``; complain if it ends early or runs long."""
    idx, pos = 0, 0
    for chunk in chunks:
        view = memoryview(chunk)
        while view.nbytes:
            while idx < len(buffers) and pos == buffers[idx].nbytes:
                idx, pos = idx + 1, 0
            if idx == len(buffers):
                raise Unavailable(f"{name}: server sent more bytes than asked at offset {offset}")
            take = min(view.nbytes, buffers[idx].nbytes - pos)
            buffers[idx][pos : pos + take] = view[:take]
            pos += take
            view = view[take:]
    while idx < len(buffers) and pos == buffers[idx].nbytes:
        idx, pos = idx + 1, 0
    if idx != len(buffers):
        raise Unavailable(f"{name}: short read at offset {offset} (connection closed early)")


def _with_retries(what: str, budget: float, per_attempt: float,
                  attempt_fn: Callable[[float], None], retries: int = 3) -> None:
    """Run ``attempt_fn(deadline)``; retry :class:`Unavailable` (not NotFound; a
    :class:`DeadlineExceeded` is retried too) with jittered backoff while the total ``budget``
    (seconds) lasts. Each attempt gets a monotonic ``deadline``: ``per_attempt`` seconds from
    its start, never past the budget. A retry rewrites the whole range: idempotent."""
    end = time.monotonic() + budget
    for attempt in range(retries + 1):
        try:
            attempt_fn(min(time.monotonic() + per_attempt, end))
            return
        except Unavailable as exc:
            pause = min(2.0, 0.1 * 2**attempt) * (0.5 + random.random())
            if attempt == retries or time.monotonic() + pause >= end:
                raise
            log.warning("%s: %s; retrying in %.2f s", what, exc, pause)
            time.sleep(pause)


def _until(deadline: float, what: str, chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks``, cut off with :class:`DeadlineExceeded` once the monotonic ``deadline``
    passes: per-read socket timeouts alone never stop a server that dribbles bytes."""
    while True:
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"{what}: not received within its deadline (the server "
                                   "is sending too slowly)")
        chunk = next(chunks, None)
        if chunk is None:
            return
        yield chunk


def _bytes_view(buf: memoryview) -> memoryview:
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


class LocalSource:
    """A local file read with ``os.preadv`` straight into the caller's buffers.

    ``direct=True`` opens the file with ``O_DIRECT`` (no page cache: what a cold load of a big
    model wants) and reads page-aligned spans into an aligned bounce buffer, falling back to
    buffered reads where the filesystem refuses ``O_DIRECT`` (tmpfs, overlayfs).

    >>> src = LocalSource("/etc/hostname")
    >>> buf = bytearray(1); src.read_into(0, [memoryview(buf)]); src.close()
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = False) -> None:
        self.name = os.fspath(path)
        try:
            self._fd = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"{self.name}: no such file") from exc
        except IsADirectoryError as exc:
            raise InvalidArgument(f"{self.name}: is a directory, not a safetensors file") from exc
        except OSError as exc:
            raise Unavailable(f"{self.name}: cannot open: {exc.strerror}") from exc
        self._size = os.fstat(self._fd).st_size
        # One descriptor per reading thread: the kernel keeps read-ahead state per open file,
        # and threads reading different regions through one descriptor spoil each other's.
        self._local = threading.local()
        self._fds: list[int] = []
        self._map: mmap.mmap | None = None
        self._map_lock = threading.Lock()
        self._direct_fd: int | None = None
        # Why O_DIRECT was asked for but is not used (None: not asked, or in use): reported in
        # LoadStats.path so a silent fallback to the page cache is visible.
        self.direct_refused: str | None = None
        self.direct_reads = 0  # reads that really went through the O_DIRECT descriptor
        if direct and not hasattr(os, "O_DIRECT"):
            self.direct_refused = "this platform has no O_DIRECT"
        elif direct:
            try:
                self._direct_fd = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:  # tmpfs, overlayfs and others refuse it: buffered reads
                self.direct_refused = f"the filesystem refused O_DIRECT ({exc.strerror})"
                self._direct_fd = None
        if self.direct_refused:
            log.warning("%s: %s; reading through the page cache", self.name,
                        self.direct_refused)
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass

    @property
    def direct(self) -> bool:
        """True when reads bypass the page cache."""
        return self._direct_fd is not None

    def size(self) -> int:
        return self._size

    def mapping(self) -> mmap.mmap:
        """A private (copy-on-write) map of the whole file, made once.

        Tensors viewing it share the page cache until written; they keep the map alive after
        :meth:`close`. Changing the file in place while they live changes them (truncating it
        makes them fault), as with ``safetensors``' own mmap loading.
        """
        with self._map_lock:
            if self._map is None:
                try:
                    self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
                except (OSError, ValueError) as exc:
                    raise Unavailable(f"{self.name}: cannot map: {exc}") from exc
            return self._map

    def populate(self, offset: int, length: int) -> None:
        """Bring ``[offset, offset+length)`` of the map into memory now (in this thread)."""
        m = self.mapping()
        start = offset - offset % mmap.PAGESIZE
        try:
            m.madvise(_MADV_POPULATE_READ, start, offset + length - start)
            return
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise Unavailable(f"{self.name}: reading at {offset} failed: {exc}") from exc
        # Kernels before 5.14: ask for read-ahead, then touch a byte of every page.
        m.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
        with memoryview(m) as view:
            sum(view[offset : offset + length : mmap.PAGESIZE])

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        if self._direct_fd is not None:
            self._read_direct(offset, buffers)
            return
        pending = [_bytes_view(b) for b in buffers if b.nbytes]
        pos = offset
        fd = self._thread_fd()
        while pending:
            batch = pending[:_IOV_MAX]
            try:
                got = os.preadv(fd, batch, pos)
            except OSError as exc:
                raise Unavailable(f"{self.name}: read at {pos} failed: {exc.strerror}") from exc
            if got == 0:
                raise Unavailable(f"{self.name}: file ended at {pos} (truncated while loading?)")
            pos += got
            # Drop the buffers that were filled; trim the one filled partly.
            while got and pending:
                first = pending[0]
                if got >= first.nbytes:
                    got -= first.nbytes
                    pending.pop(0)
                else:
                    pending[0] = first[got:]
                    got = 0

    def _thread_fd(self) -> int:
        fd: int | None = getattr(self._local, "fd", None)
        if fd is None:
            try:
                fd = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = self._fd  # e.g. out of descriptors: share the first one
            else:
                with self._map_lock:
                    self._fds.append(fd)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except OSError:
                    pass
            self._local.fd = fd
        return fd

    def _read_direct(self, offset: int, buffers: Sequence[memoryview]) -> None:
        assert self._direct_fd is not None
        total = sum(b.nbytes for b in buffers)
        start = offset - offset % _ALIGN
        stop = offset + total
        fd = self._direct_fd

        def pieces(view: memoryview) -> Iterator[memoryview]:
            # Aligned pieces of at most _BOUNCE_BYTES; each is copied out before the next read.
            pos = start
            while pos < stop:
                want = min(_BOUNCE_BYTES, -(-(stop - pos) // _ALIGN) * _ALIGN)
                got = 0
                while got < want:
                    n = os.preadv(fd, [view[got:want]], pos + got)
                    if n == 0:
                        break
                    got += n
                if pos + got < min(stop, pos + want):
                    raise Unavailable(f"{self.name}: file ended at {pos + got}")
                yield view[max(0, offset - pos) : min(got, stop - pos)]
                pos += want

        try:
            # The view is released before the read returns, also when it fails.
            with memoryview(_bounce_buffer()) as view:
                _fill_from_chunks(self.name, offset, buffers, pieces(view))
            with self._map_lock:
                self.direct_reads += 1
        except OSError as exc:
            raise Unavailable(f"{self.name}: O_DIRECT read at {start} failed: {exc}") from exc

    def close(self) -> None:
        self._map = None  # tensors still viewing it keep it alive; the last one unmaps it
        with self._map_lock:
            extra, self._fds = self._fds, []
        for fd in (self._fd, self._direct_fd, *extra):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._direct_fd = None


class HttpSource:
    """An ``http(s)://`` URL read with parallel ``Range`` GETs over one pooled httpx client.

    >>> src = HttpSource("https://example.com/model.safetensors", timeout=30.0)  # doctest: +SKIP
    """

    def __init__(self, url: str, *, timeout: float = 30.0, concurrency: int = 16,
                 client: Any = None) -> None:
        import httpx

        self.name = url
        self._httpx = httpx
        self._timeout = timeout
        self._own = client is None
        self._client: httpx.Client = client or httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=concurrency,
                                max_keepalive_connections=concurrency),
            follow_redirects=True,
        )
        self._size: int | None = None
        self._lock = threading.Lock()

    def _map(self, exc: Exception, what: str) -> Exception:
        if isinstance(exc, self._httpx.TimeoutException):
            return DeadlineExceeded(f"{self.name}: {what} timed out")
        return Unavailable(f"{self.name}: {what} failed: {exc}")

    def _check(self, status: int, what: str) -> None:
        if status == 404:
            raise NotFound(f"{self.name}: not found (HTTP 404)")
        if status >= 400:
            raise Unavailable(f"{self.name}: {what} answered HTTP {status}")

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                self._size = self._probe_size()
            return self._size

    def _probe_size(self) -> int:
        try:
            resp = self._client.head(self.name)
            if resp.status_code in (403, 405):
                # Presigned URLs sign one method: ask for the first byte and read Content-Range.
                with self._client.stream("GET", self.name, headers={"Range": "bytes=0-0"}) as r:
                    self._check(r.status_code, "GET bytes=0-0")
                    total = r.headers.get("content-range", "").rpartition("/")[2]
                    if r.status_code == 206 and total.isdigit():
                        return int(total)
                    resp = r
        except self._httpx.HTTPError as exc:
            raise self._map(exc, "HEAD") from exc
        self._check(resp.status_code, "HEAD")
        length = resp.headers.get("content-length")
        if length is None or not length.isdigit():
            raise Unavailable(f"{self.name}: server gave no Content-Length")
        return int(length)

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            return
        headers = {"Range": f"bytes={offset}-{offset + total - 1}",
                   "Accept-Encoding": "identity"}
        views = [_bytes_view(b) for b in buffers]

        what = f"{self.name}: range GET at {offset}"

        def attempt(deadline: float) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{what}: no time left")
            # No socket wait may outlast the attempt's deadline either.
            timeout = self._httpx.Timeout(min(self._timeout, left), connect=min(left, 10.0))
            try:
                with self._client.stream("GET", self.name, headers=headers,
                                         timeout=timeout) as resp:
                    self._check(resp.status_code, "range GET")
                    if resp.status_code != 206:
                        raise FailedPrecondition(
                            f"{self.name}: server ignored Range (HTTP {resp.status_code}, "
                            "expected 206)")
                    # iter_raw() without a size hands over each network read as it arrives,
                    # so the deadline is checked between reads.
                    _fill_from_chunks(self.name, offset, views,
                                      _until(deadline, what, resp.iter_raw()))
            except self._httpx.HTTPError as exc:
                raise self._map(exc, f"range GET at {offset}") from exc

        _with_retries(f"{self.name} at {offset}", self._timeout * 2, self._timeout, attempt)

    def close(self) -> None:
        if self._own:
            self._client.close()


def s3_client(*, concurrency: int = 16, timeout: float = 30.0,
              endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client for parallel ranged GETs: pool sized to ``concurrency``, deadlines set.

    Credentials come from the standard chain; ``AWS_ENDPOINT_URL`` (or ``endpoint_url``) points it
    at an S3-compatible store.

    >>> client = s3_client(concurrency=8)  # doctest: +SKIP
    """
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max(concurrency, 10),
        connect_timeout=min(timeout, 10.0),
        read_timeout=timeout,
        retries={"max_attempts": 4, "mode": "standard"},
        tcp_keepalive=True,
    )
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL")
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None, config=config)


def map_s3_error(exc: Exception, what: str) -> Exception:
    """Translate a botocore error to the coldstart tree (the one place that knows botocore)."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NoSuchBucket", "NotFound"):
            return NotFound(f"{what}: not found ({code})")
        return Unavailable(f"{what}: S3 error {code}: {exc}")
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError):
        return DeadlineExceeded(f"{what}: S3 request timed out")
    if isinstance(exc, NoCredentialsError):
        return InvalidArgument(f"{what}: no AWS credentials found in the standard chain")
    return Unavailable(f"{what}: S3 request failed: {exc}")


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")``.

    >>> split_s3_url("s3://models/llama/1/model.safetensors")
    ('models', 'llama/1/model.safetensors')
    """
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidArgument(f"{url}: not an s3://bucket/key URL")
    return parts.netloc, parts.path.lstrip("/")


class S3Source:
    """An S3 object read with parallel ranged GETs.

    >>> src = S3Source("s3://models/llama/model.safetensors")  # doctest: +SKIP
    """

    def __init__(self, url: str, *, client: Any = None, concurrency: int = 16,
                 timeout: float = 30.0) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self.name = url
        self.bucket, self.key = split_s3_url(url)
        import botocore.response

        self._errors = (BotoCoreError, ClientError)
        # What the raw urllib3 stream under a StreamingBody raises (botocore's own read()
        # translates exactly these two; _pieces reads the raw stream, so this module does).
        self._urllib3_timeout: type[Exception] = getattr(
            botocore.response, "URLLib3ReadTimeoutError", DeadlineExceeded)
        self._urllib3_errors: tuple[type[Exception], ...] = (
            self._urllib3_timeout,
            getattr(botocore.response, "URLLib3ProtocolError", Unavailable))
        self._client = client or s3_client(concurrency=concurrency, timeout=timeout)
        self._timeout = timeout
        self._size: int | None = None
        self._lock = threading.Lock()

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                try:
                    head = self._client.head_object(Bucket=self.bucket, Key=self.key)
                except self._errors as exc:
                    raise map_s3_error(exc, self.name) from exc
                self._size = int(head["ContentLength"])
            return self._size

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            return
        views = [_bytes_view(b) for b in buffers]

        what = f"{self.name}: range GET at {offset}"

        def attempt(deadline: float) -> None:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=self.key,
                                               Range=f"bytes={offset}-{offset + total - 1}")
                body = resp["Body"]
                try:
                    _fill_from_chunks(self.name, offset, views,
                                      _until(deadline, what, self._pieces(body, deadline)))
                finally:
                    body.close()
            except self._errors as exc:
                raise map_s3_error(exc, f"{self.name} at {offset}") from exc
            except self._urllib3_errors as exc:  # raised by read1 on the raw stream
                if isinstance(exc, self._urllib3_timeout):
                    raise DeadlineExceeded(f"{what}: S3 read timed out") from exc
                raise Unavailable(f"{what}: S3 body failed: {exc}") from exc

        # botocore retries failed requests; this covers a body cut off mid-stream or too slow.
        _with_retries(f"{self.name} at {offset}", self._timeout * 2, self._timeout, attempt)

    def _pieces(self, body: Any, deadline: float) -> Iterator[bytes]:
        """The body as it arrives: one network read at a time (``read1`` of the raw urllib3
        stream, where there is one), each socket wait bounded by what is left of ``deadline``.
        ``StreamingBody.read(n)`` would wait for all ``n`` bytes, however slowly they come."""
        from botocore.compat import set_socket_timeout

        raw = getattr(body, "_raw_stream", None)
        read1 = getattr(raw, "read1", None)

        def settimeout(seconds: float) -> None:
            try:
                set_socket_timeout(raw, seconds)
            except (AttributeError, OSError):  # not a plain socket underneath: reads still
                pass                           # time out after the client's read_timeout

        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"{self.name}: range not received within its "
                                           "deadline (the server is sending too slowly)")
                settimeout(max(0.001, min(self._timeout, left)))
                chunk = read1(_NET_PIECE) if callable(read1) else body.read(_NET_PIECE)
                if not chunk:
                    return
                yield chunk
        finally:
            settimeout(self._timeout)  # the connection goes back to the pool

    def close(self) -> None:
        pass


class _OrderedDigest:
    """A digest over a blob whose byte ranges arrive in any order, from many threads.

    Ranges that start at (or before) the ``next`` cursor are hashed at once; ranges that arrive
    early are held until the cursor reaches them, up to ``hold_bytes`` in all. Past that bound
    an early range is not kept: only its own sha256 is recorded, and :meth:`finish` reads it
    again and checks the second copy is the same bytes as the one that was used. So memory
    stays bounded (``hold_bytes`` plus one read) and every byte handed out is covered.
    """

    def __init__(self, algo: str, hold_bytes: int) -> None:
        self.algo = algo
        self._hasher = hashlib.new(algo)
        self._next = 0
        self._hold_bytes = hold_bytes
        self._held_bytes = 0
        self._held: dict[int, bytes] = {}
        self._recorded: dict[int, tuple[int, str]] = {}  # offset -> (length, piece digest)
        self._lock = threading.Lock()
        self.rereads = 0  # bytes read a second time by finish() (for tests and logs)

    def feed(self, offset: int, data: bytes) -> None:
        with self._lock:
            end = offset + len(data)
            if end <= self._next or not data:
                return
            if offset <= self._next:
                self._hasher.update(memoryview(data)[self._next - offset:])
                self._next = end
                self._drain()
            elif self._held_bytes + len(data) <= self._hold_bytes and offset not in self._held:
                self._held[offset] = data
                self._held_bytes += len(data)
            elif offset not in self._held and (offset not in self._recorded
                                               or self._recorded[offset][0] < len(data)):
                self._recorded[offset] = (len(data), hashlib.new(self.algo, data).hexdigest())

    def _drain(self) -> None:
        while True:
            ready = [o for o in self._held if o <= self._next]
            if not ready:
                return
            for o in sorted(ready):
                data = self._held.pop(o)
                self._held_bytes -= len(data)
                if o + len(data) > self._next:
                    self._hasher.update(memoryview(data)[self._next - o:])
                    self._next = o + len(data)

    def finish(self, size: int, read: Callable[[int, int], bytes], what: str) -> str:
        """Hash whatever was not yet hashed, in file order, reading it with ``read``."""
        with self._lock:
            while True:
                self._drain()
                early = [o for o in self._recorded if o <= self._next]
                if early:
                    o = min(early)
                    length, piece = self._recorded.pop(o)
                    self._reread(o, length, piece, read, what)
                    continue
                if self._next >= size:
                    break
                starts = [*self._held, *self._recorded]
                stop = min([size, self._next + _VERIFY_PIECE, *starts])
                data = read(self._next, stop - self._next)
                if len(data) != stop - self._next:
                    raise Unavailable(f"{what}: verifying, the registry sent {len(data)} of "
                                      f"{stop - self._next} bytes at offset {self._next}")
                self.rereads += len(data)
                self._hasher.update(data)
                self._next = stop
            return f"{self.algo}:{self._hasher.hexdigest()}"

    def _reread(self, offset: int, length: int, piece: str,
                read: Callable[[int, int], bytes], what: str) -> None:
        """Read a range that was used but not kept; it must be the same bytes."""
        check = hashlib.new(self.algo)
        pos = offset
        while pos < offset + length:
            n = min(_VERIFY_PIECE, offset + length - pos)
            data = read(pos, n)
            if len(data) != n:
                raise Unavailable(f"{what}: verifying, the registry sent {len(data)} of {n} "
                                  f"bytes at offset {pos}")
            self.rereads += n
            check.update(data)
            if pos + n > self._next:
                self._hasher.update(memoryview(data)[max(0, self._next - pos):])
                self._next = pos + n
            pos += n
        if check.hexdigest() != piece:
            raise IntegrityError(f"{what}: bytes [{offset}:{offset + length}] changed between "
                                 "two reads of the same blob")


class RegistrySource:
    """A blob in an OCI registry, ``oci://registry/repo@sha256:...``, read with range GETs.

    Goes through :class:`coldstart.oci.registry.RegistryClient` (auth, mirrors, deadlines);
    ``timeout`` bounds each request (with its retries).

    Every byte handed out is checked against the blob's digest: ranges are hashed in file
    order as they arrive (early ones held, at most ``hold_bytes``; beyond that only their own
    hash is kept and they are read again when verifying), and :meth:`verify` (the loader calls
    it before handing out any tensor) reads the ranges that were never asked for, in order,
    ``_VERIFY_PIECE`` bytes at a time, and raises :class:`IntegrityError` on a mismatch. A
    partial load (``select``) therefore still reads the whole blob once, to verify it.

    >>> url = "oci://127.0.0.1:5000/models/llama@sha256:" + "0" * 64
    >>> src = RegistrySource(url)  # doctest: +SKIP
    """

    def __init__(self, url: str, *, client: Any = None, timeout: float = 30.0,
                 hold_bytes: int = 64 << 20) -> None:
        self.name = url
        if not url.startswith("oci://"):
            raise InvalidArgument(f"{url}: not an oci://registry/repo@sha256:... URL")
        try:
            from coldstart.oci.reference import Reference
        except ImportError as exc:  # pragma: no cover - the oci package is part of coldstart
            raise Unavailable("coldstart.oci is not available") from exc
        self.ref = Reference.parse(url[len("oci://"):])
        if not self.ref.digest:
            raise InvalidArgument(f"{url}: a registry source needs a blob digest (@sha256:...)")
        self.digest: str = self.ref.digest
        algo = self.digest.split(":", 1)[0]
        if algo not in hashlib.algorithms_available:
            raise InvalidArgument(f"{url}: digest algorithm {algo!r} is not supported")
        self._timeout = timeout
        if client is None:
            try:
                from coldstart.oci.registry import RegistryClient
            except ImportError as exc:
                raise Unavailable("coldstart.oci.registry.RegistryClient is not available "
                                  "in this build") from exc
            client = RegistryClient(timeout=timeout)
        self._client = client
        self._size: int | None = None
        self._digest = _OrderedDigest(algo, hold_bytes)
        self._verified = False

    def size(self) -> int:
        if self._size is None:
            self._size = int(self._client.blob_size(self.ref, self.digest,
                                                    timeout=self._timeout))
        return self._size

    def _read(self, offset: int, length: int) -> bytes:
        data: bytes = self._client.read_blob_range(self.ref, self.digest, offset, length,
                                                   timeout=self._timeout)
        return data

    def read_into(self, offset: int, buffers: Sequence[memoryview]) -> None:
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            return
        data = self._read(offset, total)
        if len(data) != total:
            raise Unavailable(f"{self.name}: registry sent {len(data)} of {total} bytes "
                              f"at offset {offset}")
        self._digest.feed(offset, bytes(data))
        _fill_from_chunks(self.name, offset, [_bytes_view(b) for b in buffers], [data])

    @property
    def reread_bytes(self) -> int:
        """Bytes :meth:`verify` had to read a second time (never asked for, or not held)."""
        return self._digest.rereads

    def verify(self) -> None:
        """Check the blob against its digest; :class:`IntegrityError` if it differs."""
        if self._verified:
            return
        got = self._digest.finish(self.size(), self._read, self.name)
        if got != self.digest:
            raise IntegrityError(f"{self.name}: blob content is {got}, not {self.digest} "
                                 "(tampered or wrong blob)")
        self._verified = True

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if callable(close):
            close()


def open_source(location: str | os.PathLike[str], *, concurrency: int = 16,
                timeout: float = 30.0, direct: bool = False) -> Source:
    """Open one file by location: a local path, ``s3://``, ``http(s)://`` or ``oci://``.

    >>> src = open_source("/tmp/model.safetensors")  # doctest: +SKIP
    """
    text = os.fspath(location)
    scheme = urlsplit(text).scheme if "://" in text else ""
    if scheme == "s3":
        return S3Source(text, concurrency=concurrency, timeout=timeout)
    if scheme in ("http", "https"):
        return HttpSource(text, timeout=timeout, concurrency=concurrency)
    if scheme == "oci":
        return RegistrySource(text, timeout=timeout)
    if scheme in ("", "file"):
        return LocalSource(text[len("file://"):] if scheme == "file" else text, direct=direct)
    raise InvalidArgument(f"{text}: unsupported source scheme {scheme!r} "
                          "(use a path, s3://, http(s):// or oci://)")
