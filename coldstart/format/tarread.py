"""Reading a tar stream safely: the input decompressed, every header checked, entries made.

:func:`open_tar_stream` sniffs plain, gzip or zstd from the first bytes and decompresses in a
background thread (zlib and zstandard release the GIL), 1 MiB ahead; a zstd stream cut off
inside a frame is an error (zstandard's own reader would end cleanly). :class:`Counted` counts
what is read, so a caller can tell a finished tar from one cut off at a header boundary.

tarfile trusts what it reads. Iterating with :func:`checked_members` over a tarfile opened with a
:class:`HeaderLog`'s ``tarinfo`` class refuses what it would mishandle: a header with a negative
size (read as "to the end"), a PAX or long-name header over :data:`MAX_SPECIAL_SIZE` (read into
memory whole), an archive ended by a corrupt header instead of its end-of-archive blocks (every
member after it dropped without a word); and maps tarfile's, zlib's and zstandard's errors to
:class:`~coldstart.errors.FormatError`. :func:`entry_from` makes a TOC
:class:`~coldstart.format.toc.Entry` from a header (exact PAX mtimes, ``SCHILY.xattr.*`` as
xattrs, no NUL bytes or negative numbers). The layer converter (:mod:`.writer`), the gzip index
(:mod:`.gzindex`) and the full-pull applier (:mod:`coldstart.unpack.applier`) read through these.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import queue
import re
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import IO, Any, Self, cast

import zstandard

from coldstart.errors import FormatError
from coldstart.format.tarheader import parse_block
from coldstart.format.toc import MODE_PERM_MASK, Entry, normalize_name

__all__ = [
    "BLOCK",
    "MAX_SPECIAL_SIZE",
    "TAR_PARSE_ERRORS",
    "XATTR_PREFIX",
    "Counted",
    "HeaderLog",
    "checked_members",
    "entry_from",
    "member_reader",
    "mtime_ns",
    "open_tar_stream",
    "tar_errors",
]

BLOCK = 512
XATTR_PREFIX = "SCHILY.xattr."
_TYPES = {
    tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.CONTTYPE: "reg",
    tarfile.GNUTYPE_SPARSE: "reg", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink", tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}


class _Prefixed(io.RawIOBase):
    """A stream with some already-read bytes put back in front (for magic sniffing)."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(view))
        view[: len(data)] = data
        return len(data)


class _ZstdFrames(io.RawIOBase):
    """Decompress concatenated zstd frames; a stream that stops inside a frame is an error.

    (zstandard's stream_reader returns a clean EOF for a truncated frame, which would let a
    cut-off layer convert into a shorter, valid-looking one.)
    """

    def __init__(self, src: IO[bytes]) -> None:
        self._src = src
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        while not self._buf:
            data = self._src.read(1 << 20)
            if not data:
                if self._in_frame:
                    raise FormatError("input is truncated: zstd stream ends inside a frame")
                return 0
            while data:
                self._in_frame = True
                try:
                    self._buf += self._obj.decompress(data)  # one refill, then sliced out
                except zstandard.ZstdError as exc:
                    raise FormatError(f"input is corrupt: {exc}") from None
                if not self._obj.eof:
                    break
                data = self._obj.unused_data
                self._obj = self._dctx.decompressobj()
                self._in_frame = False
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


