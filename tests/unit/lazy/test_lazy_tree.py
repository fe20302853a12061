"""The FUSE inode table built from a TOC, and the control protocol's error mapping."""

from __future__ import annotations

import io
import stat
import tarfile
from pathlib import Path

import pytest

from coldstart import errors
from coldstart.cache import ChunkCache
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.format.toc import Entry, TOCEntries
from coldstart.lazyfs.client import _error
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.server import error_payload
from coldstart.lazyfs.tree import LayerTree, build_tree
from coldstart.remote import ReadAtSource
from tests.integration.lazy.lazy_helpers import convert, metadata_tar


def _tree(tmp: Path, base: int = 100, tar: bytes | None = None,
          fmt: str = "estargz") -> LayerTree:
    blob, res = convert(metadata_tar(big_size=100_000).tar if tar is None else tar, fmt)
    layer = open_layer(BytesReadAt(blob), annotations=res.annotations)
    fetcher = ChunkFetcher(ChunkCache(tmp, max_bytes=1 << 20))
    reader = LayerReader(res.digest, layer, ReadAtSource(BytesReadAt(blob)), fetcher)
    return build_tree("k", base, reader)


def _ino(tree: LayerTree, path: str) -> int:
    ino = tree.root
    for part in path.split("/"):
        ino = tree.children[ino][part.encode()]
    return ino


def test_whiteouts_become_what_overlayfs_expects(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    var = _ino(t, "var")
    assert sorted(t.children[var]) == [b"cache", b"old"]
    old = t.entries[_ino(t, "var/old") - t.base]
    assert old.type == "char" and (old.dev_major, old.dev_minor) == (0, 0)
    cache = _ino(t, "var/cache")
    assert t.xattrs[cache][b"trusted.overlay.opaque"] == b"y"
    assert list(t.children[cache]) == [b"fresh"]
    assert not any(n.startswith(b".") for n in t.children[t.root])


def test_hardlinks_share_the_inode_and_count_links(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    tool, link = _ino(t, "usr/bin/tool"), _ino(t, "usr/bin/tool-link")
    assert tool == link
    assert t.nlink[tool - t.base] == 2
    bindir = _ino(t, "usr/bin")
    assert t.parents[tool - t.base] == bindir
    assert t.parents[bindir - t.base] == _ino(t, "usr")
    usr = _ino(t, "usr")
    assert t.nlink[usr - t.base] == 2 + 3          # bin, lib, share
    assert all(t.base <= ino < t.end for kids in t.children.values() for ino in kids.values())


def test_listing_is_sorted_and_complete(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    doc = _ino(t, "usr/share/doc")
    names = [n for n, _ in t.listing[doc]]
    assert names == sorted(names) and len(names) == 30
    assert t.total_size > 100_000
    e = t.entries[_ino(t, "usr/bin/sudo") - t.base]
    assert e.mode & stat.S_ISUID


@pytest.mark.parametrize("exc", [errors.IntegrityError("x"), errors.FailedPrecondition("y"),
                                 errors.DeadlineExceeded("z"), errors.NotFound("w")])
def test_errors_cross_the_socket_as_their_kind(exc: errors.ColdstartError) -> None:
    back = _error(error_payload(exc))
    assert type(back) is type(exc) and str(back) == str(exc)


def test_unknown_kinds_fall_back_to_their_nearest_known_base() -> None:
    class AuthError(errors.FailedPrecondition):
        pass

    back = _error(error_payload(AuthError("denied")))
    assert type(back) is errors.FailedPrecondition and str(back) == "denied"


def _tar(*members: tuple[str, bytes, dict[str, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, xattrs in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 1_700_000_000
            ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["estargz", "zstd:chunked"])
def test_a_layer_shows_xattrs_when_one_entry_has_one(tmp_path: Path, fmt: str) -> None:
    """What decides the FUSE connection a layer is served on: an attribute of any entry, an
    opaque directory, or a safetensors file (its token is an attribute) each need getxattr
    answered; a layer with none of them does not."""
    plain = ("usr/share/a.txt", b"a" * 100, {})
    cases = {
        "plain": ((plain,), False),
        "attribute": ((plain, ("usr/bin/ping", b"elf", {"security.capability": "x"})), True),
        "opaque": ((plain, ("var/cache/.wh..wh..opq", b"", {})), True),
        "whiteout only": ((plain, ("var/.wh.old", b"", {})), False),
        "safetensors": ((plain, ("models/m.safetensors", b"w" * 64, {})), True),
    }
    for i, (name, (members, shows)) in enumerate(cases.items()):
        t = _tree(tmp_path / str(i), tar=_tar(*members), fmt=fmt)
        assert t.shows_xattrs() is shows, name
        assert t.toc.entries.any_xattrs() is (name == "attribute"), name


def test_entries_built_already_know_their_attributes() -> None:
    with_x = Entry(name="a", type="reg", xattrs={"user.k": b"v"})
    assert TOCEntries.of({"a": with_x}).any_xattrs()
    assert not TOCEntries.of({"b": Entry(name="b", type="reg")}).any_xattrs()
