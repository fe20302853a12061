"""Fetching chunks of lazily mounted layers: range sources, coalescing, single-flight, a pool.

A :class:`ChunkFetcher` is shared by every layer the FUSE server mounts. Asked for some chunks,
it merges adjacent ones into one range request (up to ``max_coalesce_bytes``), makes sure each
chunk is fetched by one request at a time however many readers want it (keyed by the chunk's
content digest, so identical chunks of two layers are fetched once), runs the requests in a
bounded thread pool, decodes and verifies each chunk (``SeekableLayer.decode_chunk``), stores the
good ones in the chunk cache, and resolves one :class:`~concurrent.futures.Future` per chunk.
A chunk that fails verification resolves with :class:`IntegrityError` and is never cached.

Background work (prefetch) runs in its own small pool and waits while on-demand fetches are in
flight, so it never delays a read that a process is blocked on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from coldstart.cache.chunks import ChunkCache
from coldstart.errors import ColdstartError, DeadlineExceeded, Unavailable
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk
from coldstart.remote import Source

__all__ = [
    "ChunkFetcher",
    "FetchTelemetry",
    "LayerStats",
    "coalesce",
]

log = logging.getLogger(__name__)

#: Missing chunks this close in the blob share a request (the gap is fetched and dropped):
#: between two small files lie only their tar header frames.
MAX_GAP = 32 << 10


class FetchTelemetry(Protocol):
    """Hooks the fetcher and reader report through (metrics live outside the data path)."""

    def fetched(self, layer: str, nbytes: int) -> None: ...

    def cache_hit(self, nbytes: int) -> None: ...

    def cache_miss(self, nbytes: int) -> None: ...

    def error(self, kind: str) -> None: ...

    def read_done(self, seconds: float) -> None: ...


@dataclass
class LayerStats:
    """Per-layer counters shown by the FUSE server's status (CONVENTIONS §12)."""

    fetched_bytes: int = 0
    requests: int = 0
    chunks_fetched: int = 0
    errors: int = 0
    last_error: str = ""
    last_error_at: float = 0.0
    prefetch_done: bool = False
    background_done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_error(self, message: str) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = message
            self.last_error_at = time.time()

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            return {
                "fetched_bytes": self.fetched_bytes,
                "requests": self.requests,
                "chunks_fetched": self.chunks_fetched,
                "errors": self.errors,
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "prefetch_done": self.prefetch_done,
                "background_done": self.background_done,
            }


@dataclass
class FetchTarget:
    """One layer as the fetcher sees it."""

    digest: str
    layer: SeekableLayer
    source: Source
    stats: LayerStats


def coalesce(chunks: Iterable[Chunk], max_bytes: int, max_gap: int = 0) -> list[list[Chunk]]:
    """Group chunks into runs fetched by one range request each, each ≤ ``max_bytes``.

    Chunks whose compressed ranges touch (or are at most ``max_gap`` bytes apart: the tar
    header frames between two files' data) share a run. Chunks sharing one gzip member
    (eStargz small files) share its range.

    >>> a = Chunk(0, 10, 0, 5, "d1"); b = Chunk(10, 20, 0, 5, "d2"); c = Chunk(30, 40, 0, 5, "d3")
    >>> [[x.offset for x in g] for g in coalesce([c, a, b], 100)]
    [[0, 10], [30]]
    >>> [[x.offset for x in g] for g in coalesce([c, a, b], 100, max_gap=10)]
    [[0, 10, 30]]
    """
    groups: list[list[Chunk]] = []
    start = end = -1
    for c in sorted(chunks, key=lambda c: (c.offset, c.inner_offset)):
        if groups and c.offset <= end + max_gap and max(end, c.end_offset) - start <= max_bytes:
            groups[-1].append(c)
            end = max(end, c.end_offset)
        else:
            groups.append([c])
            start, end = c.offset, c.end_offset
    return groups


def _key(target: FetchTarget, c: Chunk) -> str:
    if c.digest:
        return c.digest
    return f"{target.digest}@{c.offset}+{c.inner_offset}"