class _Readahead(io.RawIOBase):
    """Decompress the input in a background thread (zlib/zstd release the GIL), 1 MiB ahead.

    Errors raised there are re-raised in the reader; ``close`` stops and joins the thread.
    """

    _BLOCK = 1 << 20

    def __init__(self, inner: IO[bytes], depth: int = 8) -> None:
        self._inner = inner
        self._q: queue.Queue[bytes | BaseException] = queue.Queue(depth)
        self._stop = threading.Event()
        self._cur = memoryview(b"")
        self._eof = False
        self._thread = threading.Thread(target=self._run, name="convert-read", daemon=True)
        self._thread.start()

    def _put(self, item: bytes | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while True:
                data = self._inner.read(self._BLOCK)
                if not self._put(data) or not data:
                    return
        except BaseException as exc:  # handed to the reading thread
            self._put(exc)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        while not self._cur and not self._eof:
            item = self._q.get()
            if isinstance(item, BaseException):
                self._eof = True
                raise item
            if not item:
                self._eof = True
            self._cur = memoryview(item)
        n = min(len(view), len(self._cur))
        view[:n] = self._cur[:n]
        self._cur = self._cur[n:]
        return n

    def close(self) -> None:
        # Join, so that nothing reads the caller's stream once its reader is closed (the
        # converter's caller may go on reading it, e.g. to hash the rest).
        self._stop.set()
        self._thread.join()
        super().close()


class Counted(io.RawIOBase):
    """Counts the bytes read through it (to tell a finished tar from a truncated one).

    Past the end, a few empty reads are answered (tarfile looks for the end-of-archive
    blocks); then EOFError: tarfile's stream mode skips a member's data by reading it, and a
    header claiming exabytes on a truncated input would have it read nothing forever."""

    #: empty reads answered past the end before EOFError
    EMPTY_READS = 64

    def __init__(self, inner: IO[bytes]) -> None:
        self._inner = inner
        self.count = 0
        self._empty = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        data = self._inner.read(len(view))
        if not data and len(view):
            self._empty += 1
            if self._empty > self.EMPTY_READS:
                raise EOFError("the input ends inside a member's data (its header claims "
                               "more bytes than there are)")
        view[: len(data)] = data
        self.count += len(data)
        return len(data)


def open_tar_stream(src: IO[bytes]) -> IO[bytes]:
    head = src.read(4)
    raw = io.BufferedReader(_Prefixed(head, src), 1 << 20)
    if head[:2] == b"\x1f\x8b":
        return cast(IO[bytes], _Readahead(cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))))
    if head == b"\x28\xb5\x2f\xfd":
        return cast(IO[bytes], _Readahead(io.BufferedReader(_ZstdFrames(raw), 1 << 20)))
    return cast(IO[bytes], _Readahead(raw))

def entry_from(info: tarfile.TarInfo, name: str) -> Entry:
    etype = _TYPES.get(info.type)
    if etype is None:
        raise FormatError(f"entry {info.name!r}: unsupported tar entry type {info.type!r}")
    xattrs = {k[len(XATTR_PREFIX):]: v.encode("utf-8", "surrogateescape")
              for k, v in info.pax_headers.items() if k.startswith(XATTR_PREFIX)}
    link = info.linkname
    if etype == "hardlink":
        link = normalize_name(link, what=f"hardlink {name!r} target")
    entry = Entry(
        name=name, type=etype, size=info.size if etype == "reg" else 0,
        mode=info.mode & MODE_PERM_MASK, uid=info.uid, gid=info.gid, uname=info.uname,
        gname=info.gname,
        mtime_ns=mtime_ns(info),
        link_name=link, dev_major=info.devmajor if etype in ("char", "block") else 0,
        dev_minor=info.devminor if etype in ("char", "block") else 0, xattrs=xattrs,
    )
    # a PAX path, linkpath, uname or gname may carry NUL bytes (a record's length that runs
    # into the padding); no file system name holds one, and Go's archive/tar refuses them
    for key, text in (("name", info.name), ("link name", info.linkname),
                      ("user name", info.uname), ("group name", info.gname)):
        if "\x00" in text:
            raise FormatError(f"entry {info.name!r:.80}: a NUL byte in its {key}")
    # tarfile reads "-1" from an octal field or a PAX record as -1; a TOC may not hold it
    for key, value in (("size", entry.size), ("uid", entry.uid), ("gid", entry.gid),
                       ("devmajor", entry.dev_major), ("devminor", entry.dev_minor)):
        if value < 0:
            raise FormatError(f"entry {info.name!r}: negative {key} ({value})")
    return entry


_DIGITS = re.compile(r"[0-9]+")


