"""zstd frames: the one-shot path (size in the frame header) and the streaming path agree, and
both refuse what is truncated or not zstd, and cap what they produce."""

from __future__ import annotations

import os

import pytest
import zstandard

from coldstart.errors import FormatError
from coldstart.format.codec import unzstd_frame

DATA = os.urandom(1 << 16) + bytes(1 << 18) + b"tail"


def _sized() -> bytes:
    frame = zstandard.ZstdCompressor(level=3).compress(DATA)
    assert zstandard.frame_content_size(frame) == len(DATA)
    return frame


def _unsized() -> bytes:
    c = zstandard.ZstdCompressor(level=3).compressobj()
    frame = c.compress(DATA) + c.flush()
    assert zstandard.frame_content_size(frame) == -1
    return frame


@pytest.mark.parametrize("make", [_sized, _unsized])
def test_both_paths_decode_the_first_frame_only(make: object) -> None:
    frame = make()  # type: ignore[operator]
    assert unzstd_frame(frame, len(DATA), what="t") == (DATA, False)
    assert unzstd_frame(frame, len(DATA) + 100, what="t") == (DATA, False)
    if make is _sized:      # the one-shot path ignores what follows the frame
        assert unzstd_frame(frame + b"more", len(DATA) + 100, what="t")[0] == DATA


@pytest.mark.parametrize("make", [_sized, _unsized])
def test_output_is_capped_at_the_limit(make: object) -> None:
    out, more = unzstd_frame(make(), 1000, what="t")  # type: ignore[operator]
    assert out == DATA[:1000] and more


def test_truncated_sized_frame_is_a_format_error() -> None:
    # (flipped bits inside a block often still decode, and a truncated unsized frame comes
    # out short: zstd frames carry no checksum here, which is what the chunk digests and
    # the decoded-size check of the reader are for)
    frame = _sized()
    with pytest.raises(FormatError, match="chunk X"):
        unzstd_frame(frame[: len(frame) // 2], len(DATA), what="chunk X")


def test_not_a_frame_is_a_format_error() -> None:
    with pytest.raises(FormatError, match="corrupt zstd"):
        unzstd_frame(b"definitely not zstd", 100, what="t")
