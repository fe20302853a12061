"""Which parts of a layer's prefetch span a start-up touched: a layer annotation.

The files before a layer's prefetch landmark are whole files; a start-up often touches only
some chunks of its big ones (a library ``mmap``'d and faulted in page by page). ``coldstart
optimize`` therefore also writes, on each layer it reorders, the compressed byte ranges of the
chunks the recording touched, as the annotation :data:`PREFETCH_RANGES_ANNOTATION`. Its key
starts with ``containerd.io/snapshot/``, so containerd hands it to the snapshotter as a label
(CRI pulls included); it fits one label (:data:`MAX_TEXT`). The FUSE server then prefetches only
those chunks of the span. Other tools ignore it; without it the whole span is prefetched.

Text form: ``v1:`` then ``START+LENGTH`` pairs in hex, comma-separated, sorted, disjoint.

>>> text = encode_ranges([(0, 4096), (8192, 12288)])
>>> text, decode_ranges(text)
('v1:0+1000,2000+1000', [(0, 4096), (8192, 12288)])
>>> encode_ranges([(0, 10), (20, 30), (1000, 1010)], max_text=15)   # gaps merged to fit
'v1:0+1e,3e8+a'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from coldstart.errors import InvalidArgument

if TYPE_CHECKING:
    from coldstart.format.toc import TOC
    from coldstart.prefetch.recorder import FileAccess

__all__ = ["CUT_ALIGN", "CUT_GAP", "MAX_TEXT", "OVERFETCH", "PREFETCH_RANGES_ANNOTATION",
           "chunk_cuts", "decode_ranges", "encode_ranges", "merge_gaps", "touched_ranges"]

PREFETCH_RANGES_ANNOTATION = "containerd.io/snapshot/coldstart.prefetch-ranges"
#: the ranges of a layer's start-up set may name up to this much more than the touched chunks,
#: to close the gaps between them. None by default: the prefetch joins the ranges itself, as
#: the registry suits (several ranges to a request where it answers multi-range requests, the
#: bytes between them left out; else ranges less than ``PREFETCH_GAP`` apart in one), which
#: an image written once cannot know
OVERFETCH = 0.0
#: containerd limits a label's key + value to 4096 bytes
MAX_TEXT = 4096 - len(PREFETCH_RANGES_ANNOTATION) - 16
_PREFIX = "v1:"
#: parts of a file a start-up read that lie closer than this are one part to the writer's
#: chunking (cutting the few pages between them out saves less decoding than a chunk costs)
CUT_GAP = 256 << 10
#: cuts lie on this boundary: the largest page size of a Linux node (arm64 with 64 KiB
#: pages), so that a chunk's edges are page edges on every node (the page cache is handed
#: whole pages only)
CUT_ALIGN = 64 << 10


def _union(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-empty ``ranges`` sorted, the overlapping or touching ones merged."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _close(merged: list[tuple[int, int]], gaps: set[int]) -> list[tuple[int, int]]:
    """``merged`` with gap ``i`` (between ranges ``i`` and ``i + 1``) closed for each in
    ``gaps``."""
    out: list[tuple[int, int]] = []
    for i, r in enumerate(merged):
        if out and i - 1 in gaps:
            out[-1] = (out[-1][0], r[1])
        else:
            out.append(r)
    return out


def _by_gap(merged: list[tuple[int, int]]) -> list[int]:
    """The gaps of ``merged``, smallest first."""
    return sorted(range(len(merged) - 1), key=lambda i: merged[i + 1][0] - merged[i][1])


def merge_gaps(ranges: Iterable[tuple[int, int]], waste: float) -> list[tuple[int, int]]:
    """Sorted, disjoint ``ranges`` with the smallest gaps between them closed, as long as the
    bytes added stay within ``waste`` times the bytes of the ranges: fewer, larger requests
    for a bounded overfetch.

    >>> merge_gaps([(0, 100), (110, 200), (1000, 1100)], 0.1)
    [(0, 200), (1000, 1100)]
    """
    merged = _union(ranges)
    budget = waste * sum(b - a for a, b in merged)
    close: set[int] = set()
    for i in _by_gap(merged):
        gap = merged[i + 1][0] - merged[i][1]
        if gap > budget:
            break
        budget -= gap
        close.add(i)
    return _close(merged, close)


def _text(ranges: list[tuple[int, int]]) -> str:
    return _PREFIX + ",".join(f"{a:x}+{b - a:x}" for a, b in ranges)


def encode_ranges(ranges: Iterable[tuple[int, int]], *, max_text: int = MAX_TEXT) -> str:
    """``[start, end)`` ranges as the annotation's text; the closest ones are merged (more is
    then prefetched, never less) until it is at most ``max_text`` characters."""
    merged = _union(ranges)
    while len(merged) > 1 and len(_text(merged)) > max_text:
        # close the smallest gaps, an eighth of them a pass
        merged = _close(merged, set(_by_gap(merged)[:max(1, len(merged) // 8)]))
    return _text(merged)


def decode_ranges(text: str) -> list[tuple[int, int]]:
    """The ranges of an annotation's text; InvalidArgument if it is malformed."""
    if not text.startswith(_PREFIX):
        raise InvalidArgument(f"prefetch ranges: unknown form {text[:16]!r}")
    out: list[tuple[int, int]] = []
    body = text[len(_PREFIX):]
    for part in body.split(",") if body else []:
        start, sep, length = part.partition("+")
        try:
            a, n = int(start, 16), int(length, 16)
        except ValueError:
            raise InvalidArgument(f"prefetch ranges: bad pair {part[:32]!r}") from None
        if not sep or a < 0 or n <= 0 or (out and a < out[-1][1]):
            raise InvalidArgument(f"prefetch ranges: bad or unsorted pair {part[:32]!r}")
        out.append((a, a + n))
    return out