class ChunkFetcher:
    """Node-wide single-flight chunk fetching with a bounded pool; see the module docstring."""

    def __init__(self, cache: ChunkCache | None, *, concurrency: int = 8,
                 max_coalesce_bytes: int = 16 << 20, request_timeout: float = 10.0,
                 max_gap: int = MAX_GAP, telemetry: FetchTelemetry | None = None) -> None:
        self.cache = cache
        self.max_coalesce_bytes = max(1, max_coalesce_bytes)
        self.max_gap = max(0, max_gap)
        self.request_timeout = request_timeout
        self.telemetry = telemetry
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="fetch")
        self._bg_pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        # plans read-ahead off the FUSE loop (choosing chunks costs a stat per chunk)
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="plan")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight: dict[str, Future[bytes]] = {}
        self._foreground = 0
        self._closed = False

    def close(self) -> None:
        """Stop taking work; running requests finish (bounded by their timeouts)."""
        with self._lock:
            self._closed = True
            self._idle.notify_all()
        self._bg_pool.shutdown(wait=False, cancel_futures=True)
        self._planner.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def plan(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` (which usually calls :meth:`request`) in the planner thread."""
        try:
            self._planner.submit(fn)
        except RuntimeError:  # shutting down
            pass

    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def request(self, target: FetchTarget, chunks: Iterable[Chunk], *,
                background: bool = False,
                max_bytes: int | None = None) -> dict[Chunk, Future[bytes]]:
        """Start fetching ``chunks`` (those not already in flight); a future for each.

        ``max_bytes`` lowers the coalescing limit (read-ahead splits its chunks over several
        requests so that the pool fetches and decodes them in parallel).
        """
        out: dict[Chunk, Future[bytes]] = {}
        mine: dict[Chunk, Future[bytes]] = {}
        with self._lock:
            if self._closed:
                raise Unavailable("the FUSE server is shutting down")
            for c in chunks:
                if c.zeros or c in out:
                    continue
                k = _key(target, c)
                fut = self._inflight.get(k)
                if fut is None:
                    fut = Future()
                    self._inflight[k] = fut
                    mine[c] = fut
                out[c] = fut
        # A chunk not in flight may have been cached since the caller looked (a fetch stores
        # its chunks before it leaves the in-flight table): serve those from the cache.
        new: list[Chunk] = []
        for c, fut in mine.items():
            data = None
            if c.digest and self.cache is not None:
                data = self.cache.get(c.digest, expected_size=c.chunk_size)
            if data is None:
                new.append(c)
                continue
            self._release(target, c, fut)
            fut.set_result(data)
        limit = self.max_coalesce_bytes if max_bytes is None else \
            max(1, min(max_bytes, self.max_coalesce_bytes))
        groups = coalesce(new, limit, self.max_gap)
        if not background:
            with self._lock:
                self._foreground += len(groups)
        for g in groups:
            owned = {c: mine[c] for c in g}
            run: Callable[[], None]
            if background:
                def run(owned: dict[Chunk, Future[bytes]] = owned) -> None:
                    self._wait_foreground_idle()
                    self._fetch_group(target, owned, False)
                pool = self._bg_pool
            else:
                def run(owned: dict[Chunk, Future[bytes]] = owned) -> None:
                    self._fetch_group(target, owned, True)
                pool = self._pool
            try:
                pool.submit(run)
            except RuntimeError as exc:  # pool shut down under us
                self._settle_all(target, owned, Unavailable(f"fetch not started: {exc}"),
                                 not background)
        return out

    def _wait_foreground_idle(self) -> None:
        with self._lock:
            while self._foreground > 0 and not self._closed:
                self._idle.wait(0.5)

    def _release(self, target: FetchTarget, c: Chunk, fut: Future[bytes]) -> None:
        """Leave the in-flight table (only if the entry is still this fetch's)."""
        k = _key(target, c)
        with self._lock:
            if self._inflight.get(k) is fut:
                del self._inflight[k]

    def _settle_all(self, target: FetchTarget, owned: dict[Chunk, Future[bytes]],
                    exc: BaseException, foreground: bool) -> None:
        for c, fut in owned.items():
            self._release(target, c, fut)
            if not fut.done():
                fut.set_exception(exc)
        if foreground:
            with self._lock:
                self._foreground -= 1
                self._idle.notify_all()

    def _fetch_group(self, target: FetchTarget, owned: dict[Chunk, Future[bytes]],
                     foreground: bool) -> None:
        group = sorted(owned, key=lambda c: (c.offset, c.inner_offset))
        start = group[0].offset
        end = max(c.end_offset for c in group)
        try:
            raw = target.source.read_at(start, end - start, timeout=self.request_timeout)
        except BaseException as exc:
            kind = type(exc).__name__
            msg = self._report(target, kind, f"layer {target.digest}: fetching bytes "
                               f"{start}..{end} ({len(group)} chunks) failed: {kind}: {exc}")
            err = exc if isinstance(exc, ColdstartError) else Unavailable(msg)
            self._settle_all(target, owned, err, foreground)
            return
        with target.stats._lock:
            target.stats.fetched_bytes += len(raw)
            target.stats.requests += 1
            target.stats.chunks_fetched += len(group)
        if self.telemetry is not None:
            self.telemetry.fetched(target.digest, len(raw))
        try:
            for c in group:
                self._finish_chunk(target, c, owned[c], raw, start)
        finally:
            # normally all settled already; this only catches an unexpected failure
            self._settle_all(target, owned,
                             Unavailable(f"layer {target.digest}: fetch aborted"), foreground)

    def _report(self, target: FetchTarget, kind: str, msg: str) -> str:
        """Log a failed fetch or chunk, note it in the layer's status and telemetry; ``msg``."""
        log.error("%s", msg)
        target.stats.record_error(msg)
        if self.telemetry is not None:
            self.telemetry.error(kind)
        return msg

    def _finish_chunk(self, target: FetchTarget, c: Chunk, fut: Future[bytes], raw: bytes,
                      start: int) -> None:
        """Decode and verify one fetched chunk, cache it, and wake its readers right away."""
        res: bytes | BaseException
        try:
            res = target.layer.decode_chunk(c, raw[c.offset - start : c.end_offset - start])
        except Exception as exc:
            kind = type(exc).__name__
            msg = self._report(target, kind, f"layer {target.digest}: {kind}: {exc} (chunk "
                               f"{c.digest or '-'} at blob offset {c.offset}); not cached")
            res = type(exc)(msg) if isinstance(exc, ColdstartError) else Unavailable(msg)
        else:
            if c.digest and self.cache is not None:
                try:
                    self.cache.put_async(c.digest, res, verified=True)
                except (OSError, ColdstartError) as exc:
                    log.warning("layer %s: caching chunk %s failed: %s", target.digest,
                                c.digest, exc)
        self._release(target, c, fut)   # after the put: a later reader finds it cached
        if fut.done():
            return
        if isinstance(res, BaseException):
            fut.set_exception(res)
        else:
            fut.set_result(res)


def wait_for(fut: Future[bytes], deadline: float, what: str) -> bytes:
    """The future's result by monotonic ``deadline``, else DeadlineExceeded."""
    remaining = deadline - time.monotonic()
    try:
        return fut.result(timeout=max(0.0, remaining))
    except TimeoutError:
        raise DeadlineExceeded(f"{what}: not served within the read deadline") from None
