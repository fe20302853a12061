"""The FUSE transport (:mod:`coldstart.lazyfs.fusewire`) on a real mount, with a small file
system of its own: attributes, contents (in the loop and from a worker), listings longer than
one request, symlinks, extended attributes and their size protocol, errors, the stop and the
takeover of a connection by a second session."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coldstart.lazyfs.fusewire import (
    ENOATTR,
    GETXATTR,
    ROOT_INODE,
    Attr,
    FuseError,
    FuseSession,
    Later,
    Listed,
    StatFs,
    listed,
)
from coldstart.lazyfs.mountsys import is_mountpoint, lazy_unmount

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0,
                                reason="needs /dev/fuse and root (mount(2) of FUSE)")

TEXT = b"hello, lazy world\n" * 1000
SLOW = bytes(range(256)) * 600
PIECES = bytes(range(251)) * 5000
KIDS = [f"entry-with-a-long-name-{i:04d}" for i in range(300)]
BIG_XATTR = b"y" * 3000
MTIME_NS = 1_700_000_000_123_456_789


class ToyFS:
    """Inodes: 2 a.txt, 3 link -> a.txt, 4 dir/ (300 files, inodes 100+), 5 slow.bin (read
    in a worker), 6 boom (its read fails unexpectedly), 7 pieces.bin and 8 crumbs.bin
    (answered in pieces from a worker: 4096 bytes each, and 97)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.unexpected_errors: list[tuple[str, int, str]] = []
        self.names = {b"a.txt": 2, b"link": 3, b"dir": 4, b"slow.bin": 5, b"boom": 6,
                      b"pieces.bin": 7, b"crumbs.bin": 8}
        self.extra: dict[bytes, int] = {}

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def _attr(self, ino: int) -> Attr:
        a = Attr()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = 60.0
        a.st_mtime_ns = a.st_ctime_ns = a.st_atime_ns = MTIME_NS
        a.st_uid, a.st_gid = 1234, 5678
        if ino in (ROOT_INODE, 4):
            a.st_mode = stat.S_IFDIR | 0o755
            a.st_nlink = 2
        elif ino == 3:
            a.st_mode = stat.S_IFLNK | 0o777
            a.st_size = 5
        else:
            a.st_mode = stat.S_IFREG | 0o644
            a.st_size = {2: len(TEXT), 5: len(SLOW), 6: 10, 7: len(PIECES),
                         8: len(PIECES)}.get(ino, 0)
        return a

    def lookup(self, parent: int, name: bytes) -> Attr:
        self._count("lookup")
        if parent == ROOT_INODE:
            ino = self.names.get(name) or self.extra.get(name)
        elif parent == 4 and name.decode() in KIDS:
            ino = 100 + KIDS.index(name.decode())
        else:
            ino = None
        if ino is None:
            a = Attr()
            a.entry_timeout = 60.0      # a negative entry the kernel keeps
            return a
        return self._attr(ino)

    def getattr(self, inode: int) -> Attr:
        return self._attr(inode)

    def readlink(self, inode: int) -> bytes:
        if inode != 3:
            raise FuseError(errno.EINVAL)
        return b"a.txt"

    def opendir(self, inode: int) -> bool:
        if inode not in (ROOT_INODE, 4):
            raise FuseError(errno.ENOTDIR)
        return inode != ROOT_INODE

    def readdir(self, inode: int, start: int, plus: bool) -> Iterator[Listed]:
        self._count("readdir")
        if inode == ROOT_INODE:
            items = sorted({**self.names, **self.extra}.items())
        else:
            items = [(k.encode(), 100 + i) for i, k in enumerate(KIDS)]
        for i in range(start, len(items)):
            name, ino = items[i]
            yield listed(name, self._attr(ino), i + 1, plus)

    def read(self, inode: int, offset: int, size: int) -> bytes | Later:
        self._count("read")
        if inode == 2:
            return TEXT[offset:offset + size]
        if inode == 5:
            def slow() -> bytes:
                time.sleep(0.05)
                return SLOW[offset:offset + size]
            return Later(slow)
        if inode == 6:
            raise RuntimeError("injected")
        if inode in (7, 8):     # pieces (views and bytes), few or more than one writev takes
            step = 4096 if inode == 7 else 97
            view = memoryview(PIECES)[offset:offset + size]

            def pieces() -> list[bytes | memoryview]:
                return [bytes(view[i:i + step]) if i // step % 2 else view[i:i + step]
                        for i in range(0, len(view), step)]
            return Later(pieces)
        return b""

    def getxattr(self, inode: int, name: bytes) -> bytes:
        values = {b"user.small": b"x", b"user.big": BIG_XATTR} if inode == 2 else {}
        if name not in values:
            raise FuseError(ENOATTR)
        return values[name]

    def listxattr(self, inode: int) -> list[bytes]:
        return [b"user.small", b"user.big"] if inode == 2 else []

    def access(self, inode: int, mask: int) -> None:
        if mask & os.W_OK:
            raise FuseError(errno.EROFS)

    def statfs(self) -> StatFs:
        return StatFs(blocks=100, files=306)

    def unexpected(self, op: str, inode: int, exc: BaseException) -> int:
        self.unexpected_errors.append((op, inode, str(exc)))
        return errno.EIO


