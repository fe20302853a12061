"""What a snapshotted process had read of its mapped files, and reading it again on a restore.

CRIU keeps the pages of a file mapping that the process never wrote out of its images: a
restored process maps the file again and faults its pages in from the file, which on a lazily
pulled rootfs means from the chunk cache or the registry, one fault at a time — first while
CRIU opens each mapped file (it reads the ELF's build-id), then while the app runs its first
request. :func:`record` notes, when the snapshot is taken, which pages of which mapped files
are in the process (``/proc/PID/pagemap``: present and file-backed); the bundle carries that
list (``touched.json``); :class:`Warmer` reads those ranges through the container's rootfs, in
parallel, while the snapshot's own pages are fetched and CRIU restores, so that CRIU and the
app find them in the page cache.

The list is a hint: a path that is not a regular file inside the rootfs (a bind mount, a file
deleted since, a symbolic link anywhere on the way) is skipped, never followed.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from coldstart.errors import FormatError

__all__ = ["MAX_BYTES", "MAX_JSON", "Warmer", "parse", "record"]

PAGE = mmap.PAGESIZE
#: the list names at most this many files …
MAX_FILES = 20_000
#: … and this many bytes in all (the rest is left to faults)
MAX_BYTES = 8 << 30
#: … in at most this many ranges
MAX_RANGES = 1_000_000
#: a ``touched.json`` of more bytes is not read
MAX_JSON = 64 << 20
#: one read of :class:`Warmer` covers at most this many bytes
READ = 1 << 20
_PRESENT, _FILE = 1 << 63, 1 << 61


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    offset: int
    path: str


def _file_vmas(pid: int) -> list[_Vma]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue            # anonymous, [heap], [stack], [vdso] …
            path = parts[5].rstrip("\n")
            if path.endswith(" (deleted)"):
                continue
            lo, _, hi = parts[0].partition("-")
            out.append(_Vma(int(lo, 16), int(hi, 16), int(parts[2], 16), path))
    return out


def _present(pagemap: int, vma: _Vma) -> Iterable[tuple[int, int]]:
    """File offsets (page-aligned start, length) of ``vma``'s pages that are in memory and
    still the file's (not copied on write)."""
    pages = (vma.end - vma.start) // PAGE
    run_start, run_len = -1, 0
    done = 0
    while done < pages:
        n = min(pages - done, 1 << 15)
        raw = os.pread(pagemap, n * 8, (vma.start // PAGE + done) * 8)
        for i, (entry,) in enumerate(struct.iter_unpack("<Q", raw)):
            off = vma.offset + (done + i) * PAGE
            if entry & _PRESENT and entry & _FILE:
                if run_len and run_start + run_len == off:
                    run_len += PAGE
                    continue
                if run_len:
                    yield run_start, run_len
                run_start, run_len = off, PAGE
        done += max(1, len(raw) // 8)
        if not raw:
            break
    if run_len:
        yield run_start, run_len


def record(pids: Sequence[int]) -> bytes:
    """``touched.json`` for the processes ``pids``: each mapped file's resident ranges, files
    in the order the first process maps them (the order CRIU opens them), ranges merged."""
    files: dict[str, list[list[int]]] = {}
    for pid in pids:
        try:
            vmas = _file_vmas(pid)
            pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue                # gone: nothing of it to record
        try:
            for vma in vmas:
                ranges = files.setdefault(vma.path, [])
                try:
                    ranges.extend([s, n] for s, n in _present(pagemap, vma))
                except OSError:
                    continue
        finally:
            os.close(pagemap)
    out = []
    for path, ranges in files.items():
        merged: list[list[int]] = []
        for s, n in sorted(ranges):
            if merged and s <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s + n - merged[-1][0])
            else:
                merged.append([s, n])
        if merged:
            out.append({"path": path, "ranges": merged})
    return json.dumps({"files": out[:MAX_FILES]}, separators=(",", ":")).encode()


def parse(data: bytes) -> list[tuple[str, list[tuple[int, int]]]]:
    """The files and ranges of a ``touched.json``; FormatError for anything else (a path that
    is not absolute and normal, a range that is not two non-negative integers)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"touched.json: {exc}") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise FormatError(f"touched.json: 'files' must be a list of at most {MAX_FILES}")
    out: list[tuple[str, list[tuple[int, int]]]] = []
    count = 0
    for f in files:
        path = f.get("path") if isinstance(f, dict) else None
        ranges = f.get("ranges") if isinstance(f, dict) else None
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or \
                str(PurePosixPath(path)) != path or ".." in PurePosixPath(path).parts or \
                path == "/":
            raise FormatError(f"touched.json: {path!r} is not an absolute, normal path")
        if not isinstance(ranges, list):
            raise FormatError(f"touched.json: {path}: 'ranges' is not a list")
        count += len(ranges)
        if count > MAX_RANGES:
            raise FormatError(f"touched.json: more than {MAX_RANGES} ranges")
        rs: list[tuple[int, int]] = []
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and
                    all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 48
                        for x in r)):
                raise FormatError(f"touched.json: {path}: {r!r} is not [offset, length]")
            rs.append((r[0], r[1]))
        out.append((path, rs))
    return out


def _open_inside(root: Path, path: str) -> int:
    """``path`` opened for reading under ``root``, no symbolic link followed on the way
    (:func:`~coldstart.snapshot.rootdiff.open_parent`'s walk) and nothing but a regular file
    opened (its type is checked on an ``O_PATH`` descriptor first: opening a device can have
    effects); OSError otherwise."""
    from coldstart.snapshot.rootdiff import open_parent

    try:
        parent, name = open_parent(root, path.lstrip("/"), create=False)
    except FormatError as exc:
        raise OSError(str(exc)) from None
    try:
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(handle)


class Warmer:
    """Reads the ranges of a ``touched.json`` through ``rootfs`` with ``workers`` threads, in
    the background (:meth:`wait` joins them, :meth:`stop` ends them). The first page of every
    file comes first (CRIU reads each mapped ELF's headers as it opens it), then the ranges,
    in the list's order. Each reader holds one file open at a time (a list of thousands of
    files holds no more descriptors than readers). Nothing it meets stops it: a file it
    cannot open, or one under ``skip`` (the container's mounts: not the image's files), is
    counted in ``skipped``."""

    def __init__(self, rootfs: Path, files: Sequence[tuple[str, Sequence[tuple[int, int]]]],
                 *, workers: int = 8, deadline: float | None = None,
                 skip: Sequence[str] = ()) -> None:
        self.bytes = 0
        self.skipped = 0
        self.files = 0
        self.seconds = 0.0
        self.complete = False           # every range read (not stopped first)
        self._t0 = self._last = time.monotonic()
        self._deadline = deadline
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen: dict[str, bool] = {}      # path -> opened once
        prefixes = tuple(p.rstrip("/") + "/" for p in skip if p.rstrip("/"))
        kept = [(p, r) for p, r in files if not (p + "/").startswith(prefixes)]
        self.skipped = len(files) - len(kept)
        heads = [(p, 0, PAGE) for p, _ in kept]
        rest: list[tuple[str, int, int]] = []
        budget = MAX_BYTES
        for path, ranges in kept:
            for start, length in ranges:
                if budget <= 0:
                    break
                length = min(length, budget)
                budget -= length
                for off in range(start, start + length, READ):
                    rest.append((path, off, min(READ, start + length - off)))
        self._todo = iter([*heads, *rest])
        self._root = rootfs
        self._threads: list[threading.Thread] = []
        try:
            for i in range(max(1, workers)):
                t = threading.Thread(target=self._run, name=f"warm-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:
            self.stop()
            raise

    def _open(self, path: str) -> int | None:
        try:
            fd = _open_inside(self._root, path)
        except OSError:
            with self._lock:
                if path not in self._seen:
                    self._seen[path] = False
                    self.skipped += 1
            return None
        with self._lock:
            if not self._seen.get(path):
                if path in self._seen:          # skipped before (EMFILE, a race): not now
                    self.skipped -= 1
                self._seen[path] = True
                self.files += 1
        return fd

    def _run(self) -> None:
        # each reader keeps the one file it reads open (the list reads a file's ranges in a
        # row): no descriptor is shared between threads, at most one held per thread
        cur_path, cur_fd = "", -1
        try:
            while not self._stop.is_set() and (self._deadline is None or
                                               time.monotonic() <= self._deadline):
                with self._lock:
                    item = next(self._todo, None)
                if item is None:
                    self.complete = True
                    return
                path, off, length = item
                try:
                    if path != cur_path:
                        if cur_fd >= 0:
                            os.close(cur_fd)
                        opened = self._open(path)
                        cur_path, cur_fd = path, -1 if opened is None else opened
                    if cur_fd < 0:
                        continue
                    n = len(os.pread(cur_fd, length, off))
                except Exception:       # a hint: nothing it meets is the restore's problem
                    continue
                with self._lock:
                    self.bytes += n
        finally:
            if cur_fd >= 0:
                os.close(cur_fd)
            with self._lock:        # when the last reader ended (done, stopped or late)
                self._last = max(self._last, time.monotonic())

    def stop(self) -> None:
        """No more reads (the one under way finishes); the threads joined (5 s at most)."""
        self._stop.set()
        self.wait(5.0)

    def wait(self, timeout: float) -> bool:
        """Join the readers for at most ``timeout`` seconds; True when they finished."""
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        done = not any(t.is_alive() for t in self._threads)
        self.seconds = (self._last if done else time.monotonic()) - self._t0
        return done