def mtime_ns(info: tarfile.TarInfo) -> int:
    # The PAX record is exact; going through tarfile's float would round nanoseconds.
    text = info.pax_headers.get("mtime")
    if text is None:
        return int(info.mtime) * 1_000_000_000
    neg = text.startswith("-")
    whole, _, frac = text.lstrip("-+").partition(".")
    # ASCII digits only (str.isdigit() takes "²", int() does not), and few enough for a year
    # below 10000 (int() refuses over 4300 digits)
    if not _DIGITS.fullmatch(whole) or (frac and not _DIGITS.fullmatch(frac)):
        raise FormatError(f"entry {info.name!r}: PAX mtime {text!r:.40} is not a number")
    if len(whole) > 20:
        raise FormatError(f"entry {info.name!r}: PAX mtime {text!r:.40} is out of range")
    ns = int(whole) * 1_000_000_000 + int(frac[:9].ljust(9, "0") or "0")
    return -ns if neg else ns

_SPECIAL_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                  tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
#: Their largest size: Go's archive/tar (containerd's, Docker's) refuses more than 1 MiB too.
MAX_SPECIAL_SIZE = 1 << 20


class HeaderLog:
    """The last header block tarfile parsed (``tarinfo`` is the TarInfo class that logs it,
    and refuses a PAX or long-name header over :data:`MAX_SPECIAL_SIZE`: tarfile would read
    all it claims into memory).

    tarfile ends an archive at the first block that is not a valid header, whatever it holds;
    :meth:`check_end` refuses an archive that ended so at anything but an end-of-archive block
    (zeros), where it would drop every member after a corrupt header without a word.
    """

    def __init__(self) -> None:
        self.block = b""
        log = self

        class _Logged(tarfile.TarInfo):
            @classmethod
            def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> Self:
                log.block = bytes(buf)
                info = parse_block(cls, buf, encoding, errors) or \
                    super().frombuf(buf, encoding, errors)
                if info.size < 0:      # tarfile would read it as "to the end" (Go refuses)
                    raise FormatError(f"input: a header with a negative size ({info.size})")
                if info.type in _SPECIAL_TYPES and info.size > MAX_SPECIAL_SIZE:
                    raise FormatError(f"input: a {info.type.decode()!r} header of {info.size} "
                                      f"bytes, over the {MAX_SPECIAL_SIZE} byte limit")
                return info

        self.tarinfo: type[tarfile.TarInfo] = _Logged

    def check_end(self) -> None:
        """FormatError unless the archive ended at a zero block (or at a short one: the
        truncation check of :func:`~coldstart.format.writer.convert_layer` refuses that)."""
        if len(self.block) == BLOCK and self.block.count(0) != BLOCK:
            raise FormatError("input is not a valid tar stream: a corrupt header ends it "
                              "before its end-of-archive marker")


#: What tarfile raises, beside TarError, on a malformed header (a GNU sparse map or PAX number
#: that is not one: ValueError; one too large for a file offset: OverflowError).
TAR_PARSE_ERRORS = (ValueError, OverflowError)


@contextlib.contextmanager
def tar_errors() -> Iterator[None]:
    """What reading a tar stream raises, as FormatError (one mapping for opening and
    reading)."""
    try:
        yield
    except tarfile.TarError as exc:
        raise FormatError(f"input is not a valid tar stream: {exc}") from None
    except (EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile) as exc:
        raise FormatError(f"input is truncated or corrupt: {exc}") from None
    except TAR_PARSE_ERRORS as exc:
        raise FormatError(f"input is not a valid tar stream: {exc}") from None


def checked_members(tf: tarfile.TarFile, headers: HeaderLog) -> Iterator[tarfile.TarInfo]:
    with tar_errors():
        for info in tf:
            if info.size < 0:       # a PAX size record (the header's is checked as parsed)
                raise FormatError(f"entry {info.name!r}: a negative size ({info.size})")
            yield info
    headers.check_end()


def member_reader(tf: tarfile.TarFile, info: tarfile.TarInfo) -> Callable[[int], bytes]:
    f = tf.extractfile(info)
    if f is None:
        raise FormatError(f"entry {info.name!r}: no data")

    def read(n: int) -> bytes:
        try:
            return f.read(n)
        except (tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError,
                gzip.BadGzipFile, OSError) as exc:
            raise FormatError(f"entry {info.name!r}: cannot read data: {exc}") from None
    return read
