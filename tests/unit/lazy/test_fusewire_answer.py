"""What a FUSE session writes for a read a worker answers (no mount needed: the session's
descriptor is a pipe): the bytes, or their pieces in order after one header."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any, cast

import pytest

from coldstart.lazyfs.fusewire import FuseSession, Later

_OUT = struct.Struct("<IiQ")     # fuse_out_header: len, error, unique
DATA = bytes(range(251)) * 40


@pytest.fixture
def session() -> Iterator[tuple[FuseSession, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    s = FuseSession(w, cast(Any, object()), read_threads=1)
    try:
        yield s, r
    finally:
        s.close(unmount=False)
        os.close(r)


def _answer(session: tuple[FuseSession, int], later: Later, unique: int = 7) -> bytes:
    s, r = session
    s._answer_later(unique, 2, later)
    msg = os.read(r, 1 << 20)
    size, err, got_unique = _OUT.unpack_from(msg)
    assert (size, err, got_unique) == (len(msg), 0, unique)
    return msg[_OUT.size:]


@pytest.mark.parametrize("step", [len(DATA), 1000, 97, 7])
def test_pieces_are_written_in_order_after_one_header(
        session: tuple[FuseSession, int], step: int) -> None:
    # views and bytes mixed; 7-byte pieces are more than one writev takes (joined first)
    view = memoryview(DATA)
    pieces = [view[i:i + step] if i // step % 2 else bytes(view[i:i + step])
              for i in range(0, len(DATA), step)]
    assert _answer(session, Later(lambda: pieces)) == DATA


def test_bytes_and_no_pieces(session: tuple[FuseSession, int]) -> None:
    assert _answer(session, Later(lambda: DATA)) == DATA
    assert _answer(session, Later(lambda: [])) == b""       # at or past the end: no bytes
    assert _answer(session, Later(lambda: memoryview(DATA)[5:9])) == DATA[5:9]
