"""Prometheus metrics of the snapshotter's gRPC process: every name is defined here, once.

(Data-path metrics of the FUSE server live in :mod:`coldstart.lazyfs.metrics`.) Metrics
are registered in a registry per :class:`ServiceMetrics`, so several servers in one process (the
tests) do not collide; :func:`serve_metrics` exposes one over HTTP.

Example::

    m = ServiceMetrics(snapshot_counts=lambda: {"active": 1})
    with m.rpc("Prepare"):
        ...
    serve_metrics("127.0.0.1:9102", m)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from coldstart.errors import ColdstartError, InvalidArgument
from coldstart.snapshot.state import FALLBACK_KINDS
from coldstart.snapshotter.snapshotter import FALLBACK_REASONS

__all__ = [
    "LAZY_FALLBACKS",
    "REMOTE_LAYERS",
    "RESTORES",
    "RESTORE_FALLBACKS",
    "RPC_ERRORS",
    "RPC_SECONDS",
    "SNAPSHOTS",
    "ServiceMetrics",
    "serve_metrics",
]

RPC_SECONDS = "coldstart_snapshotter_rpc_duration_seconds"
RPC_ERRORS = "coldstart_snapshotter_rpc_errors_total"
SNAPSHOTS = "coldstart_snapshotter_snapshots"
REMOTE_LAYERS = "coldstart_snapshotter_remote_layers_total"
LAZY_FALLBACKS = "coldstart_snapshotter_lazy_fallbacks_total"
# the node's snapshot restores (coldstart-runc counts them in its state directory; read at
# each scrape)
RESTORES = "coldstart_snapshot_restores_total"
RESTORE_FALLBACKS = "coldstart_snapshot_restore_fallbacks_total"


class _SnapshotCounts(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(SNAPSHOTS, "Snapshots in the store, by kind",
                                   labels=["kind"])
        counts = self._counts()
        for kind in ("active", "view", "committed"):
            family.add_metric([kind], float(counts.get(kind, 0)))
        yield family


class _RestoreCounts(Collector):
    """The node's snapshot restores as ``coldstart snapshot status`` counts them: restored,
    fell back (and why)."""

    def __init__(self, counts: Callable[[], Mapping[str, Any]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._counts()
        raw = counts.get("fallbacks")
        fallbacks: dict[str, int] = dict.fromkeys(FALLBACK_KINDS, 0)
        if isinstance(raw, Mapping):
            for kind, n in raw.items():
                fallbacks[str(kind)] = int(n) if isinstance(n, int) else 0
        restores = CounterMetricFamily(
            RESTORES, "Containers the node's runtime was asked to restore from a snapshot, by "
            "outcome (restored; fallback: started normally)", labels=["outcome"])
        restored = counts.get("restored")
        restores.add_metric(["restored"], float(restored if isinstance(restored, int) else 0))
        restores.add_metric(["fallback"], float(sum(fallbacks.values())))
        yield restores
        by = CounterMetricFamily(RESTORE_FALLBACKS, "Restores that fell back to a normal "
                                 "start, by reason", labels=["reason"])
        for kind, n in sorted(fallbacks.items()):
            by.add_metric([kind], float(n))
        yield by


class ServiceMetrics:
    def __init__(self, snapshot_counts: Callable[[], Mapping[str, int]] | None = None,
                 restore_counts: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(RPC_SECONDS, "Latency of snapshotter RPCs",
                                     ["method"], registry=self.registry)
        self.rpc_errors = Counter(RPC_ERRORS, "Snapshotter RPCs answered with an error",
                                  ["method", "code"], registry=self.registry)
        self.remote_layers = Counter(REMOTE_LAYERS,
                                     "Layers offered for lazy pulling, by result "
                                     "(mounted, fallback)", ["result"], registry=self.registry)
        # the fallbacks of remote_layers again, by why (a separate family keeps the one above
        # unchanged for whoever reads it already)
        self.lazy_fallbacks = Counter(LAZY_FALLBACKS,
                                      "Layers offered for lazy pulling but pulled normally, by "
                                      "reason", ["reason"], registry=self.registry)
        for reason in FALLBACK_REASONS:       # every reason shows, at 0 until it happens
            self.lazy_fallbacks.labels(reason)
        if snapshot_counts is not None:
            self.registry.register(_SnapshotCounts(snapshot_counts))
        if restore_counts is not None:
            self.registry.register(_RestoreCounts(restore_counts))

    @contextlib.contextmanager
    def rpc(self, method: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except ColdstartError as exc:
            self.rpc_errors.labels(method, exc.grpc_code).inc()
            raise
        except Exception:
            self.rpc_errors.labels(method, "UNKNOWN").inc()
            raise
        finally:
            self.rpc_seconds.labels(method).observe(time.perf_counter() - start)

    def remote_layer(self, result: str, reason: str = "") -> None:
        """Count a layer offered for lazy pulling: ``mounted``, or ``fallback`` and why."""
        self.remote_layers.labels(result).inc()
        if result == "fallback":
            self.lazy_fallbacks.labels(reason or "other").inc()


def serve_metrics(address: str, metrics: ServiceMetrics) -> None:
    """Serve ``metrics`` on ``host:port`` in a daemon thread."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument(f"metrics_address {address!r} is not host:port")
    try:
        start_http_server(int(port), addr=host or "0.0.0.0", registry=metrics.registry)
    except OSError as exc:
        raise InvalidArgument(f"cannot serve metrics on {address}: {exc}") from exc
