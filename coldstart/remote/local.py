"""A local file as a :class:`~coldstart.remote.source.Source`.

``read_at`` is ``pread``; ``read_into`` is ``preadv`` straight into the caller's buffers, through
one descriptor per reading thread (the kernel keeps read-ahead state per open file, and threads
reading different regions through one descriptor spoil each other's). ``direct=True`` opens the
file with ``O_DIRECT`` too (no page cache: what a cold load of a big model wants) and reads
page-aligned spans into a per-thread aligned bounce buffer, falling back to buffered reads where
the filesystem refuses ``O_DIRECT`` (tmpfs, overlayfs), saying why in ``direct_refused``.
:meth:`LocalFileBlob.mapping` and :meth:`~LocalFileBlob.populate` give the weights loader a
copy-on-write map of the file, brought in with ``MADV_POPULATE_READ``, and
:meth:`~LocalFileBlob.advise` lets it ask for the next ranges while it populates one. Local
reads do not wait on a network, so the ``timeout`` keyword does not apply.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from coldstart.errors import FormatError, InvalidArgument, NotFound, Unavailable
from coldstart.format.readat import check_range
from coldstart.remote.source import bytes_view, fill_from_chunks

__all__ = ["LocalFileBlob", "advise_step", "bounce_buffers_made"]

log = logging.getLogger("coldstart.remote")

# Linux IOV_MAX: preadv takes at most this many buffers per call.
_IOV_MAX = 1024
_ALIGN = 4096
# O_DIRECT bounce buffer: one per thread, shared by every file that thread reads, this size
# (a longer span is read in pieces of it). Kept: a fresh one per read would pay a page fault for
# every page it receives; freed when the thread ends.
_BOUNCE_BYTES = 8 << 20
_bounce = threading.local()
_bounce_made = [0]  # buffers made so far in this process (tests check they are reused)
_bounce_lock = threading.Lock()
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
# advise_step()'s bounds
_ADVISE_MIN = 128 << 10
_ADVISE_MAX = 16 << 20


def _bounce_buffer() -> mmap.mmap:
    buf: mmap.mmap | None = getattr(_bounce, "buf", None)
    if buf is None:
        # Anonymous mmap memory is page aligned, which O_DIRECT requires of the buffer.
        buf = _bounce.buf = mmap.mmap(-1, _BOUNCE_BYTES,
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with _bounce_lock:
            _bounce_made[0] += 1
    return buf


def advise_step(fd: int) -> int:
    """Bytes one ``POSIX_FADV_WILLNEED`` on ``fd`` reads at most: the kernel cuts a hint to
    the larger of its device's read-ahead and largest request (``read_ahead_kb``,
    ``max_sectors_kb`` in sysfs; a partition's are its disk's), between 128 KiB and 16 MiB;
    128 KiB (the kernel's default read-ahead) where the file system has no block device of
    its own (overlayfs, tmpfs) or sysfs says nothing."""
    dev = os.fstat(fd).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):
        try:
            with open(f"{queue}/read_ahead_kb") as ra, open(f"{queue}/max_sectors_kb") as ms:
                kib = max(int(ra.read()), int(ms.read()))
        except (OSError, ValueError):
            continue
        return min(_ADVISE_MAX, max(_ADVISE_MIN, kib << 10))
    return _ADVISE_MIN


def bounce_buffers_made() -> int:
    """How many O_DIRECT bounce buffers this process has made (one per reading thread)."""
    return _bounce_made[0]


class LocalFileBlob:
    """A local file read with ``pread``/``preadv`` (thread-safe, no shared file position).

    Counts ``requests`` and ``bytes_read`` of :meth:`read_at` (for tests and benchmarks).

    >>> src = LocalFileBlob("/etc/hostname")
    >>> buf = bytearray(1); src.read_into(0, [memoryview(buf)]); src.close()
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = False) -> None:
        self.name = os.fspath(path)
        self.path = Path(self.name)
        try:
            self._fd: int | None = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"{self.name}: no such file") from exc
        except IsADirectoryError as exc:
            raise InvalidArgument(f"{self.name}: is a directory, not a file") from exc
        except OSError as exc:
            raise Unavailable(f"{self.name}: cannot open: {exc.strerror}") from exc
        self._size = os.fstat(self._fd).st_size
        self._local = threading.local()
        self._fds: list[int] = []
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._direct_fd: int | None = None
        self.requests = 0
        self.bytes_read = 0
        self._advise_step: int | None = None     # advise_step() of this file, once asked
        # Why O_DIRECT was asked for but is not used (None: not asked, or in use): the weights
        # loader reports it, so a silent fallback to the page cache is visible.
        self.direct_refused: str | None = None
        self.direct_reads = 0  # reads that really went through the O_DIRECT descriptor
        if direct and not hasattr(os, "O_DIRECT"):
            self.direct_refused = "this platform has no O_DIRECT"
        elif direct:
            try:
                self._direct_fd = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as exc:  # tmpfs, overlayfs and others refuse it: buffered reads
                self.direct_refused = f"the filesystem refused O_DIRECT ({exc.strerror})"
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

    def _open_fd(self) -> int:
        fd = self._fd
        if fd is None:
            raise InvalidArgument(f"{self.name}: the file is closed")
        return fd

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        """Exactly ``length`` bytes from ``offset``; FormatError outside the file."""
        check_range(offset, length, self._size)
        fd = self._open_fd()
        parts = []
        end = offset + length
        pos = offset
        while pos < end:
            chunk = os.pread(fd, end - pos, pos)
            if not chunk:
                raise FormatError(f"{self.name}: file shrank while reading at {pos}")
            parts.append(chunk)
            pos += len(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        with self._lock:
            self.requests += 1
            self.bytes_read += len(data)
        return data

    def mapping(self) -> mmap.mmap:
        """A private (copy-on-write) map of the whole file, made once.

        Tensors viewing it share the page cache until written; they keep the map alive after
        :meth:`close`. Changing the file in place while they live changes them (truncating it
        makes them fault), as with ``safetensors``' own mmap loading.
        """
        with self._lock:
            if self._map is None:
                try:
                    self._map = mmap.mmap(self._open_fd(), 0, access=mmap.ACCESS_COPY)
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

    def advise(self, offset: int, length: int) -> None:
        """Tell the kernel ``[offset, offset+length)`` will be read soon
        (``POSIX_FADV_WILLNEED``): it allocates the pages and submits the reads now, and
        returns without waiting for the disk. A loader that populates one range while the
        next ones are on their way keeps the disk busy between its faults. One call reads at
        most the device's read-ahead or largest request (the kernel cuts the rest off), so a
        long range is asked for in steps of that size (:func:`advise_step`). A hint: a file
        system that refuses it is read as before.

        >>> src = LocalFileBlob("/etc/hostname"); src.advise(0, src.size()); src.close()
        """
        check_range(offset, length, self._size)
        if not length:
            return
        fd = self._open_fd()
        step = self._advise_step
        if step is None:
            step = self._advise_step = advise_step(fd)
        end = offset + length
        try:
            for pos in range(offset, end, step):
                os.posix_fadvise(fd, pos, min(step, end - pos), os.POSIX_FADV_WILLNEED)
        except OSError as exc:
            log.debug("%s: read-ahead hint refused: %s", self.name, exc)

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        """Fill ``buffers`` back to back from ``offset`` (``preadv``, or O_DIRECT)."""
        if self._direct_fd is not None:
            self._read_direct(offset, buffers)
            return
        pending = [bytes_view(b) for b in buffers if b.nbytes]
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
        # checked on every read: after close() a thread's descriptor number may already name
        # another file
        first = self._open_fd()
        fd: int | None = getattr(self._local, "fd", None)
        if fd is None:
            try:
                fd = os.open(self.name, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = first  # e.g. out of descriptors: share the first one
            else:
                with self._lock:
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
                fill_from_chunks(self.name, offset, [bytes_view(b) for b in buffers],
                                 pieces(view))
            with self._lock:
                self.direct_reads += 1
        except OSError as exc:
            raise Unavailable(f"{self.name}: O_DIRECT read at {start} failed: {exc}") from exc

    def close(self) -> None:
        """Close every descriptor (idempotent); maps handed out stay valid."""
        self._map = None  # tensors still viewing it keep it alive; the last one unmaps it
        with self._lock:
            extra, self._fds = self._fds, []
            fds = (self._fd, self._direct_fd, *extra)
            self._fd = self._direct_fd = None
        for fd in fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self) -> LocalFileBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
