"""Recording what a start-up reads from one lazily mounted layer.

A :class:`AccessRecorder` is attached to a layer's reader while recording is on. Every read the
FUSE server serves for a regular file (``read(2)`` and the page faults of ``mmap``'d libraries
alike: both arrive as FUSE reads) calls :meth:`AccessRecorder.note` with the file and the byte
range. It keeps, per file, the time of the first access (seconds since the recorder started, i.e.
since the layer was mounted) and the ranges touched, merged. Files come out in first-access order.

When recording is off the reader holds ``None`` and pays one attribute test per read.

>>> r = AccessRecorder(clock=iter([10.0, 10.5, 10.75, 11.0]).__next__)
>>> r.note("usr/lib/libc.so", 0, 4096); r.note("etc/passwd", 0, 100)
>>> r.note("usr/lib/libc.so", 4096, 8192)
>>> [(a.path, a.first, a.ranges) for a in r.accesses()]
[('usr/lib/libc.so', 0.5, [(0, 8192)]), ('etc/passwd', 0.75, [(0, 100)])]
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["AccessRecorder", "FileAccess", "merge_range"]

#: ranges kept per file before the closest ones are merged (a huge file read at random)
MAX_RANGES = 256


@dataclass
class FileAccess:
    """One file's accesses: first access (seconds since recording began) and merged ranges."""

    path: str
    first: float
    ranges: list[tuple[int, int]] = field(default_factory=list)   # sorted [start, end)

    @property
    def bytes(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "t": round(self.first, 6),
                "ranges": [[a, b - a] for a, b in self.ranges]}


def merge_range(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Insert ``[start, end)`` into sorted, disjoint ``ranges``, merging what touches it.

    >>> rs = [(0, 10), (20, 30)]; merge_range(rs, 10, 20); rs
    [(0, 30)]
    >>> rs = [(0, 10)]; merge_range(rs, 40, 50); merge_range(rs, 15, 20); rs
    [(0, 10), (15, 20), (40, 50)]
    """
    if end <= start:
        return
    i = bisect.bisect_left(ranges, (start, start))
    if i > 0 and ranges[i - 1][1] >= start:
        i -= 1
    j = i
    while j < len(ranges) and ranges[j][0] <= end:
        start = min(start, ranges[j][0])
        end = max(end, ranges[j][1])
        j += 1
    ranges[i:j] = [(start, end)]


def _squeeze(ranges: list[tuple[int, int]]) -> None:
    """Merge the two ranges with the smallest gap until ``MAX_RANGES`` remain."""
    while len(ranges) > MAX_RANGES:
        k = min(range(len(ranges) - 1), key=lambda i: ranges[i + 1][0] - ranges[i][1])
        ranges[k:k + 2] = [(ranges[k][0], ranges[k + 1][1])]


class AccessRecorder:
    """Thread-safe record of one layer's file accesses (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._t0 = clock()
        self._files: dict[str, FileAccess] = {}
        self._lock = threading.Lock()

    def note(self, path: str, start: int, end: int) -> None:
        """File ``path`` was read at ``[start, end)``."""
        with self._lock:
            acc = self._files.get(path)
            if acc is None:
                acc = self._files[path] = FileAccess(path, self._clock() - self._t0)
            merge_range(acc.ranges, start, end)
            if len(acc.ranges) > MAX_RANGES:
                _squeeze(acc.ranges)

    def accesses(self) -> list[FileAccess]:
        """A snapshot of the files read so far, in first-access order."""
        with self._lock:
            return [FileAccess(a.path, a.first, list(a.ranges)) for a in self._files.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)
