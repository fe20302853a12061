"""Fetching chunks of lazily mounted layers: range sources, coalescing, single-flight, a pool.

A :class:`ChunkFetcher` is shared by every layer the FUSE server mounts. A read's one call is
:meth:`ChunkFetcher.get`: per chunk, cached → its bytes, in flight → join, else fetch. To fetch,
it merges adjacent chunks into one range request (up to ``max_coalesce_bytes``), makes sure each
chunk is fetched by one request at a time however many readers want it (keyed by the chunk's
content digest, so identical chunks of two layers are fetched once), runs the requests in a
bounded thread pool, decodes and verifies each chunk (``SeekableLayer.decode_chunk``), stores the
good ones in the chunk cache, and resolves one :class:`~concurrent.futures.Future` per chunk.
A chunk whose bytes fail to decode or verify is fetched once more (``REFETCHES``: a bit flipped
on the wire is transient, and the registry client's retries never see it, the response being a
good one as far as HTTP goes); if it fails again it resolves with :class:`IntegrityError` (or
the decoder's :class:`FormatError`). Unverified bytes are never served or cached.

Background work (the fill; the deferred spread of the spans an indexed gzip layer's prefetch
inflated only in part) run in niced threads of their own and wait while on-demand fetches are in
flight, so it never delays a read that a process is blocked on.

What the fetcher is handed and reports through is in :mod:`~coldstart.lazyfs.target` (the layer
as a :class:`~coldstart.lazyfs.target.FetchTarget`, its
:class:`~coldstart.lazyfs.target.LayerStats`, the :class:`~coldstart.lazyfs.target.FetchTelemetry`
hooks); which chunks share a request is planned by :mod:`~coldstart.lazyfs.coalesce`. Here: the
in-flight table (one ``_Flight`` per chunk being fetched, joined by every other caller that wants
it), the pools, the requests themselves, decoding, verifying, caching, and the deferred spreads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from coldstart.cache import ChunkStore
from coldstart.config import FetchConfig
from coldstart.errors import ColdstartError, DeadlineExceeded, FormatError, Unavailable
from coldstart.format.toc import Chunk
from coldstart.lazyfs.coalesce import MAX_GAP, MULTI_BYTES, MULTI_PARTS, coalesce, pack_runs
from coldstart.lazyfs.target import DEMAND, PREFETCH, FetchTarget, FetchTelemetry
from coldstart.remote.source import ManyRangeSource, read_many

__all__ = ["QUIET_SECONDS", "ChunkFetcher", "Span", "lower_priority"]

log = logging.getLogger(__name__)

#: the fetch defaults, from the one config tree (CONVENTIONS §9)
_DEFAULTS = FetchConfig()

#: Times a chunk whose fetched bytes fail to decode or verify is fetched again (in a request of
#: its own, bounded by ``request_timeout`` like any): more would only delay a read's EIO when
#: the registry itself holds wrong bytes.
REFETCHES = 1
#: niceness of the background fill's thread: the start-up's processes get the CPU first
FILL_NICENESS = 19
#: the fill sends nothing until no FUSE read was served for this long
QUIET_SECONDS = 0.25
#: A start-up prefetch set of this many compressed bytes or more (a checkpoint's) waits while
#: smaller sets are prefetched on the node, at most ``BIG_PREFETCH_WAIT`` seconds
BIG_PREFETCH = 256 << 20
BIG_PREFETCH_WAIT = 30.0
#: A prefetched chunk the page cache gets waits for the cache's writer encoded (and is decoded
#: and verified again there) only if that holds at most this fraction of its decoded bytes: a
#: start-up's code compresses to a third or less, and keeping it encoded saves the memory;
#: weights compress to about 0.8, where the second decode costs the CPU (1.3 s per GB here:
#: zstd and sha256 again) and saves little memory (issue 49, the server image's profile mode)
KEEP_ENCODED_RATIO = 0.5
#: compressed bytes of prefetched spans held node-wide for a deferred spread (an indexed gzip
#: layer's: the prefetch inflates a span only as far as the start-up's pieces reach and caches
#: the span's other files later, when the node is quiet); past it a span is spread at once
DEFERRED_SPREAD_BYTES = 256 << 20


def _key(target: FetchTarget, c: Chunk) -> str:
    if c.digest:
        return c.digest
    return f"{target.digest}@{c.offset}+{c.inner_offset}"


class _Flight:
    """One chunk being fetched (or looked up): its future, and how many callers other than
    its owner hold that future (the owner resolves it only if someone does)."""

    __slots__ = ("future", "joiners", "unread", "urgent")

    def __init__(self, *, unread: bool = False) -> None:
        self.future: Future[bytes] = Future()
        self.joiners = 0
        # a read (or prefetch) joined it: a fill request holding it must not wait any more
        self.urgent = False
        # its requester hands it to the page cache, and no read waits for it (yet): the
        # chunk cache may keep it encoded until it is written (see _cache_decoded)
        self.unread = unread


#: a read's chunk: (chunk, start, end) of the bytes it needs within the decoded chunk
Span = tuple[Chunk, int, int]


class ChunkFetcher:
    """Node-wide single-flight chunk fetching with a bounded pool; see the module docstring.

    Defaults come from :class:`coldstart.config.FetchConfig` (written once, there).
    """

    def __init__(self, cache: ChunkStore | None, *,
                 concurrency: int = _DEFAULTS.concurrency,
                 max_coalesce_bytes: int = _DEFAULTS.max_coalesce_bytes,
                 request_timeout: float = _DEFAULTS.request_timeout,
                 max_gap: int = MAX_GAP, telemetry: FetchTelemetry | None = None) -> None:
        self.cache = cache
        self.max_coalesce_bytes = max(1, max_coalesce_bytes)
        self.max_gap = max(0, max_gap)
        self.request_timeout = request_timeout
        self.telemetry = telemetry
        self.pool_size = max(1, concurrency)
        # (a pool thread may be started from a niced fill thread: it resets its priority)
        self._pool = ThreadPoolExecutor(self.pool_size, thread_name_prefix="fetch",
                                        initializer=_normal_priority)
        self._bg_pool = ThreadPoolExecutor(1, thread_name_prefix="fill",
                                           initializer=lower_priority)
        # deferred spreads (:meth:`_defer_spread`) apart from the fill's requests: a read that
        # joins a fill request waits for that one, not for the spreads queued before it
        self._spread_pool = ThreadPoolExecutor(1, thread_name_prefix="spread",
                                               initializer=lower_priority)
        # plans read-ahead off the FUSE loop (choosing chunks and asking the cache about them)
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="plan",
                                           initializer=_normal_priority)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight: dict[str, _Flight] = {}
        self._foreground = 0
        self._prefetching = 0       # prefetch requests queued or running, node-wide
        self._small_sets = 0        # start-up prefetches of small sets running, node-wide
        self._deferred = 0          # compressed bytes held for deferred spreads
        self._closed = False
        self.last_read = 0.0       # monotonic time of the last FUSE read served
        self.held_until = 0.0      # monotonic time until which the node counts as busy (hold)
        # held by the one big file being streamed whole on the node (streams.SequentialReads)
        self.stream_slot = threading.Semaphore(1)

    def close(self) -> None:
        """Stop taking work; running requests finish (bounded by their timeouts)."""
        with self._lock:
            self._closed = True
            self._deferred = 0      # the spreads not started are cancelled with their bytes
            self._idle.notify_all()
        self._bg_pool.shutdown(wait=False, cancel_futures=True)
        self._spread_pool.shutdown(wait=False, cancel_futures=True)
        self._planner.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def plan(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (which usually calls :meth:`request`) in the planner thread."""
        try:
            self._planner.submit(fn)
        except RuntimeError:  # shutting down
            pass

    def wait_prefetch_room(self, limit: int, timeout: float) -> None:
        """Block (the caller's own thread, never a pool thread) while ``limit`` prefetch
        requests are queued or running on the node, so that reads always find free threads
        in the pool; gives up waiting after ``timeout`` seconds."""
        self._wait_while(lambda: self._prefetching >= max(1, limit),
                         time.monotonic() + timeout)

    def _wait_while(self, busy: Callable[[], bool], until: float) -> None:
        """Block while ``busy()`` (called under the lock, at least every 0.5 s) and the
        fetcher is open, until monotonic ``until`` at most."""
        with self._lock:
            while busy() and not self._closed:
                left = until - time.monotonic()
                if left <= 0:
                    return
                self._idle.wait(min(left, 0.5))

    @contextlib.contextmanager
    def prefetching(self, nbytes: int) -> Iterator[bool]:
        """A layer's start-up prefetch of ``nbytes`` compressed bytes runs in this block;
        yields whether its set is big (``BIG_PREFETCH`` or more: a checkpoint, not code).
        While a small one runs, a big one waits before each request
        (:meth:`wait_small_prefetches`)."""
        small = nbytes < BIG_PREFETCH
        if small:
            with self._lock:
                self._small_sets += 1
        try:
            yield not small
        finally:
            if small:
                with self._lock:
                    self._small_sets -= 1
                    self._idle.notify_all()

    def wait_small_prefetches(self, until: float,
                              stop: threading.Event | None = None) -> None:
        """Block (a prefetch's own thread) while small start-up sets are being prefetched on
        the node, until monotonic ``until`` at most: the start-up reads its code and
        libraries first, and on a node short of CPU or link a checkpoint fetched meanwhile
        slows exactly those (the server image, profiled: its imports took 5.0 s beside its
        weights' prefetch, 2.7 s without a prefetch at all; issue 49). ``stop``: the layer's
        (unmounted: no more waiting)."""
        self._wait_while(lambda: self._small_sets > 0 and not (stop and stop.is_set()), until)

    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # -- the read path -------------------------------------------------------------------------

    def get(self, target: FetchTarget, spans: Sequence[Span], deadline: float, *,
            more: Callable[[list[Chunk]], Iterable[Chunk]] | None = None,
            name: str = "") -> list[bytes | memoryview]:
        """The bytes ``[lo:hi]`` of each ``(chunk, lo, hi)`` of ``spans``, by monotonic
        ``deadline``: the one get-or-fetch path of a read. A piece of a chunk joined in
        flight is a view of the chunk's bytes (no copy).

        For each chunk: a hole is zeros; a chunk in flight is joined; otherwise this call
        owns it (enters it in flight first, so that a concurrent reader joins instead of
        asking too), asks the cache once, and on a miss fetches it: coalesced with the other
        misses and with ``more(missed)`` (chunks worth fetching in the same requests, e.g. a
        small file's neighbours; nobody waits for them; asked only when something missed),
        verified, cached. Registering before the look-up is what makes one look-up enough: a
        fetch that finished earlier stored its chunk before it left the in-flight table.
        ``name`` (the file) goes into errors.

        Raises DeadlineExceeded past ``deadline``, or the chunk's fetch error
        (IntegrityError, FormatError, Unavailable).
        """
        out: list[bytes | memoryview | None] = [None] * len(spans)
        waits: list[tuple[int, Future[bytes]]] = []
        owned: list[tuple[int, Chunk, _Flight]] = []
        mine: dict[Chunk, _Flight] = {}
        with self._lock:
            if self._closed:
                raise Unavailable("the FUSE server is shutting down")
            for i, (c, lo, hi) in enumerate(spans):
                if c.zeros:
                    out[i] = bytes(hi - lo)
                    continue
                fl = mine.get(c)
                if fl is None:
                    k = _key(target, c)
                    fl = self._inflight.get(k)
                    if fl is None:
                        fl = mine[c] = self._inflight[k] = _Flight()
                        owned.append((i, c, fl))
                        continue
                fl.joiners += 1
                if not fl.urgent:
                    fl.urgent = True
                    self._idle.notify_all()     # a fill request holding it goes now
                waits.append((i, fl.future))
        fetch: dict[Chunk, _Flight] = {}
        try:
            missed = self._look_up(spans, owned, out, waits, fetch, target)
            if missed and more is not None:
                self._add_more(target, more(missed), mine, fetch)
            if fetch:
                self._launch(target, fetch, background=False, kind=DEMAND)
        except BaseException as exc:
            # whatever we own and did not start must not be left in flight (joiners would
            # wait for it until their deadline)
            self._settle_all(target, {c: fl for c, fl in {**mine, **fetch}.items()
                                      if not fl.future.done()}, exc, False)
            raise
        for i, fut in waits:
            c, lo, hi = spans[i]
            what = (f"layer {target.digest}: {name!r} chunk at {c.chunk_offset} "
                    f"({c.digest or 'no digest'})")
            data = wait_for(fut, deadline, what)
            if len(data) < hi:
                raise FormatError(f"{what}: decoded {len(data)} bytes, need {hi}")
            out[i] = data if lo == 0 and hi == len(data) else memoryview(data)[lo:hi]
        return [b"" if p is None else p for p in out]

    def _look_up(self, spans: Sequence[Span], owned: list[tuple[int, Chunk, _Flight]],
                 out: list[bytes | memoryview | None], waits: list[tuple[int, Future[bytes]]],
                 fetch: dict[Chunk, _Flight], target: FetchTarget) -> list[Chunk]:
        """The one cache look-up of each chunk :meth:`get` owns: a hit fills ``out``, a miss
        goes to ``fetch`` and ``waits``. Returns the chunks that were not local (joined or
        missed)."""
        tel = self.telemetry
        missed = [spans[i][0] for i, _ in waits]
        if tel is not None:
            for i, _ in waits:
                tel.cache_miss(spans[i][2] - spans[i][1])
        for i, c, fl in owned:
            lo, hi = spans[i][1], spans[i][2]
            data = None
            if c.digest and self.cache is not None:
                data = self.cache.read(c.digest, lo, hi - lo, expected_size=c.chunk_size)
            if tel is not None:
                (tel.cache_miss if data is None else tel.cache_hit)(hi - lo)
            if data is None:
                fetch[c] = fl
                waits.append((i, fl.future))
                missed.append(c)
                continue
            out[i] = data
            if not self._settle_cached(target, c, fl):
                fetch[c] = fl       # evicted meanwhile, and someone joined: fetch it for them
        return missed

    def _add_more(self, target: FetchTarget, chunks: Iterable[Chunk],
                  mine: dict[Chunk, _Flight], fetch: dict[Chunk, _Flight]) -> None:
        """Own and fetch along the extra chunks not in flight (their caller chose them from
        the cache's index; one cached since, by a fetch that just finished, is skipped)."""
        extras: dict[Chunk, _Flight] = {}
        with self._lock:
            for c in chunks:
                if c.zeros or c in mine or c in extras:
                    continue
                k = _key(target, c)
                if k not in self._inflight:
                    extras[c] = self._inflight[k] = _Flight()
        mine.update(extras)
        for c, fl in extras.items():
            if (c.digest and self.cache is not None and self.cache.contains(c.digest)
                    and self._settle_cached(target, c, fl)):
                continue
            fetch[c] = fl

    def _settle_cached(self, target: FetchTarget, c: Chunk, fl: _Flight) -> bool:
        """A chunk this caller owns turned out cached: leave the in-flight table; if others
        joined meanwhile, hand them the whole chunk. False if they still need a fetch."""
        with self._lock:
            if fl.joiners == 0:
                self._release_locked(target, c, fl)
                return True
        whole = self.cache.get(c.digest, expected_size=c.chunk_size) \
            if c.digest and self.cache is not None else None
        if whole is None:
            return False
        self._release(target, c, fl)
        fl.future.set_result(whole)
        return True

    # -- background and read-ahead -------------------------------------------------------------

    def request(self, target: FetchTarget, chunks: Iterable[Chunk], *,
                background: bool = False, max_bytes: int | None = None,
                kind: str = DEMAND, max_gap: int | None = None,
                unread: bool = False) -> dict[Chunk, Future[bytes]]:
        """Start fetching ``chunks`` (those not already in flight); a future for each.

        For read-ahead and background fetches, whose callers chose the chunks from the
        cache's index; a chunk cached since is served from the cache. ``max_bytes`` lowers
        the coalescing limit (read-ahead splits its chunks over several requests so that the
        pool fetches and decodes them in parallel; a prefetch may also raise it above
        ``max_coalesce_bytes``). ``background``: the fill's low-priority pool, which waits
        while on-demand fetches run. ``kind`` is what the layer's stats count the bytes as.
        ``max_gap``: chunks this far apart still share a request (default: the fetcher's).
        ``unread``: the caller hands the chunks to the page cache (a start-up's prefetch), so
        reads are not expected to ask the chunk cache for them: it keeps each one that no read
        joined encoded until it is written (a read that does ask decodes it again).
        """
        out: dict[Chunk, Future[bytes]] = {}
        mine: dict[Chunk, _Flight] = {}
        with self._lock:
            if self._closed:
                raise Unavailable("the FUSE server is shutting down")
            for c in chunks:
                if c.zeros or c in out:
                    continue
                k = _key(target, c)
                fl = self._inflight.get(k)
                if fl is None:
                    fl = mine[c] = self._inflight[k] = _Flight(unread=unread)
                else:
                    fl.joiners += 1
                    if not background and not fl.urgent:
                        fl.urgent = True
                        self._idle.notify_all()
                out[c] = fl.future
        # A chunk not in flight may have been cached since the caller looked (a fetch stores
        # its chunks before it leaves the in-flight table): serve those from the cache.
        # (a background request's chunks were chosen from the index: only the index is asked,
        # not the disk, a miss of which costs an open(2) each)
        new: dict[Chunk, _Flight] = {}
        cache = self.cache
        for c, fl in mine.items():
            data = None
            if c.digest and cache is not None and (not background or cache.contains(c.digest)):
                data = cache.get(c.digest, expected_size=c.chunk_size, keep=not unread)
            if data is None:
                new[c] = fl
                continue
            self._release(target, c, fl)
            fl.future.set_result(data)
        if new:
            self._launch(target, new, background=background, max_bytes=max_bytes, kind=kind,
                         max_gap=max_gap)
        return out

    # -- fetching ------------------------------------------------------------------------------

    def _launch(self, target: FetchTarget, chunks: dict[Chunk, _Flight], *, background: bool,
                max_bytes: int | None = None, kind: str = DEMAND,
                max_gap: int | None = None) -> None:
        """Coalesce ``chunks`` (owned by the caller, in flight) into requests and start them."""
        if max_bytes is None:
            limit = self.max_coalesce_bytes
        elif kind == PREFETCH:
            limit = max(1, max_bytes)
        else:
            limit = max(1, min(max_bytes, self.max_coalesce_bytes))
        # (asked now: a registry that declined one is not asked again, and one whose range
        # reads do not go direct would cost a request per range, one after another)
        multi = (kind == PREFETCH and isinstance(target.source, ManyRangeSource)
                 and target.source.reads_many())
        if multi:
            # runs of chunks a few tar headers apart, several to a request
            runs = coalesce(chunks, limit, self.max_gap)
            packs = pack_runs(runs, MULTI_BYTES, MULTI_PARTS)
            groups = [[c for run in pack for c in run] for pack in packs]
        else:
            groups = coalesce(chunks, limit, self.max_gap if max_gap is None else max_gap)
            packs = [[g] for g in groups]
        if not background:
            with self._lock:
                self._foreground += len(groups)
                if kind == PREFETCH:
                    self._prefetching += len(groups)
        for g, pack in zip(groups, packs, strict=True):
            owned = {c: chunks[c] for c in g}
            run: Callable[[], None]
            if background:
                def run(owned: dict[Chunk, _Flight] = owned) -> None:
                    if self._wait_foreground_idle(owned):
                        # a read joined while it waited: fetch and decode it at the read's
                        # priority, not on this niced thread
                        try:
                            self._pool.submit(self._fetch_group, target, owned, False, kind)
                            return
                        except RuntimeError:
                            pass
                    self._fetch_group(target, owned, False, kind)
                pool = self._bg_pool
            else:
                def run(owned: dict[Chunk, _Flight] = owned,
                        pack: list[list[Chunk]] = pack) -> None:
                    self._fetch_group(target, owned, True, kind, pack)
                pool = self._pool
            try:
                pool.submit(run)
            except RuntimeError as exc:  # pool shut down under us
                self._settle_all(target, owned, Unavailable(f"fetch not started: {exc}"),
                                 not background, kind)

    def note_read(self) -> None:
        """The node is busy: a FUSE read was served, or a file looked up (the loop calls
        this: one clock read, no lock). A start-up whose data is in the page cache still
        looks its files up: it counts as reading (files are opened without the server)."""
        self.last_read = time.monotonic()

    def hold(self, seconds: float) -> None:
        """The node is busy for ``seconds`` more without FUSE reads (a snapshot restore
        decoding its pages and running CRIU): background work waits as it would for reads.
        Holds only extend: two restores at once keep the later end."""
        with self._lock:
            self.held_until = max(self.held_until, time.monotonic() + seconds)

    def wait_quiet(self, timeout: float | None = None,
                   stop: threading.Event | None = None) -> bool:
        """Block while on-demand fetches are in flight or a read was served within the last
        ``QUIET_SECONDS`` (see :meth:`_wait_foreground_idle`), at most ``timeout`` seconds;
        False if it gave up. Ends at once once ``stop`` is set (after :meth:`wake`)."""
        return not self._wait_foreground_idle({}, timeout, stop)

    def _wait_foreground_idle(self, owned: dict[Chunk, _Flight],
                              timeout: float | None = None,
                              stop: threading.Event | None = None) -> bool:
        """Hold a background request while on-demand fetches are in flight, and until no read
        was served for ``QUIET_SECONDS``: the start-up reading its files has the CPU and the
        link first (its decoding, hashing and cache writes are what the fill would take).
        Returns True at once when a read joins one of ``owned`` (it must not wait), or when
        ``timeout`` seconds passed; False at once once ``stop`` is set (see :meth:`wake`)."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._closed:
                if stop is not None and stop.is_set():
                    return False
                if any(fl.urgent for fl in owned.values()):
                    return True
                now = time.monotonic()
                quiet = max(QUIET_SECONDS - (now - self.last_read), self.held_until - now)
                if self._foreground == 0 and quiet <= 0:
                    return False
                wait = quiet if self._foreground == 0 else 0.5
                if give_up is not None:
                    if now >= give_up:
                        return True
                    wait = min(wait, give_up - now)
                self._idle.wait(min(wait, 1.0))   # re-checked each second at least
            return False

    def _release_locked(self, target: FetchTarget, c: Chunk, fl: _Flight) -> None:
        k = _key(target, c)
        if self._inflight.get(k) is fl:
            del self._inflight[k]

    def _release(self, target: FetchTarget, c: Chunk, fl: _Flight) -> None:
        """Leave the in-flight table (only if the entry is still this fetch's)."""
        with self._lock:
            self._release_locked(target, c, fl)

    def _settle_all(self, target: FetchTarget, owned: dict[Chunk, _Flight],
                    exc: BaseException, foreground: bool, kind: str = DEMAND) -> None:
        for c, fl in owned.items():
            self._release(target, c, fl)
            if not fl.future.done():
                fl.future.set_exception(exc)
        if foreground:
            with self._lock:
                self._foreground -= 1
                if kind == PREFETCH:
                    self._prefetching -= 1
                self._idle.notify_all()

    def _fetch_group(self, target: FetchTarget, owned: dict[Chunk, _Flight],
                     foreground: bool, kind: str = DEMAND,
                     runs: list[list[Chunk]] | None = None) -> None:
        """Fetch ``owned`` in one request: their whole compressed range, or with ``runs``
        (the chunks in runs apart, in blob order) each run's range in one multi-range
        request; then decode, verify and settle each chunk."""
        group = sorted(owned, key=lambda c: (c.offset, c.inner_offset))
        parts = runs if runs is not None and len(runs) > 1 else [group]
        spans = [(p[0].offset, max(c.end_offset for c in p)) for p in parts]
        start, end = spans[0][0], spans[-1][1]
        # a large prefetch request gets as much more time as it is larger than a usual one
        size = sum(b - a for a, b in spans)
        timeout = self.request_timeout * max(1.0, size / self.max_coalesce_bytes)
        try:
            if len(spans) == 1:
                raws = [target.source.read_at(start, end - start, timeout=timeout)]
            else:
                raws = read_many(target.source, [(a, b - a) for a, b in spans],
                                 timeout=timeout)
        except BaseException as exc:
            what = type(exc).__name__
            msg = self._report(target, what, f"layer {target.digest}: fetching bytes "
                               f"{start}..{end} ({len(group)} chunks in {len(spans)} ranges) "
                               f"failed: {what}: {exc}")
            err = exc if isinstance(exc, ColdstartError) else Unavailable(msg)
            self._settle_all(target, owned, err, foreground, kind)
            return
        self._count_fetch(target, sum(len(r) for r in raws), len(group), kind)
        try:
            again: list[Chunk] = []
            spread: dict[str, bytes] = {}
            span = -1
            upto: dict[int, int] | None = None
            if kind == PREFETCH and target.layer.spreads:
                upto = {}
                for c in group:
                    upto[c.offset] = max(upto.get(c.offset, 0), c.inner_offset + c.chunk_size)
            later = False
            for part, raw, (start, _) in zip(parts, raws, spans, strict=True):
                for c in part:      # in blob order (coalesce's runs, or the sorted group)
                    if c.offset != span:    # sorted: a span's pieces come together
                        spread.clear()
                        span = c.offset
                        later = upto is not None and self._defer_spread(target, c, raw, start)
                    if not self._finish_chunk(target, c, owned[c], raw, start,
                                              last=REFETCHES <= 0, spread=spread,
                                              upto=upto[c.offset] if later and upto else None):
                        again.append(c)
                    else:
                        # settled: its bytes stay with its readers only (a big prefetch's
                        # decoded chunks are not all held until its last one is decoded)
                        del owned[c]
            if again:
                self._refetch(target, again, owned, kind)
        finally:
            # normally all settled already; this only catches an unexpected failure
            self._settle_all(target, owned,
                             Unavailable(f"layer {target.digest}: fetch aborted"), foreground,
                             kind)

    def _defer_spread(self, target: FetchTarget, c: Chunk, raw: bytes, start: int) -> bool:
        """Hold the compressed bytes of ``c``'s range (a prefetched span of a layer that
        spreads) for :meth:`_spread_later`, run by the spread thread (niced) once the node is
        quiet: the start-up's pieces are decoded now, the rest of the span later, without
        fetching it again. False (spread it now) past ``DEFERRED_SPREAD_BYTES`` held."""
        nbytes = c.end_offset - c.offset
        with self._lock:
            if (self._closed or self.cache is None
                    or self._deferred + nbytes > DEFERRED_SPREAD_BYTES):
                return False
            self._deferred += nbytes
        compressed = raw[c.offset - start : c.end_offset - start]
        try:
            self._spread_pool.submit(self._spread_later, target, c, compressed, nbytes)
        except RuntimeError:    # shut down under us
            self._held_done(nbytes)
            return False
        return True

    def _spread_later(self, target: FetchTarget, c: Chunk, compressed: bytes,
                      nbytes: int) -> None:
        """Cache the other pieces of ``c``'s span from its held bytes (``nbytes`` of the
        budget), once no fetch for a read or a prefetch is in flight and no read was served
        for ``QUIET_SECONDS``. A failure costs only these pieces (they are fetched when read,
        or by the fill): logged and counted in telemetry, not a layer error, and not held
        against the index (the held bytes may have changed on the way: a fetch of the span
        anew tells)."""
        try:
            self._wait_foreground_idle({}, stop=target.stopped)
            if self._closed or self.cache is None:
                return
            # a layer unmounted meanwhile: its chunks are not wanted (nor would the unmount's
            # reclaim find them); checked again after the decode, just before they are cached
            pieces = [] if target.stopped.is_set() else target.layer.spread_from(c, compressed)
            if target.stopped.is_set():
                log.debug("layer %s: no longer served; the span at %d is not spread",
                          target.digest, c.offset)
                return
            for digest, piece in pieces:
                self.cache.put_async(digest, piece, verified=True)
            log.debug("layer %s: span at %d spread: %d pieces", target.digest, c.offset,
                      len(pieces))
        except (ColdstartError, OSError) as exc:
            kind = type(exc).__name__
            log.warning("layer %s: %s: %s (held for the span's other files); they are fetched "
                        "when read", target.digest, kind, exc)
            if self.telemetry is not None:
                self.telemetry.error(kind)
        except Exception:
            log.exception("layer %s: spreading the span at %d failed", target.digest,
                          c.offset)
        finally:
            self._held_done(nbytes)

    def _held_done(self, nbytes: int) -> None:
        with self._lock:
            if not self._closed:
                self._deferred -= nbytes
            self._idle.notify_all()

    def wake(self) -> None:
        """Wake the threads waiting for a quiet node: a layer was stopped (its
        :attr:`FetchTarget.stopped` set), and its held work is to go now."""
        with self._lock:
            self._idle.notify_all()

    def wait_deferred(self, timeout: float | None = None,
                      stop: threading.Event | None = None) -> bool:
        """Block until no span is held for a deferred spread (at most ``timeout`` seconds;
        False if some still are), or ``stop`` is set (see :meth:`wake`): the fill waits so,
        lest it fetch those spans again."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._deferred > 0 and not self._closed:
                if stop is not None and stop.is_set():
                    return True
                wait = None if give_up is None else give_up - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                self._idle.wait(wait)
            return True

    def _count_fetch(self, target: FetchTarget, nbytes: int, chunks: int, kind: str) -> None:
        with target.stats._lock:
            target.stats.fetched_bytes += nbytes
            target.stats.requests += 1
            target.stats.chunks_fetched += chunks
            target.stats.bytes_by_kind[kind] = target.stats.bytes_by_kind.get(kind, 0) + nbytes
            target.stats.requests_by_kind[kind] = target.stats.requests_by_kind.get(kind, 0) + 1
        if self.telemetry is not None:
            self.telemetry.fetched(target.digest, nbytes, kind)

    def _refetch(self, target: FetchTarget, chunks: list[Chunk], owned: dict[Chunk, _Flight],
                 kind: str) -> None:
        """Fetch ``chunks`` (whose bytes failed to decode or verify; still in flight, so their
        readers wait for this) again, ``REFETCHES`` times at most, in requests of their own
        bytes only, and finish them: the last failure is final."""
        for attempt in range(1, REFETCHES + 1):
            with target.stats._lock:
                target.stats.refetched_chunks += len(chunks)
            bad: list[Chunk] = []
            for run in coalesce(chunks, self.max_coalesce_bytes):
                start = run[0].offset
                end = max(c.end_offset for c in run)
                try:
                    raw = target.source.read_at(start, end - start,
                                                timeout=self.request_timeout)
                except BaseException as exc:
                    what = type(exc).__name__
                    msg = self._report(target, what, f"layer {target.digest}: fetching bytes "
                                       f"{start}..{end} again ({len(run)} chunks) failed: "
                                       f"{what}: {exc}")
                    err = exc if isinstance(exc, ColdstartError) else Unavailable(msg)
                    self._settle_all(target, {c: owned[c] for c in run}, err, False)
                    continue
                self._count_fetch(target, len(raw), len(run), kind)
                for c in run:
                    if not self._finish_chunk(target, c, owned[c], raw, start,
                                              last=attempt == REFETCHES):
                        bad.append(c)
            if not bad:
                return
            chunks = bad

    def _report(self, target: FetchTarget, kind: str, msg: str) -> str:
        """Log a failed fetch or chunk, note it in the layer's status and telemetry; ``msg``."""
        log.error("%s", msg)
        target.stats.record_error(msg)
        if self.telemetry is not None:
            self.telemetry.error(kind)
        return msg

    def _cache_decoded(self, target: FetchTarget, c: Chunk, data: bytes,
                       spread: dict[str, bytes] | None, encoded: bytes | None = None) -> None:
        """Cache a verified chunk, and the other files' pieces of its span when it is an
        indexed gzip layer's and decoded whole (verified too; also kept in ``spread`` for the
        request's own chunks among them). ``encoded``: the chunk's compressed bytes, from
        which it was decoded whole (a copy: not the whole request's buffer), for a chunk the page
        cache gets: the cache keeps those until it writes the chunk (decoding them again)
        rather than ``data``, which goes as soon as the page cache has it."""
        if not c.digest or self.cache is None:
            return
        try:
            if encoded is not None:
                self.cache.put_async_encoded(
                    c.digest, len(data), functools.partial(target.layer.decode_chunk, c, encoded),
                    held=len(encoded))
                return
            self.cache.put_async(c.digest, data, verified=True)
            for digest, piece in target.layer.spread(c):
                self.cache.put_async(digest, piece, verified=True)
                if spread is not None:
                    spread[digest] = piece
        except (OSError, ColdstartError) as exc:
            log.warning("layer %s: caching chunk %s failed: %s", target.digest, c.digest, exc)

    def _finish_chunk(self, target: FetchTarget, c: Chunk, fl: _Flight, raw: bytes,
                      start: int, *, last: bool = True,
                      spread: dict[str, bytes] | None = None, upto: int | None = None) -> bool:
        """Decode and verify one fetched chunk, cache it, and wake its readers right away.

        Bytes that fail to decode or verify settle the chunk with the error if ``last``;
        otherwise they are dropped and nothing is settled (False: the caller fetches the chunk
        again). True once the chunk is settled. ``spread``: the pieces that decoding another
        chunk of the same span found, verified and cached already (an indexed gzip layer's
        span: :meth:`~coldstart.format.gzindex.IndexedLayer.spread`), by digest; a chunk
        found there with its own size is not decoded and hashed again (any other is: its
        index may lie). ``upto``: decode the chunk's range only that far
        (:meth:`~coldstart.format.layer.SeekableLayer.decode_chunk`). A chunk its requester
        hands to the page cache (``fl.unread``, see :meth:`request`) that no read joined is
        cached encoded until it is written (:meth:`_cache_decoded`), if its encoded bytes are
        at most ``KEEP_ENCODED_RATIO`` of its size."""
        res: bytes | BaseException
        ready = spread.pop(c.digest, None) if spread is not None and c.digest else None
        if ready is not None and len(ready) == c.chunk_size:
            res = ready
        else:
            # a view of the fetched bytes: the decoder reads them where they are
            encoded = memoryview(raw)[c.offset - start : c.end_offset - start]
            try:
                res = target.layer.decode_chunk(c, encoded, upto=upto)
            except Exception as exc:
                kind = type(exc).__name__
                if not last:
                    log.warning("layer %s: %s: %s (chunk %s at blob offset %d); fetching it "
                                "again", target.digest, kind, exc, c.digest or "-", c.offset)
                    if self.telemetry is not None:
                        self.telemetry.error(kind)
                    return False
                msg = self._report(target, kind, f"layer {target.digest}: {kind}: {exc} "
                                   f"(chunk {c.digest or '-'} at blob offset {c.offset}); "
                                   "not cached")
                target.layer.chunk_failed(c, exc)
                res = type(exc)(msg) if isinstance(exc, ColdstartError) else Unavailable(msg)
            else:
                keep = (fl.unread and upto is None and not fl.joiners
                        and not target.layer.spreads
                        and len(encoded) <= len(res) * KEEP_ENCODED_RATIO)
                self._cache_decoded(target, c, res, spread, bytes(encoded) if keep else None)
        self._release(target, c, fl)   # after the put: a later reader finds it cached
        if fl.future.done():
            return True
        if isinstance(res, BaseException):
            fl.future.set_exception(res)
        else:
            fl.future.set_result(res)
        return True


def lower_priority() -> None:
    """Nice the calling thread (Linux: per thread; the fill's threads) so that the start-up's
    own processes win the CPU; decoding and hashing the fill then costs them little."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FILL_NICENESS)
    except (OSError, AttributeError) as exc:   # not permitted, or not Linux: run as is
        log.debug("fill thread keeps its priority: %s", exc)


def _normal_priority() -> None:
    """Thread initializer of the read path's pools: niceness 0, whoever started the thread."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)


def wait_for(fut: Future[bytes], deadline: float, what: str) -> bytes:
    """The future's result by monotonic ``deadline``, else DeadlineExceeded."""
    remaining = deadline - time.monotonic()
    try:
        return fut.result(timeout=max(0.0, remaining))
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: not served within the read deadline") from None
