"""PageCacheWarmer: which bytes of a verified chunk go to which inode (whole pages only, a
partial last page only at the end of the file), files it cannot take, and the prefetch
handing it its chunks (never while recording). The kernel side runs in
tests/integration/lazy/test_lazy_page_cache.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from coldstart.format.toc import Chunk
from coldstart.lazyfs.pagecache import PAGE, PageCacheWarmer
from coldstart.lazyfs.target import LayerStats
from coldstart.prefetch.recorder import AccessRecorder
from tests.integration.lazy.lazy_helpers import metadata_tar
from tests.unit.lazy.test_lazy_reader import make


class Stores:
    """A stand-in for the kernel: records each store."""

    def __init__(self, fail: int | None = None) -> None:
        self.calls: list[tuple[int, int, bytes]] = []
        self.fail = fail

    def __call__(self, ino: int, offset: int, data: memoryview) -> None:
        if self.fail is not None:
            raise OSError(self.fail, os.strerror(self.fail))
        self.calls.append((ino, offset, bytes(data)))


def _warmer(tmp_path: Path, sizes: dict[str, int], store: Stores,
            stats: LayerStats | None = None) -> PageCacheWarmer:
    for name in sizes:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    return PageCacheWarmer(tmp_path, sizes.get, store, stats=stats)


def _chunk(name: str, at: int, size: int) -> Chunk:
    return Chunk(0, 1, at, size, "sha256:" + "0" * 64, owner=name)


def test_whole_pages_only_except_at_the_end_of_the_file(tmp_path: Path) -> None:
    size = 3 * PAGE + 100
    store = Stores()
    stats = LayerStats()
    w = _warmer(tmp_path, {"f": size}, store, stats)
    ino = os.stat(tmp_path / "f").st_ino
    data = bytes(range(256)) * (size // 256 + 1)
    # a chunk starting mid-page and ending mid-page (not the file's end): the pages it
    # fully holds
    w.put(_chunk("f", 100, 2 * PAGE), data[100 : 100 + 2 * PAGE])
    # the last chunk: its partial last page ends the file, so it is stored
    w.put(_chunk("f", 2 * PAGE, PAGE + 100), data[2 * PAGE : size])
    assert w.join(10)
    assert store.calls == [
        (ino, PAGE, data[PAGE : 2 * PAGE]),
        (ino, 2 * PAGE, data[2 * PAGE : size]),
    ]
    assert w.bytes_stored == stats.page_cache_bytes == PAGE + PAGE + 100
    assert stats.as_dict()["page_cache_bytes"] == w.bytes_stored


def test_a_chunk_within_one_page_is_not_stored(tmp_path: Path) -> None:
    store = Stores()
    w = _warmer(tmp_path, {"f": 10 * PAGE}, store)
    w.put(_chunk("f", 10, 500), b"x" * 500)
    assert w.join(10)
    assert store.calls == []


def test_files_it_cannot_take_are_skipped(tmp_path: Path) -> None:
    store = Stores()
    w = _warmer(tmp_path, {"f": PAGE}, store)
    (tmp_path / "d").mkdir()
    w.put(_chunk("missing", 0, PAGE), b"m" * PAGE)      # not on the mount
    w.put(_chunk("d", 0, PAGE), b"d" * PAGE)            # not a regular file
    w.put(_chunk("", 0, PAGE), b"?" * PAGE)             # no owner
    w.put(_chunk("f", 0, PAGE), b"f" * PAGE)
    assert w.join(10)
    assert [c[2][:1] for c in store.calls] == [b"f"]


def test_a_store_error_skips_that_chunk_and_enosys_stops_the_warmer(tmp_path: Path) -> None:
    store = Stores(fail=errno.ENOENT)                   # the kernel forgot the inode
    w = _warmer(tmp_path, {"f": 4 * PAGE}, store)
    w.put(_chunk("f", 0, PAGE), b"a" * PAGE)
    assert w.join(10)
    store.fail = None
    w.put(_chunk("f", PAGE, PAGE), b"b" * PAGE)
    assert w.join(10)
    assert [off for _, off, _ in store.calls] == [PAGE]
    store.fail = errno.ENOSYS                           # a kernel without NOTIFY_STORE
    w.put(_chunk("f", 2 * PAGE, PAGE), b"c" * PAGE)
    w.join(1)          # the thread is gone: the marker is not answered
    store.fail = None
    w.put(_chunk("f", 3 * PAGE, PAGE), b"d" * PAGE)     # dropped: the warmer is off
    w.join(1)
    assert [off for _, off, _ in store.calls] == [PAGE]


@pytest.mark.parametrize("recording", [False, True])
def test_prefetch_hands_each_verified_chunk_over_unless_recording(tmp_path: Path,
                                                                  recording: bool) -> None:
    tree = metadata_tar()
    names = ["usr/lib/big.so", "etc/os-release"]
    reader, _, _ = make(tmp_path / "r", "zstd:chunked", tar=tree.tar, prefetch=names)
    if recording:
        reader.recorder = AccessRecorder()
    got: dict[str, bytearray] = {}
    root = tmp_path / "mnt"
    sizes = {n: len(tree.files[n]) for n in names}

    def store(ino: int, offset: int, data: memoryview) -> None:
        name = next(n for n in names if os.stat(root / n).st_ino == ino)
        buf = got.setdefault(name, bytearray(sizes[name]))
        buf[offset : offset + len(data)] = data

    reader.page_cache = PageCacheWarmer(root, sizes.get, store,
                                        enabled=lambda: reader.recorder is None)
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(b"")
    reader.prefetcher.prefetch()
    assert reader.page_cache.join(10)
    if recording:      # the recorder must see the start-up's reads: nothing was pushed
        assert got == {}
        return
    for n in names:
        assert bytes(got[n]) == tree.files[n], n
    reader.close()


def test_a_node_that_has_the_chunks_already_still_warms_the_page_cache(tmp_path: Path) -> None:
    tree = metadata_tar()
    names = ["usr/lib/big.so", "etc/os-release"]
    reader, src, _ = make(tmp_path / "r", "zstd:chunked", tar=tree.tar, prefetch=names)
    reader.prefetcher.prefetch()          # the node's cache now holds the start-up set
    requests = src.counting.requests
    root = tmp_path / "mnt"
    store = Stores()
    reader.page_cache = _warmer(root, {n: len(tree.files[n]) for n in names}, store)
    reader.prefetcher.prefetch()          # a second container of the image on the node
    assert reader.page_cache.join(10)
    assert src.counting.requests == requests           # nothing fetched again
    pushed = {n: bytearray(len(tree.files[n])) for n in names}
    inos = {os.stat(root / n).st_ino: n for n in names}
    for ino, offset, data in store.calls:
        pushed[inos[ino]][offset : offset + len(data)] = data
    assert {n: bytes(b) for n, b in pushed.items()} == {n: tree.files[n] for n in names}


def test_queued_bytes_are_bounded_and_the_thread_ends_when_idle(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from coldstart.lazyfs import pagecache

    monkeypatch.setattr(pagecache, "IDLE_EXIT", 0.1)
    release = threading.Event()
    calls: list[int] = []

    def slow_store(ino: int, offset: int, data: memoryview) -> None:
        release.wait(10)
        calls.append(offset)

    w = _warmer(tmp_path, {"f": 64 * PAGE}, Stores())
    w.store = slow_store
    w.max_queued = 3 * PAGE
    assert w.put(_chunk("f", 0, PAGE), b"a" * PAGE)     # taken by the thread, held in store
    deadline = 50
    while w._queued and deadline:                        # the thread took it off the queue
        deadline -= 1
        threading.Event().wait(0.02)
    assert all(w.put(_chunk("f", (1 + i) * PAGE, PAGE), b"b" * PAGE) for i in range(3))
    assert not w.put(_chunk("f", 4 * PAGE, PAGE), b"c" * PAGE)   # over the bound: dropped
    assert w.dropped == 1
    release.set()
    assert w.join(10)
    assert calls == [0, PAGE, 2 * PAGE, 3 * PAGE]
    thread = w._thread
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive() and w._thread is None   # ended once idle
    assert w.put(_chunk("f", 5 * PAGE, PAGE), b"d" * PAGE)   # and comes back
    assert w.join(10)
    assert calls[-1] == 5 * PAGE
    w.close()
