"""A big file being loaded whole (a weights loader) is streamed; interleaved sequential runs
(torch copying a tensor with a thread per core) each get their read-ahead."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.format.toc import Entry
from coldstart.lazyfs import reader as reader_mod
from coldstart.lazyfs import streams as streams_mod
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader
from tests.integration.lazy.lazy_helpers import metadata_tar
from tests.unit.lazy.test_lazy_get_path import BIG, _wait
from tests.unit.lazy.test_lazy_reader import GatedSource, make


def _streaming_reader(tmp: Path, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[LayerReader, GatedSource, ChunkFetcher, Entry, int]:
    """A reader of the test layer whose big file streams after a run of three chunks (one
    chunk per request); read-ahead on, a chunk at most. Returns it, its source, its fetcher,
    the big file and its chunk size."""
    reader, src, fetcher = make(tmp, "zstd:chunked")
    big = reader.layer.resolve(BIG)
    assert len(big.chunks) >= 12
    step = big.chunks[1].chunk_offset
    monkeypatch.setattr(reader_mod, "STREAM_MIN_FILE", 0)     # (checked by the reader)
    monkeypatch.setattr(streams_mod, "STREAM_TRIGGER", 3 * step)
    monkeypatch.setattr(streams_mod, "STREAM_SLACK", 0)
    monkeypatch.setattr(streams_mod, "STREAM_REQUEST", 3 * step)
    reader.sequential.readahead_bytes = 1           # on (it gates the stream too)
    return reader, src, fetcher, big, step


def test_two_interleaved_sequential_runs_both_get_read_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, _src, fetcher = make(tmp_path, "zstd:chunked")
    tree = metadata_tar()
    big = reader.layer.resolve(BIG)
    n = len(big.chunks)
    assert n >= 12
    reader.sequential.readahead_bytes = max(c.compressed_size for c in big.chunks)
    asked: list[int] = []
    monkeypatch.setattr(fetcher, "plan", lambda fn: fn())
    monkeypatch.setattr(fetcher, "request",
                        lambda target, chunks, **kw: asked.append(chunks[0].chunk_offset))
    step = big.chunks[1].chunk_offset                 # one chunk per read
    half = n // 2
    for i in range(4):                                # run A: chunks 0.., run B: half..
        for k in (i, half + i):
            off = big.chunks[k].chunk_offset
            assert reader.read(big, off, step) == tree.files[BIG][off:off + step]
    starts = {c.chunk_offset for c in big.chunks}
    ahead_a = [o for o in asked if o < big.chunks[half].chunk_offset]
    ahead_b = [o for o in asked if o >= big.chunks[half].chunk_offset]
    assert ahead_a and ahead_b, asked                 # each run read ahead, not one reset
    assert set(asked) <= starts


def test_a_long_run_streams_the_rest_of_the_file_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, src, fetcher, big, step = _streaming_reader(tmp_path, monkeypatch)
    tree = metadata_tar()
    n = len(big.chunks)
    mid = n // 2                                      # a run in the middle: the rest both sides
    for k in range(mid, mid + 3):
        off = big.chunks[k].chunk_offset
        assert reader.read(big, off, step) == tree.files[BIG][off:off + step]
    assert BIG in reader.sequential._streamed
    cache = fetcher.cache
    assert cache is not None
    _wait(lambda: all(c.zeros or c.digest in cache for c in big.chunks))
    _wait(lambda: fetcher.inflight() == 0)
    before = src.counting.requests
    for k in (1, n - 1):                              # both sides of the run: local now
        off = big.chunks[k].chunk_offset
        assert reader.read(big, off, step) == tree.files[BIG][off:off + step]
    assert src.counting.requests == before


def test_scattered_reads_of_a_big_file_do_not_stream_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reader, _src, fetcher, big, step = _streaming_reader(tmp_path, monkeypatch)
    n = len(big.chunks)
    for k in range(0, n, 2):                          # every other chunk: runs of one chunk
        reader.read(big, big.chunks[k].chunk_offset, step // 2)
    assert BIG not in reader.sequential._streamed
    _wait(lambda: fetcher.inflight() == 0)
    cache = fetcher.cache
    assert cache is not None
    assert not all(c.zeros or c.digest in cache for c in big.chunks)


def test_one_stream_at_a_time_on_the_node(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # while another file streams (the node's slot is taken) a long run does not start a
    # second stream; the file's next run read after the slot is free does
    reader, _src, fetcher, big, step = _streaming_reader(tmp_path, monkeypatch)
    assert fetcher.stream_slot.acquire(blocking=False)
    for k in range(0, 3):
        reader.read(big, big.chunks[k].chunk_offset, step)
    assert BIG not in reader.sequential._streamed
    fetcher.stream_slot.release()
    reader.read(big, big.chunks[3].chunk_offset, step)
    assert BIG in reader.sequential._streamed
    _wait(lambda: fetcher.stream_slot.acquire(blocking=False))   # released when it ends
    fetcher.stream_slot.release()
