"""What a snapshotted process had read of its mapped files (recorded from /proc's pagemap of a
real process), the list's checks, and reading it again through a root without leaving it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldstart.errors import FormatError
from coldstart.snapshot.touched import PAGE, Warmer, parse, record

PAGES = 4096            # 16 MiB: read-around near one page stays far from the others

_CHILD = """
import mmap, os, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
for page in (0, 1, 2, 3, 2000):
    m[page * 4096]                                  # read: the file's page
m[3000 * 4096] = 1                                  # written: a copy of its own
print("ready", flush=True)
sys.stdin.read()
"""


def _covered(ranges: list[tuple[int, int]], page: int) -> bool:
    return any(s <= page * PAGE < s + n for s, n in ranges)


def test_the_pages_a_process_read_of_a_mapped_file_are_recorded_and_not_others(
        tmp_path: Path) -> None:
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(PAGES * PAGE))
    fd = os.open(data, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # nothing of it cached yet
    os.close(fd)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(data)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        files = dict(parse(record([child.pid])))
    finally:
        child.communicate("")
    ranges = files[str(data)]
    for page in (0, 1, 2, 3, 2000):
        assert _covered(ranges, page), (page, ranges)
    assert not _covered(ranges, 3000), ranges       # copied on write: in CRIU's pages
    assert not _covered(ranges, 3500), ranges       # never read
    assert ranges == sorted(ranges)
    # the interpreter's own files are there too, the executable first among them
    assert any(p.endswith(".so") or ".so." in p for p in files), list(files)


def test_a_process_gone_records_nothing() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert json.loads(record([gone.pid])) == {"files": []}


@pytest.mark.parametrize("doc", [
    {"files": [{"path": "usr/lib/x.so", "ranges": []}]},             # relative
    {"files": [{"path": "/usr/../etc/shadow", "ranges": []}]},       # ..
    {"files": [{"path": "/usr//lib", "ranges": []}]},                # not normal
    {"files": [{"path": "/", "ranges": [[0, 1]]}]},                  # no file
    {"files": [{"path": "/x", "ranges": [[0]]}]},
    {"files": [{"path": "/x", "ranges": [[0, -1]]}]},
    {"files": [{"path": "/x", "ranges": [[True, 1]]}]},
    {"files": [{"path": "/x", "ranges": "0-1"}]},
    {"files": {"path": "/x"}},
    [],
])
def test_a_list_that_is_not_paths_and_ranges_is_refused(doc: object) -> None:
    with pytest.raises(FormatError):
        parse(json.dumps(doc).encode())


def test_garbage_is_refused() -> None:
    with pytest.raises(FormatError):
        parse(b"\x00not json")


def test_the_warmer_reads_inside_the_root_and_follows_no_link(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/a.so").write_bytes(b"a" * (3 * PAGE))
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * PAGE)
    (root / "lib").symlink_to("usr/lib")                     # a link on the way
    (root / "usr/lib/b.so").symlink_to(str(outside))          # a link at the end
    os.mkfifo(root / "usr/lib/fifo")                          # no regular file
    warmer = Warmer(root, [("/usr/lib/a.so", [(0, 2 * PAGE), (2 * PAGE, 10 * PAGE)]),
                           ("/lib/a.so", [(0, PAGE)]),
                           ("/usr/lib/b.so", [(0, PAGE)]),
                           ("/usr/lib/fifo", [(0, PAGE)]),
                           ("/usr/lib/missing.so", [(0, PAGE)])], workers=3)
    t = time.monotonic()
    assert warmer.wait(10)
    assert time.monotonic() - t < 10            # the FIFO did not block it
    assert warmer.files == 1 and warmer.skipped == 4 and warmer.complete
    assert warmer.bytes == 3 * PAGE + PAGE      # its head, then all it holds of the ranges


def test_the_containers_mounts_are_not_read(tmp_path: Path) -> None:
    """A file under one of the container's mounts (a volume) is not the image's: the rootfs
    holds another copy, hidden in the container, which is not read."""
    root = tmp_path / "rootfs"
    (root / "models").mkdir(parents=True)
    (root / "models/w.bin").write_bytes(b"w" * PAGE)
    (root / "lib.so").write_bytes(b"l" * PAGE)
    warmer = Warmer(root, [("/models/w.bin", [(0, PAGE)]), ("/lib.so", [(0, PAGE)])],
                    skip=["/models/", "/proc"])
    assert warmer.wait(10)
    assert warmer.files == 1 and warmer.skipped == 1 and warmer.bytes == 2 * PAGE  # head, range


def test_a_stopped_warmer_reads_no_more(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    size = 1 << 30
    with open(root / "big", "wb") as f:
        f.truncate(size)                                    # sparse: reads cost no disk
    warmer = Warmer(root, [("/big", [(0, size)])], workers=1)
    warmer.stop()
    assert warmer.wait(0)
    assert 0 <= warmer.bytes < size and not warmer.complete
    assert warmer.seconds > 0
    warmer.stop()           # twice: nothing closed twice