def _serve(session: FuseSession) -> threading.Thread:
    t = threading.Thread(target=session.serve, daemon=True)
    t.start()
    return t


@pytest.fixture
def toy(tmp_path: Path) -> Iterator[tuple[ToyFS, FuseSession, Path]]:
    mp = tmp_path / "mnt"
    mp.mkdir()
    fs = ToyFS()
    session = FuseSession.mount(fs, str(mp), fsname="toy", subtype="toy",
                                options=("default_permissions", "allow_other"),
                                read_threads=2)
    thread = _serve(session)
    try:
        yield fs, session, mp
    finally:
        session.close(unmount=True, mountpoint=str(mp))
        thread.join(10)
    assert not thread.is_alive()
    assert not is_mountpoint(str(mp))


def test_attributes_contents_and_links(toy: tuple[ToyFS, FuseSession, Path]) -> None:
    _, _, mp = toy
    st = os.stat(mp / "a.txt")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert (st.st_size, st.st_uid, st.st_gid) == (len(TEXT), 1234, 5678)
    assert st.st_mtime_ns == MTIME_NS
    assert (mp / "a.txt").read_bytes() == TEXT
    assert (mp / "slow.bin").read_bytes() == SLOW       # answered from a worker thread
    # a worker's answer in pieces: written as they are, or joined past what a writev takes
    assert (mp / "pieces.bin").read_bytes() == PIECES
    assert (mp / "crumbs.bin").read_bytes() == PIECES
    assert os.readlink(mp / "link") == "a.txt"
    assert (mp / "link").read_bytes() == TEXT
    s = os.statvfs(mp)
    assert (s.f_blocks, s.f_files) == (100, 306)


def test_a_listing_longer_than_one_request(toy: tuple[ToyFS, FuseSession, Path]) -> None:
    fs, _, mp = toy
    assert sorted(os.listdir(mp / "dir")) == KIDS
    assert fs.calls["readdir"] > 2      # 300 long names do not fit one 4 KiB answer
    st = os.stat(mp / "dir" / KIDS[-1])  # readdirplus told the kernel: no lookup needed
    assert st.st_ino == 100 + len(KIDS) - 1
    assert sorted(os.listdir(mp)) == sorted(n.decode() for n in fs.names)


def test_extended_attributes_and_their_size_protocol(
        toy: tuple[ToyFS, FuseSession, Path]) -> None:
    _, _, mp = toy
    f = mp / "a.txt"
    assert os.getxattr(f, "user.small") == b"x"
    assert os.getxattr(f, "user.big") == BIG_XATTR
    assert sorted(os.listxattr(f)) == ["user.big", "user.small"]
    with pytest.raises(OSError) as exc:
        os.getxattr(f, "user.none")
    assert exc.value.errno == errno.ENODATA
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(16)
    n = libc.getxattr(os.fsencode(f), b"user.big", buf, ctypes.c_size_t(16))
    assert n == -1 and ctypes.get_errno() == errno.ERANGE
    assert libc.getxattr(os.fsencode(f), b"user.big", None, ctypes.c_size_t(0)) == 3000


def test_a_session_without_xattrs_makes_the_kernel_stop_asking(tmp_path: Path) -> None:
    """``xattrs=False``: the first getxattr is answered ENOSYS, and the kernel answers every
    later one itself (EOPNOTSUPP) without a request; listxattr is still answered."""
    mp = tmp_path / "mnt"
    mp.mkdir()
    session = FuseSession.mount(ToyFS(), str(mp), fsname="toy", subtype="toy",
                                options=("default_permissions", "allow_other"),
                                read_threads=2, xattrs=False)
    sent: list[int] = []
    answer = session._dispatch[GETXATTR]

    def counted(unique: int, nodeid: int, body: memoryview) -> None:
        sent.append(nodeid)
        answer(unique, nodeid, body)

    session._dispatch[GETXATTR] = counted
    thread = _serve(session)
    try:
        for name in ("user.small", "user.small", "user.none", "trusted.overlay.metacopy"):
            with pytest.raises(OSError) as exc:
                os.getxattr(mp / "a.txt", name)
            assert exc.value.errno == errno.EOPNOTSUPP
        assert len(sent) == 1                   # the first only: the kernel stopped asking
        assert sorted(os.listxattr(mp / "a.txt")) == ["user.big", "user.small"]
    finally:
        session.close(unmount=True, mountpoint=str(mp))
        thread.join(10)
    assert not is_mountpoint(str(mp))


