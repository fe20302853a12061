"""FUSE handlers answer an errno whatever they meet: an unexpected exception is logged with
the layer and path, counted and answered EIO (the session's loop asks ``unexpected`` for the
errno), and a broken cache read falls back to the slow path."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.errors import NotFound
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.fusefs import INTERNAL_ERROR, FuseFS
from coldstart.lazyfs.fusewire import FuseError, Later
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.tree import LayerTree, build_tree
from coldstart.remote import ReadAtSource
from tests.integration.lazy.lazy_helpers import SourceTree, convert, metadata_tar

NAME = "usr/share/doc/f010.txt"


@pytest.fixture
def source() -> SourceTree:
    return metadata_tar(big_size=100_000)


@pytest.fixture
def fs_tree(tmp_path: Path, source: SourceTree) -> tuple[FuseFS, LayerTree, list[str]]:
    blob, res = convert(source.tar, "zstd:chunked")
    layer = open_layer(BytesReadAt(blob), annotations=res.annotations)
    fetcher = ChunkFetcher(ChunkCache(tmp_path, max_bytes=1 << 24))
    reader = LayerReader(res.digest, layer, ReadAtSource(BytesReadAt(blob)), fetcher)
    counted: list[str] = []
    fs = FuseFS(read_threads=2, on_error=counted.append)
    tree = build_tree("k", fs.allocate(len(layer.toc.entries) + 1), reader)
    fs.add(tree)
    return fs, tree, counted


def _ino(tree: LayerTree, path: str) -> int:
    ino = tree.root
    for part in path.split("/"):
        ino = tree.children[ino][part.encode()]
    return ino


def _broken(*_args: object, **_kwargs: object) -> object:
    raise OSError(errno.EIO, "Input/output error: injected")


def _answer(fs: FuseFS, op: str, inode: int, call: Callable[[], object]) -> object:
    """What the session answers: the value (a Later run as its worker would, its pieces
    written one after the other), or the errno of the FuseError raised or of ``unexpected``."""
    try:
        got = call()
        if isinstance(got, Later):
            got = got.work()
            if not isinstance(got, bytes):
                got = b"".join(got)
        return got
    except FuseError as exc:
        return exc.errno
    except Exception as exc:
        return fs.unexpected(op, inode, exc)


def test_a_broken_cache_read_falls_back_to_the_slow_path(
        fs_tree: tuple[FuseFS, LayerTree, list[str]], source: SourceTree,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fs, tree, counted = fs_tree
    monkeypatch.setattr(tree.reader, "read_cached", _broken)
    ino = _ino(tree, NAME)
    with caplog.at_level(logging.ERROR, logger="coldstart.lazyfs.fusefs"):
        data = _answer(fs, "read", ino, lambda: fs.read(ino, 0, 1 << 20))
    assert data == source.files[NAME]
    assert fs.internal_errors == 1 and counted == [INTERNAL_ERROR]
    assert any(tree.reader.digest in r.getMessage() and NAME in r.getMessage()
               and "injected" in r.getMessage() for r in caplog.records), caplog.text


def test_an_unexpected_error_on_both_read_paths_is_eio(
        fs_tree: tuple[FuseFS, LayerTree, list[str]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    fs, tree, counted = fs_tree
    monkeypatch.setattr(tree.reader, "read_cached", _broken)
    monkeypatch.setattr(tree.reader, "read_pieces", _broken)
    ino = _ino(tree, NAME)
    with caplog.at_level(logging.ERROR, logger="coldstart.lazyfs.fusefs"):
        assert _answer(fs, "read", ino, lambda: fs.read(ino, 0, 4096)) == errno.EIO
    assert fs.internal_errors == 2 and counted == [INTERNAL_ERROR] * 2
    assert sum(tree.reader.digest in r.getMessage() and NAME in r.getMessage()
               for r in caplog.records) == 2, caplog.text


def test_metadata_handlers_answer_an_errno_for_any_exception(
        fs_tree: tuple[FuseFS, LayerTree, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    fs, tree, counted = fs_tree
    ino = _ino(tree, NAME)
    monkeypatch.setattr(fs, "_attr", _broken)
    for op, inode, call in (("getattr", ino, lambda: fs.getattr(ino)),
                            ("lookup", tree.root, lambda: fs.lookup(tree.root, b"usr"))):
        assert _answer(fs, op, inode, call) == errno.EIO
    assert fs.internal_errors == 2 and counted == [INTERNAL_ERROR] * 2

    def not_found(*_args: object) -> object:
        raise NotFound("gone")

    monkeypatch.setattr(fs, "_attr", not_found)  # an expected failure: its errno, not counted
    assert _answer(fs, "getattr", ino, lambda: fs.getattr(ino)) == errno.ENOENT
    assert fs.internal_errors == 2


def test_the_ordinary_errnos_are_unchanged(
        fs_tree: tuple[FuseFS, LayerTree, list[str]]) -> None:
    fs, tree, counted = fs_tree
    with pytest.raises(FuseError) as exc:
        fs.readlink(_ino(tree, NAME))
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(FuseError) as exc:
        fs.getattr(tree.end + 1000)
    assert exc.value.errno == errno.ESTALE
    assert fs.internal_errors == 0 and counted == []


def test_listings_and_getattr_count_as_busy_and_show_the_entries(
        fs_tree: tuple[FuseFS, LayerTree, list[str]]) -> None:
    """A find lists directories and looks nothing up: readdir and getattr mark the node busy
    (the fill and the cache's writes wait for a pause), and what a listing shows of each
    entry (read without making it) is what the entry says."""
    import stat as stat_module

    fs, tree, _ = fs_tree
    fetcher = tree.reader.fetcher
    fetcher.last_read = 0.0
    doc = _ino(tree, "usr/share/doc")
    listed = list(fs.readdir(doc, 0, True))
    assert fetcher.last_read > 0
    fetcher.last_read = 0.0
    fs.getattr(_ino(tree, NAME))
    assert fetcher.last_read > 0
    assert len(listed) > 10
    assert [n for n, *_ in listed] == sorted(n for n, *_ in listed)
    for pos, (name, ino, kind, head, next_off) in enumerate(listed):
        assert next_off == pos + 1
        e = tree.entry(ino - tree.base)
        assert e.basename == name.decode()
        attr = fs.lookup(doc, name)
        # the listing's packed entry is the lookup's answer, byte for byte
        assert head == attr.entry() and ino == attr.st_ino
        assert kind == stat_module.S_IFMT(attr.st_mode) >> 12
        assert stat_module.S_IMODE(attr.st_mode) == e.mode & 0o7777
        assert (attr.st_uid, attr.st_gid, attr.st_mtime_ns) == (e.uid, e.gid, max(0, e.mtime_ns))
        assert attr.st_size == (e.size if e.type == "reg" else 4096 if e.type == "dir" else
                                len(e.link_name.encode()) if e.type == "symlink" else 0)
    # without attributes: the same names, inodes and types, no entries
    assert [(n, i, k, b"", o) for n, i, k, _, o in listed] == list(fs.readdir(doc, 0, False))
    assert list(fs.readdir(doc, 3, True)) == listed[3:]
