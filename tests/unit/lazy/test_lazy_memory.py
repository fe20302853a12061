"""What a mounted layer holds stays bounded: its TOC in columns once compacted, a bounded cache
of the entries and answers it made, however much of the layer is walked (issue 15, item 4).

Memory is counted with tracemalloc (Python's own allocations: exact and repeatable, not a
timing); the FUSE server's resident figures are in ``bench/bench_pull.py``."""

from __future__ import annotations

import gc
import io
import tarfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.format.toc import Chunk, Entry, TOCEntries
from coldstart.format.writer import convert_layer
from coldstart.lazyfs import fusefs
from coldstart.lazyfs import tree as tree_module
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.tree import LayerTree, build_tree
from coldstart.remote import ReadAtSource

FILES = 20_000


def _many_files_layer(files: int, fmt: str = "zstd:chunked") -> tuple[bytes, dict[str, str]]:
    """A layer of ``files`` small files in directories of 100 (what CUDA images look like)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in range((files + 99) // 100):
            ti = tarfile.TarInfo(f"pkg/d{d:04d}")
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(ti)
            for f in range(min(100, files - d * 100)):
                data = f"VALUE = {d * 100 + f}\n".encode()
                ti = tarfile.TarInfo(f"pkg/d{d:04d}/m{f:03d}.py")
                ti.size, ti.mode, ti.uid, ti.uname = len(data), 0o644, 1000, "app"
                tf.addfile(ti, io.BytesIO(data))
    out = io.BytesIO()
    res = convert_layer(io.BytesIO(buf.getvalue()), out, format=fmt)
    return out.getvalue(), res.annotations


@pytest.fixture(scope="module")
def many() -> tuple[bytes, dict[str, str]]:
    return _many_files_layer(FILES)


def _held(make: Callable[[], object]) -> tuple[object, int]:
    """(what ``make`` returns, the bytes of Python memory it still holds)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = make()
        gc.collect()
        return got, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["zstd:chunked", "estargz"])
def test_a_compacted_toc_holds_a_few_hundred_bytes_per_entry(fmt: str) -> None:
    blob, annotations = _many_files_layer(FILES, fmt)

    def mounted() -> object:
        layer = open_layer(BytesReadAt(blob), annotations=annotations)
        layer.toc.compact()
        return layer

    layer, held = _held(mounted)
    per_entry = held / FILES
    # the decoder's objects cost about 1,200-1,400 bytes per entry here; the columns, the
    # names and their sorted index about 170
    assert per_entry < 400, per_entry
    toc = layer.toc  # type: ignore[attr-defined]
    # and the entries made from the columns are what the layer says
    e = toc.entries["pkg/d0007/m042.py"]
    assert (e.type, e.size, e.mode, e.uid, e.uname) == ("reg", len(b"VALUE = 742\n"), 0o644,
                                                         1000, "app")
    assert layer.read_file("pkg/d0007/m042.py") == b"VALUE = 742\n"  # type: ignore[attr-defined]


def test_entries_made_are_kept_up_to_a_bound_and_shared_while_kept() -> None:
    made: list[int] = []

    def make(i: int) -> Entry:
        made.append(i)
        return Entry(name=f"f{i}", type="reg")

    es = TOCEntries([f"f{i}" for i in range(100)], make, ["reg"] * 100, keep=10)
    first = es["f1"]
    assert es["f1"] is first and made == [1]              # kept: made once
    for i in range(100):
        assert es.at(i).name == f"f{i}"
    assert len(es._made) <= 10                            # never more than ``keep``
    assert es["f1"] == first                              # made again, the same entry
    with pytest.raises(IndexError):
        es.at(100)


def test_a_sorted_index_answers_as_the_dict_did() -> None:
    names = ["", "b", "a", "a/x", "a/x/y", "c\udcff", "é"]
    es = TOCEntries(names, lambda i: Entry(name=names[i], type="dir"), ["dir"] * 7)
    before = {n: es.position(n) for n in [*names, "zz", "a/", "a/x/"]}
    es.compact()
    assert {n: es.position(n) for n in before} == before
    assert "a/x" in es and "a/z" not in es and 3 not in es  # type: ignore[operator]


def _reader(tmp: Path, blob: bytes, annotations: dict[str, str]) -> LayerReader:
    layer = open_layer(BytesReadAt(blob), annotations=annotations)
    fetcher = ChunkFetcher(ChunkCache(tmp, max_bytes=1 << 20))
    return LayerReader("sha256:" + "0" * 64, layer, ReadAtSource(BytesReadAt(blob)), fetcher)


def test_walking_every_directory_keeps_a_bounded_set_of_answers(
        tmp_path: Path, many: tuple[bytes, dict[str, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_module, "KEEP_ANSWERS", 500)
    tree: LayerTree = build_tree("k", 10, _reader(tmp_path, *many))
    fs = fusefs.FuseFS()
    seen = 0
    todo = [tree.root]
    while todo:                                           # what find does: every name
        ino = todo.pop()
        fs._attr(tree, ino)
        tree.xattrs_of(ino)
        kids = tree.kids(ino)
        if kids is not None:
            seen += len(kids)
            assert tree.listing[ino] == sorted(kids.items())
            todo += kids.values()
    assert seen == FILES + FILES // 100 + 1               # every file, every dir, pkg
    held = sum(len(k) for k in tree._kids.values())
    assert held <= 500 + 100 and len(tree.attrs) <= 500 and len(tree._xattrs) <= 500
    # answers worked out again after being let go are the same
    pkg = tree.children[tree.root][b"pkg"]
    d7 = tree.children[pkg][b"d0007"]
    assert tree.entries[tree.children[d7][b"m042.py"] - tree.base].name == "pkg/d0007/m042.py"
    assert tree.nlink[pkg - tree.base] == 2 + FILES // 100


def test_the_neighbour_index_lists_the_small_files_chunks_in_blob_order(
        tmp_path: Path, many: tuple[bytes, dict[str, str]]) -> None:
    reader = _reader(tmp_path, *many)
    toc = reader.layer.toc
    toc.compact()
    expected = sorted((c for e in toc.entries.values() if e.type == "reg"
                       and e.size <= reader.small_file_bytes for c in e.chunks if not c.zeros),
                      key=lambda c: (c.offset, c.inner_offset))
    small = reader.windows.warm_index()
    assert len(small) == len(expected) == FILES
    got: list[Chunk] = list(small.between(0, 1 << 62))
    assert got == expected and [c.owner for c in got] == [c.owner for c in expected]
    lo, hi = expected[100].offset, expected[200].offset
    assert list(small.between(lo, hi)) == expected[100:200]
