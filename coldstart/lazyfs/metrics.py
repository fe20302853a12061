"""Prometheus metrics of the FUSE server: names defined once, here (CONVENTIONS §12).

The data path reports through the :class:`~coldstart.lazyfs.target.FetchTelemetry`
hooks; :class:`FuseMetrics` implements them on its own registry, served over HTTP when the
server is given a metrics address.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

__all__ = [
    "CACHE_HITS",
    "CACHE_MISSES",
    "ERRORS",
    "FETCHED_BYTES",
    "FETCH_REQUESTS",
    "KIND_FETCHED_BYTES",
    "LAYER_FETCHED_BYTES",
    "READ_SECONDS",
    "FuseMetrics",
]

FETCHED_BYTES = "coldstart_fuse_fetched_bytes"
FETCH_REQUESTS = "coldstart_fuse_fetch_requests"
CACHE_HITS = "coldstart_fuse_cache_hits"
CACHE_MISSES = "coldstart_fuse_cache_misses"
READ_SECONDS = "coldstart_fuse_read_seconds"
ERRORS = "coldstart_fuse_errors"
LAYER_FETCHED_BYTES = "coldstart_fuse_layer_fetched_bytes"
KIND_FETCHED_BYTES = "coldstart_fuse_fetched_by_kind_bytes"

_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class FuseMetrics:
    """The FUSE server's metrics on a private registry (so tests can make several)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.fetched_bytes = Counter(FETCHED_BYTES, "Compressed bytes fetched from registries",
                                     registry=r)
        self.fetch_requests = Counter(FETCH_REQUESTS, "Range requests sent", registry=r)
        self.cache_hits = Counter(CACHE_HITS, "Chunk reads served from the chunk cache",
                                  registry=r)
        self.cache_misses = Counter(CACHE_MISSES, "Chunk reads that had to fetch", registry=r)
        self.read_seconds = Histogram(READ_SECONDS, "FUSE read latency (reader part)",
                                      buckets=_BUCKETS, registry=r)
        self.errors = Counter(ERRORS, "Failures on the data path by kind", ["kind"], registry=r)
        self.layer_fetched = Counter(LAYER_FETCHED_BYTES, "Compressed bytes fetched per layer",
                                     ["layer"], registry=r)
        self.kind_fetched = Counter(KIND_FETCHED_BYTES, "Compressed bytes fetched, by what for: "
                                    "demand (a read waits), prefetch (the start-up set at "
                                    "mount), fill (the rest, in the background)", ["kind"],
                                    registry=r)

    # FetchTelemetry
    def fetched(self, layer: str, nbytes: int, kind: str = "demand") -> None:
        self.fetched_bytes.inc(nbytes)
        self.fetch_requests.inc()
        self.layer_fetched.labels(layer=layer).inc(nbytes)
        self.kind_fetched.labels(kind=kind).inc(nbytes)

    def cache_hit(self, nbytes: int) -> None:
        self.cache_hits.inc()

    def cache_miss(self, nbytes: int) -> None:
        self.cache_misses.inc()

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def read_done(self, seconds: float) -> None:
        self.read_seconds.observe(seconds)

    def serve(self, address: str) -> None:
        """Serve ``/metrics`` on ``host:port`` in a daemon thread."""
        host, _, port = address.rpartition(":")
        start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
