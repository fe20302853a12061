"""Property: any tar tree survives both writers and the reader, byte for byte."""

from __future__ import annotations

import io
import tarfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.format.layers import FORMATS, add, assert_same_as_tar, convert

_seg = st.text(alphabet="abcé_-.", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
_path = st.lists(_seg, min_size=1, max_size=3).map("/".join)
_node = st.one_of(
    st.tuples(st.just("reg"), st.binary(max_size=20_000) | st.integers(0, 30_000).map(bytes)),
    st.tuples(st.just("dir"), st.none()),
    # (a NUL in a link name is refused, as Go's archive/tar does: test_fuzz_tar_input)
    st.tuples(st.just("symlink"), st.text(max_size=30).filter(lambda s: "\x00" not in s)),
    st.tuples(st.just("fifo"), st.none()),
    st.tuples(st.just("char"), st.tuples(st.integers(0, 255), st.integers(0, 255))),
    st.tuples(st.just("xattr"), st.dictionaries(st.sampled_from(["user.a", "user.b", "trusted.x"]),
                                                st.text(max_size=20), min_size=1)),
)


@st.composite
def trees(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    nodes = draw(st.dictionaries(_path, _node, min_size=1, max_size=12))
    buf = io.BytesIO()
    taken: set[str] = set()
    files: list[str] = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, (kind, value) in sorted(nodes.items()):
            # A path below a non-directory cannot exist in a file system.
            parents = path.split("/")[:-1]
            if any("/".join(parents[: i + 1]) in taken for i in range(len(parents))):
                continue
            mode = draw(st.sampled_from([0o644, 0o755, 0o4755, 0o600]))
            mtime = draw(st.integers(0, 2**33))
            if kind == "reg":
                assert isinstance(value, bytes)
                add(tf, path, value, mode=mode, mtime=mtime)
                taken.add(path)
                files.append(path)
            elif kind == "dir":
                add(tf, path, type=tarfile.DIRTYPE, mode=mode, mtime=mtime)
            elif kind == "symlink":
                assert isinstance(value, str)
                add(tf, path, type=tarfile.SYMTYPE, link=value, mtime=mtime)
                taken.add(path)
            elif kind == "char":
                assert isinstance(value, tuple)
                add(tf, path, type=tarfile.CHRTYPE, dev=value, mtime=mtime)
                taken.add(path)
            elif kind == "xattr":
                assert isinstance(value, dict)
                add(tf, path, b"x", xattrs=value, uid=draw(st.integers(0, 70000)))
                taken.add(path)
                link = draw(st.booleans())
                if link and files:
                    add(tf, path + ".hard", type=tarfile.LNKTYPE, link=files[-1])
                    taken.add(path + ".hard")
            else:
                add(tf, path, type=tarfile.FIFOTYPE, mtime=mtime)
                taken.add(path)
    prefetch = draw(st.lists(st.sampled_from(files), unique=True)) if files else []
    return buf.getvalue(), prefetch


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees(), fmt=st.sampled_from(FORMATS), chunk=st.sampled_from([4096, 16384]))
def test_random_trees_round_trip(tree: tuple[bytes, list[str]], fmt: str, chunk: int) -> None:
    tar, prefetch = tree
    c = convert(tar, fmt, chunk_size=chunk, threads=2, prefetch=prefetch or None)
    assert_same_as_tar(c.layer, tar)
    # Prefetched files come first, in the order asked (their parents may precede them).
    placed = [n for n in c.layer.toc.prefetch if n in prefetch]
    assert placed == prefetch
