"""Local blob source and range coalescing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.format.readat import ReadAt
from coldstart.remote import LocalFileBlob, Source, coalesce


def test_local_file_blob(tmp_path: Path) -> None:
    data = bytes(range(256)) * 100
    (tmp_path / "b").write_bytes(data)
    with LocalFileBlob(tmp_path / "b") as blob:
        assert isinstance(blob, Source) and isinstance(blob, ReadAt)
        assert blob.size() == len(data)
        assert blob.read_at(10, 5) == data[10:15]
        assert blob.read_at(len(data), 0) == b""
        with pytest.raises(FormatError):
            blob.read_at(len(data) - 1, 2)
        with pytest.raises(InvalidArgument):
            blob.read_at(-1, 1)
        out: list[bytes] = []
        threads = [threading.Thread(target=lambda i=i: out.append(blob.read_at(i * 97, 300)))
                   for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(out) == sorted(data[i * 97: i * 97 + 300] for i in range(20))
        assert blob.requests == 22
    with pytest.raises(NotFound):
        LocalFileBlob(tmp_path / "missing")


def test_coalesce() -> None:
    assert coalesce([], 10) == []
    assert coalesce([(100, 10), (0, 10), (12, 4)], 2) == [(0, 16), (100, 10)]
    assert coalesce([(0, 10), (5, 2)], 0) == [(0, 10)]        # contained
    assert coalesce([(0, 10), (10, 10)], 0) == [(0, 20)]      # adjacent
    assert coalesce([(0, 10), (11, 10)], 0) == [(0, 10), (11, 10)]
    assert coalesce([(0, 0), (5, 1)], 0) == [(5, 1)]
    # a cap on request size keeps far-reaching merges apart
    assert coalesce([(0, 10), (10, 10), (20, 10)], 0, max_length=20) == [(0, 20), (20, 10)]
    assert coalesce([(0, 50), (10, 5)], 0, max_length=20) == [(0, 50)]   # contained


def test_local_file_reads_after_close_are_refused_in_every_thread(tmp_path: Path) -> None:
    # a thread's own descriptor must not be used after close(): its number may name another
    # file by then
    (tmp_path / "b").write_bytes(b"x" * 8192)
    blob = LocalFileBlob(tmp_path / "b")
    buf = bytearray(100)
    errors: list[BaseException] = []
    ready, closed = threading.Event(), threading.Event()

    def reader() -> None:
        blob.read_into(0, [memoryview(buf)])     # opens this thread's descriptor
        ready.set()
        closed.wait(10)
        try:
            blob.read_into(0, [memoryview(buf)])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    assert ready.wait(10)
    blob.close()
    closed.set()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], InvalidArgument), errors