def touched_ranges(toc: TOC, files: Iterable[FileAccess], *,
                   overfetch: float = OVERFETCH) -> list[tuple[int, int]]:
    """The compressed ranges ``[start, end)`` of the chunks of ``toc``'s layer that the
    recorded ``files`` touched (every chunk of a file recorded without ranges), the closest
    merged while that adds at most ``overfetch`` times their bytes (fewer requests where the
    prefetch asks for whole ranges; 0: only touching ranges merge); files the layer does not
    hold as regular files are skipped."""
    out: list[tuple[int, int]] = []
    for f in files:
        e = toc.entries.get(f.path)
        if e is None or e.type != "reg":
            continue
        for c in e.chunks:
            if c.zeros:
                continue
            if not f.ranges or any(a < c.chunk_offset + c.chunk_size and b > c.chunk_offset
                                   for a, b in f.ranges):
                out.append((c.offset, c.end_offset))
    return merge_gaps(out, overfetch)


def chunk_cuts(files: Iterable[FileAccess], *, gap: int = CUT_GAP) -> dict[str, list[int]]:
    """Where a profiled layer's writer also starts a chunk, per recorded file (see
    :func:`coldstart.format.writer.chunk_starts`): at both edges of each part the start-up
    read, widened to ``CUT_ALIGN``, parts less than ``gap`` apart taken as one. A start-up
    that reads a tenth of a large library then finds those pages in chunks of their own: the
    prefetch fetches and decodes them and not the rest of fixed-size chunks they would share.
    A file recorded without ranges (read whole) gets none.

    >>> from coldstart.prefetch.recorder import FileAccess
    >>> read = [(70_000, 80_000), (300_000, 400_000), (900_000, 901_000)]
    >>> chunk_cuts([FileAccess("lib.so", 0.0, read)])
    {'lib.so': [65536, 458752, 851968, 917504]}
    """
    out: dict[str, list[int]] = {}
    for f in files:
        parts: list[tuple[int, int]] = []
        for a, b in _union(f.ranges):
            if parts and a - parts[-1][1] < gap:
                parts[-1] = (parts[-1][0], b)
            else:
                parts.append((a, b))
        cuts = sorted({x for a, b in parts
                       for x in (a - a % CUT_ALIGN, b + -b % CUT_ALIGN)} - {0})
        if cuts:
            out[f.path] = cuts
    return out