def test_errors_and_negative_entries(toy: tuple[ToyFS, FuseSession, Path]) -> None:
    fs, _, mp = toy
    with pytest.raises(OSError) as exc:
        (mp / "boom").read_bytes()
    assert exc.value.errno == errno.EIO
    assert fs.unexpected_errors and fs.unexpected_errors[0][:2] == ("read", 6)
    with pytest.raises(OSError) as exc:
        open(mp / "a.txt", "r+b")  # noqa: SIM115 - the open itself must fail
    assert exc.value.errno == errno.EROFS
    looked = fs.calls["lookup"]
    for _ in range(3):
        assert not (mp / "missing").exists()
    assert fs.calls["lookup"] == looked + 1     # the negative entry is cached


def test_reads_carry_the_inode_without_an_open(toy: tuple[ToyFS, FuseSession, Path]) -> None:
    _, _, mp = toy
    # two files open at once: each read answers from its own inode (OPEN is never served)
    with open(mp / "a.txt", "rb", buffering=0) as a, open(mp / "slow.bin", "rb",
                                                          buffering=0) as b:
        assert a.read(10) == TEXT[:10]
        assert b.read(10) == SLOW[:10]


def test_a_second_session_takes_the_connection_over(
        toy: tuple[ToyFS, FuseSession, Path]) -> None:
    fs, first, mp = toy
    assert (mp / "a.txt").read_bytes()[:5] == b"hello"
    held = os.dup(first.fd)                 # what the holder process keeps
    first.terminate()
    time.sleep(0.2)
    first.close(unmount=False)              # a server that dies: the mount stays
    assert is_mountpoint(str(mp))
    fs.extra[b"new"] = 2
    second = FuseSession.adopt(held, fs, read_threads=2)
    thread = _serve(second)
    try:
        assert (mp / "new").read_bytes() == TEXT    # a lookup the second session answered
    finally:
        second.close(unmount=True, mountpoint=str(mp))
        thread.join(10)
    assert not thread.is_alive()
    assert not is_mountpoint(str(mp))


class _Predecessor(FuseSession):
    """A predecessor that negotiated writes of 4 MiB (more than this transport asks for;
    libfuse asks for 256 pages, 16 MiB on a kernel of 64 KiB pages): the kernel refuses to
    read a request into a buffer that could not hold one, so the request buffer must grow."""

    def _init(self, unique: int, nodeid: int, body: memoryview) -> None:
        _major, minor, readahead, flags = struct.unpack_from("<IIII", body)
        wanted = flags & ((1 << 0) | (1 << 22) | (1 << 30))     # async read, max pages, ext
        self._reply(unique, struct.pack("<IIIIHHIIHHII24x", 7, min(minor, 38), readahead,
                                        wanted, 64, 48, 4 << 20, 1, 256, 0, 0, 0))


def _within(seconds: float, mp: Path, fn: Callable[[], object]) -> object:
    """``fn()`` in a thread; if it has not returned in time, the FUSE connection of ``mp`` is
    aborted (a request nobody answers would hang the test) and the test fails."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        dev = next(line.split()[2] for line in
                   Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] == str(mp))
        Path(f"/sys/fs/fuse/connections/{dev.split(':')[1]}/abort").write_text("1")
        pytest.fail(f"no answer within {seconds} s (connection aborted)")
    return out[0] if out else None


def test_a_connection_a_predecessor_negotiated_bigger_is_taken_over(tmp_path: Path) -> None:
    mp = tmp_path / "mnt"
    mp.mkdir()
    fs = ToyFS()
    first = _Predecessor.mount(fs, str(mp), fsname="toy", subtype="toy", read_threads=2)
    thread = _serve(first)
    held = -1
    second: FuseSession | None = None
    try:
        _within(10, mp, lambda: os.stat(mp / "a.txt"))     # INIT done, and served after it
        held = os.dup(first.fd)
        first.close(unmount=False)
        thread.join(10)
        second = FuseSession.adopt(held, fs, read_threads=2)
        held = -1
        thread = _serve(second)
        assert _within(10, mp, lambda: (mp / "slow.bin").read_bytes()) == SLOW
    finally:
        if held >= 0:
            os.close(held)
        (second or first).close(unmount=True, mountpoint=str(mp))
        lazy_unmount(str(mp))
        thread.join(10)
    assert not thread.is_alive() and not is_mountpoint(str(mp))
