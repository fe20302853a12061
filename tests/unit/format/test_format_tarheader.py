"""coldstart.format.tarheader: a header block parsed as tarfile parses it, or left to tarfile.

The property: for any 512-byte block, :func:`parse_block` either answers None or the TarInfo
tarfile's own ``frombuf`` gives, field for field; where tarfile refuses the block, it answers
None. Checked on the headers tarfile writes in its three formats and on random mutations of
them."""

from __future__ import annotations

import random
import tarfile

import pytest

from coldstart.format.tarheader import parse_block

_FIELDS = ("name", "mode", "uid", "gid", "size", "mtime", "chksum", "type", "linkname",
           "uname", "gname", "devmajor", "devminor")


def _infos() -> list[tarfile.TarInfo]:
    out = []
    for name, kind, extra in [
        ("etc/passwd", tarfile.REGTYPE, {}),
        ("usr/lib/" + "d" * 120 + "/libx.so", tarfile.REGTYPE, {}),    # a ustar prefix
        ("x" * 150, tarfile.REGTYPE, {}),                             # too long for ustar
        ("usr/share/", tarfile.DIRTYPE, {}),
        ("bin/sh", tarfile.SYMTYPE, {"linkname": "busybox"}),
        ("bin/ls", tarfile.LNKTYPE, {"linkname": "bin/busybox"}),
        ("dev/null", tarfile.CHRTYPE, {"devmajor": 1, "devminor": 3}),
        ("dev/sda", tarfile.BLKTYPE, {"devmajor": 8, "devminor": 0}),
        ("run/fifo", tarfile.FIFOTYPE, {}),
        ("naïve/ünïcode", tarfile.REGTYPE, {"uname": "jörg"}),
        ("big", tarfile.REGTYPE, {"uid": 1 << 30, "size": 1 << 40}),   # base-256 in GNU
        ("old", tarfile.REGTYPE, {"mtime": -5}),
    ]:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = 0o4755 if kind == tarfile.REGTYPE else 0o755
        info.uid, info.gid, info.mtime = 1000, 1000, 1_700_000_000
        for k, v in extra.items():
            setattr(info, k, v)
        out.append(info)
    return out


def _blocks() -> list[bytes]:
    blocks = []
    for info in _infos():
        for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
            try:
                data = info.tobuf(fmt, "utf-8", "surrogateescape")
            except ValueError:           # what the format cannot hold
                continue
            # every header block of the member (PAX/GNU extensions and the member's own)
            for i in range(0, len(data), tarfile.BLOCKSIZE):
                block = data[i:i + tarfile.BLOCKSIZE]
                if len(block) == tarfile.BLOCKSIZE and any(block):
                    blocks.append(block)
    # a V7 directory: a regular file whose name ends with a slash
    v7 = tarfile.TarInfo("var/")
    v7.type = tarfile.AREGTYPE
    blocks.append(v7.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
    return blocks


def _stock(block: bytes) -> tarfile.TarInfo | None:
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None


def _same(got: tarfile.TarInfo, want: tarfile.TarInfo) -> None:
    for f in _FIELDS:
        assert getattr(got, f) == getattr(want, f), f
    assert got.pax_headers == want.pax_headers and got.sparse == want.sparse


def test_headers_tarfile_writes_parse_as_tarfile_parses_them() -> None:
    blocks = _blocks()
    fast = headers = 0
    for block in blocks:
        want = _stock(block)       # None: a block of a long name or PAX records
        got = parse_block(tarfile.TarInfo, block, "utf-8", "surrogateescape")
        headers += want is not None
        if got is not None:
            assert want is not None
            _same(got, want)
            fast += 1
    # the common blocks take the fast path (not all: base-256 numbers go to tarfile)
    assert headers > 30 and fast >= headers * 3 // 4


def test_a_mutated_block_is_parsed_as_tarfile_does_or_left_to_it() -> None:
    rng = random.Random(7)
    blocks = _blocks()
    taken = refused = 0
    for _ in range(20000):
        block = bytearray(rng.choice(blocks))
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(512)
            block[pos] = rng.choice([0, 0x20, 0x30 + rng.randrange(10), 0x80, 0xFF,
                                     rng.randrange(256)])
        if rng.random() < 0.5:        # a checksum fixed up to the unsigned sum
            block[148:156] = b" " * 8
            block[148:156] = b"%06o\0 " % sum(block)
        want = _stock(bytes(block))
        got = parse_block(tarfile.TarInfo, bytes(block), "utf-8", "surrogateescape")
        if got is None:
            refused += want is None
            continue
        assert want is not None, bytes(block)
        _same(got, want)
        taken += 1
    assert taken > 5000 and refused > 1000


@pytest.mark.parametrize("block", [b"", b"\0" * 512, b"x" * 100], ids=["empty", "zeros",
                                                                        "short"])
def test_blocks_tarfile_refuses_are_left_to_it(block: bytes) -> None:
    assert parse_block(tarfile.TarInfo, block, "utf-8", "strict") is None
