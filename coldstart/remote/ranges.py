"""Byte ranges: the one ``coalesce`` (fewer, larger range requests)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["coalesce"]


def coalesce(ranges: Sequence[tuple[int, int]], max_gap: int,
             max_length: int | None = None) -> list[tuple[int, int]]:
    """Merge ``(offset, length)`` ranges whose gap is at most ``max_gap``; sorted by offset.

    A merge that would make one request longer than ``max_length`` is not done (a single range
    longer than that stays as it is).

    >>> coalesce([(0, 10), (12, 4), (100, 1)], max_gap=2)
    [(0, 16), (100, 1)]
    """
    out: list[tuple[int, int]] = []
    for off, length in sorted(r for r in ranges if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1] + max_gap:
            start = out[-1][0]
            merged = max(out[-1][0] + out[-1][1], off + length) - start
            if max_length is None or merged <= max_length or off + length <= start + out[-1][1]:
                out[-1] = (start, merged)
                continue
        out.append((off, length))
    return out
