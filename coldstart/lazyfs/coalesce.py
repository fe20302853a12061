"""Planning range requests: which chunks share one request.

A fetch of missing chunks becomes as few range requests as their layout allows. :func:`coalesce`
groups chunks whose compressed ranges touch (or lie at most a gap apart: the tar header frames
between two files' data) into runs, one request each, of a bounded size; :func:`pack_runs` packs
consecutive runs into one multi-range request each, for a source that reads several ranges at
once (a registry answering an HTTP multi-range GET). Pure functions of the chunks: the
:class:`~coldstart.lazyfs.fetcher.ChunkFetcher` plans every request with them, and owns the
requests themselves (single flight, pools, decoding, verifying).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from coldstart.format.toc import Chunk
from coldstart.remote import coalesce as coalesce_ranges

__all__ = ["MAX_GAP", "MULTI_BYTES", "MULTI_PARTS", "coalesce", "pack_runs"]

#: Missing chunks this close in the blob share a request (the gap is fetched and dropped):
#: between two small files lie only their tar header frames.
MAX_GAP = 32 << 10
#: A prefetch from a source that reads several ranges in one request (an HTTP multi-range
#: GET) asks the runs of its chunks ``MAX_GAP`` apart in requests of up to this many
#: compressed bytes and ``MULTI_PARTS`` ranges: the untouched bytes between the runs are not
#: sent, and the requests are few.
MULTI_BYTES = 16 << 20
MULTI_PARTS = 32


def coalesce(chunks: Iterable[Chunk], max_bytes: int, max_gap: int = 0) -> list[list[Chunk]]:
    """Group chunks into runs fetched by one range request each, each ≤ ``max_bytes``.

    Chunks whose compressed ranges touch (or are at most ``max_gap`` bytes apart: the tar
    header frames between two files' data) share a run. Chunks sharing one gzip member
    (eStargz small files) share its range. The byte ranges are merged by
    :func:`coldstart.remote.coalesce` (the one range coalescer); each chunk then joins the run
    that holds its range.

    >>> a = Chunk(0, 10, 0, 5, "d1"); b = Chunk(10, 20, 0, 5, "d2"); c = Chunk(30, 40, 0, 5, "d3")
    >>> [[x.offset for x in g] for g in coalesce([c, a, b], 100)]
    [[0, 10], [30]]
    >>> [[x.offset for x in g] for g in coalesce([c, a, b], 100, max_gap=10)]
    [[0, 10, 30]]
    """
    ordered = sorted(chunks, key=lambda c: (c.offset, c.inner_offset))
    runs = coalesce_ranges([(c.offset, c.compressed_size) for c in ordered], max_gap, max_bytes)
    starts = [off for off, _ in runs]
    groups: list[list[Chunk]] = [[] for _ in runs]
    strays: list[list[Chunk]] = []
    for c in ordered:
        # the last run starting at or before the chunk: ranges are merged in this order, so
        # it is the run that took the chunk's range (or one at the same offset holding it)
        i = bisect.bisect_right(starts, c.offset) - 1
        if i >= 0 and c.end_offset <= runs[i][0] + runs[i][1]:
            groups[i].append(c)
        else:   # an empty range, which the range coalescer drops: a request of its own
            strays.append([c])
    out = [g for g in groups if g] + strays
    if strays:
        out.sort(key=lambda g: (g[0].offset, g[0].inner_offset))
    return out


def pack_runs(runs: list[list[Chunk]], max_bytes: int, max_parts: int) -> list[list[list[Chunk]]]:
    """Consecutive runs (from :func:`coalesce`, in blob order) packed into requests of up to
    ``max_bytes`` compressed bytes and ``max_parts`` runs each; a larger run goes alone.

    >>> runs = [[Chunk(0, 10, 0, 5, "a")], [Chunk(50, 60, 0, 5, "b")], [Chunk(90, 99, 0, 5, "c")]]
    >>> [[[c.offset for c in r] for r in p] for p in pack_runs(runs, 20, 8)]
    [[[0], [50]], [[90]]]
    """
    packs: list[list[list[Chunk]]] = []
    size = 0
    for run in runs:
        n = max(c.end_offset for c in run) - run[0].offset
        # (an empty range, a stray of coalesce's, goes alone: a multi-range request names
        # no empty range)
        if packs and n > 0 and size > 0 and len(packs[-1]) < max_parts \
                and size + n <= max_bytes:
            packs[-1].append(run)
            size += n
        else:
            packs.append([run])
            size = n
    return packs
