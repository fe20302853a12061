"""A snapshot's bundle: CRIU's files packed into a seekable layer with pages cut by content,
and written back chunk by chunk, each verified, through a chunk cache; the rootfs changes
taken from an overlay's upper directory and put back into a mounted root, and taken out
again."""

from __future__ import annotations

import io
import os
import random
import subprocess
import tarfile
from pathlib import Path

import pytest

from coldstart.cache.chunks import ChunkCache
from coldstart.errors import FormatError, IntegrityError
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.snapshot.bundle import PAGE, Packed, Unpacked, materialize, pack
from coldstart.snapshot.rootdiff import apply, capture, upper_dir

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


def _pages(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(PAGE // 2) + bytes(PAGE // 2) for _ in range(n)]


def _criu_dir(root: Path, pages: list[bytes], *, extra: bytes = b"core") -> Path:
    root.mkdir(parents=True)
    (root / "inventory.img").write_bytes(b"inventory")
    (root / "core-1.img").write_bytes(extra)
    (root / "pages-1.img").write_bytes(b"".join(pages))
    (root / "dump.log").write_text("not shipped")
    return root


def _packed(tmp: Path, criu: Path, rootfs: Path | None = None,
            touched: Path | None = None) -> tuple[Packed, bytes]:
    buf = io.BytesIO()
    packed = pack(criu, buf, rootfs_tar=rootfs, touched=touched)
    return packed, buf.getvalue()


def test_a_bundle_comes_back_byte_for_byte_and_the_second_time_from_the_cache(
        tmp_path: Path) -> None:
    rng = random.Random(1)
    criu = _criu_dir(tmp_path / "criu", _pages(rng, 700))
    rootfs = tmp_path / "rootfs.tar"
    rootfs.write_bytes(b"tar bytes")
    packed, blob = _packed(tmp_path, criu, rootfs)
    layer = open_layer(BytesReadAt(blob), annotations=packed.layer.annotations)
    assert "criu/dump.log" not in layer.toc.entries      # logs stay on the node
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    try:
        first = materialize(layer, tmp_path / "out1", cache)
        cache.flush()
        second = materialize(layer, tmp_path / "out2", cache)
    finally:
        cache.close()
    for out in ("out1", "out2"):
        for name in ("inventory.img", "core-1.img", "pages-1.img"):
            assert (tmp_path / out / name).read_bytes() == (criu / name).read_bytes()
        assert not (tmp_path / out / "dump.log").exists()
    assert first.rootfs == second.rootfs == b"tar bytes"
    assert first.chunks_fetched > 3 and first.chunks_cached == 0
    assert second.chunks_fetched == 0 and second.chunks_cached == first.chunks_fetched


def test_pages_shifted_by_a_new_version_are_cut_into_the_same_chunks(tmp_path: Path) -> None:
    """The second snapshot holds the first's pages behind 37 new ones (another app layer's
    heap, say): most of its chunks are the first's, which a node already has."""
    rng = random.Random(2)
    pages = _pages(rng, 2000)
    a, blob_a = _packed(tmp_path, _criu_dir(tmp_path / "a", pages))
    b, blob_b = _packed(tmp_path, _criu_dir(tmp_path / "b", _pages(rng, 37) + pages))
    la = open_layer(BytesReadAt(blob_a), annotations=a.layer.annotations)
    lb = open_layer(BytesReadAt(blob_b), annotations=b.layer.annotations)
    da = {c.digest for c in la.resolve("criu/pages-1.img").chunks}
    db = [c.digest for c in lb.resolve("criu/pages-1.img").chunks]
    shared = sum(1 for d in db if d in da)
    assert len(db) > 20 and shared >= 0.8 * len(db), (shared, len(db))


def test_a_flipped_byte_fails_its_chunk_and_nothing_of_it_is_cached(tmp_path: Path) -> None:
    rng = random.Random(3)
    criu = _criu_dir(tmp_path / "criu", _pages(rng, 300))
    packed, blob = _packed(tmp_path, criu)
    layer = open_layer(BytesReadAt(blob), annotations=packed.layer.annotations)
    chunk = layer.resolve("criu/pages-1.img").chunks[1]
    bad = bytearray(blob)
    bad[(chunk.offset + chunk.end_offset) // 2] ^= 0x40
    lay = open_layer(BytesReadAt(bytes(bad)), annotations=packed.layer.annotations)
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    try:
        with pytest.raises((IntegrityError, FormatError)):
            materialize(lay, tmp_path / "out", cache, into=Unpacked())
        cache.flush()
        assert not cache.contains(chunk.digest)
    finally:
        cache.close()


def test_a_bundle_with_an_entry_outside_criu_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    from coldstart.format.writer import convert_layer

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("criu/inventory.img", "etc/passwd"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    raw.seek(0)
    out = io.BytesIO()
    res = convert_layer(raw, out, format="zstd:chunked")
    layer = open_layer(BytesReadAt(out.getvalue()), annotations=res.annotations)
    with pytest.raises(FormatError, match="etc/passwd"):
        materialize(layer, tmp_path / "out", None)
    assert not (tmp_path / "out").exists()


def _overlay(lower: Path, upper: Path, work: Path, merged: Path) -> None:
    for d in (upper, work, merged):
        d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)],
                   check=True)


def _view(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel.startswith(".coldstart-restore-"):
                continue
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", p.stat().st_mode & 0o7777)
            else:
                out[rel] = ("file", p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


@needs_root
def test_rootfs_changes_travel_and_a_failed_restore_takes_them_back(tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "keep").write_text("keep")
    (lower / "etc" / "changed").write_text("old")
    (lower / "etc" / "gone").write_text("deleted by the app")
    (lower / "cache").mkdir()
    (lower / "cache" / "stale").write_text("hidden by an opaque directory")
    src_upper, dst_upper = tmp_path / "u1", tmp_path / "u2"
    src, dst = tmp_path / "m1", tmp_path / "m2"
    _overlay(lower, src_upper, tmp_path / "w1", src)
    _overlay(lower, dst_upper, tmp_path / "w2", dst)
    try:
        # what an app does to its root before the checkpoint
        (src / "tmp").mkdir()
        (src / "tmp" / "x").write_text("state")
        os.chmod(src / "tmp" / "x", 0o600)
        (src / "etc" / "changed").write_text("new")
        (src / "etc" / "gone").unlink()
        subprocess.run(["rm", "-rf", str(src / "cache")], check=True)
        (src / "cache").mkdir()
        (src / "cache" / "fresh").write_text("fresh")
        (src / "tmp" / "link").symlink_to("x")
        assert upper_dir([("overlay", [f"lowerdir={lower}", f"upperdir={src_upper}"])]) == \
            src_upper
        tar = io.BytesIO()
        assert capture(src_upper, tar) > 0
        before = _view(dst)
        done = apply(tar.getvalue(), dst)
        assert _view(dst) == _view(src)
        assert done.undo() == []
        assert _view(dst) == before
        done = apply(tar.getvalue(), dst)           # again, and this time it stays
        done.drop()
        assert _view(dst) == _view(src)
        assert not any(p.name.startswith(".coldstart-restore-") for p in dst.iterdir())
    finally:
        subprocess.run(["umount", str(src)], check=False)
        subprocess.run(["umount", str(dst)], check=False)


@needs_root
def test_rootfs_changes_that_escape_the_root_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "lib").symlink_to("/")                  # the image's own symlink, absolute
    outside = tmp_path / "outside"
    for name in ("../outside", "lib/tmp/pwned"):
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as t:
            info = tarfile.TarInfo(name)
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
        with pytest.raises(FormatError):
            apply(raw.getvalue(), root)
    assert not outside.exists() and not Path("/tmp/pwned").exists()
    assert sorted(p.name for p in root.iterdir()) == ["etc", "lib"]


@needs_root
def test_rootfs_changes_the_journal_could_not_take_back_are_refused(tmp_path: Path) -> None:
    """An entry twice, or a whiteout of an entry written before it: undo could then put the
    snapshot's file back in the root of the normal start that follows."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)

    def tar_of(*names: str) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as t:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = 1
                t.addfile(info, io.BytesIO(b"x"))
        return raw.getvalue()

    for names in (("etc/a", "etc/a"), ("etc/a", "etc/.wh.a"), ("etc/.wh.")):
        with pytest.raises(FormatError):
            apply(tar_of(*names) if isinstance(names, tuple) else tar_of(names), root)
        assert sorted(p.name for p in (root / "etc").iterdir()) == []


def test_the_touched_list_rides_first_and_a_deferred_cache_is_filled_from_the_files(
        tmp_path: Path) -> None:
    from coldstart.snapshot.bundle import TOUCHED, cache_later

    rng = random.Random(4)
    criu = _criu_dir(tmp_path / "criu", _pages(rng, 400))
    touched = tmp_path / "touched.json"
    touched.write_bytes(b'{"files":[{"path":"/usr/lib/libc.so.6","ranges":[[0,4096]]}]}')
    packed, blob = _packed(tmp_path, criu, touched=touched)
    layer = open_layer(BytesReadAt(blob), annotations=packed.layer.annotations)
    assert next(iter(layer.toc.entries)).lstrip("./") == TOUCHED   # read before the pages
    assert layer.read_file(TOUCHED) == touched.read_bytes()
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    try:
        out = materialize(layer, tmp_path / "out", cache, defer_cache=True)
        assert not (tmp_path / "out" / TOUCHED).exists()           # not CRIU's
        cache.flush()
        assert out.chunks_fetched > 3 and out.uncached
        assert not any(cache.contains(d) for d, *_ in out.uncached)  # nothing cached yet
        assert cache_later(tmp_path / "out", out.uncached, cache) == \
            sum(size for *_, size in out.uncached)
        cache.flush()
        again = materialize(layer, tmp_path / "out2", cache)
    finally:
        cache.close()
    assert again.chunks_fetched == 0 and again.chunks_cached == out.chunks_fetched
    assert (tmp_path / "out2" / "pages-1.img").read_bytes() == (criu / "pages-1.img").read_bytes()
