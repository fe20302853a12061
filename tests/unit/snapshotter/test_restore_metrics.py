"""The node's snapshot restores (counted by coldstart-runc in its state directory) in the
snapshotter's metrics, read at each scrape."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from coldstart.snapshot.state import FALLBACK_KINDS, NodeState
from coldstart.snapshotter.service_metrics import RESTORE_FALLBACKS, RESTORES, ServiceMetrics


def _samples(metrics: ServiceMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(("coldstart_snapshot_restore", "coldstart_snapshot_restores")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_restores_and_fallbacks_are_counted_at_each_scrape(tmp_path: Path) -> None:
    state = NodeState(tmp_path / "state")
    state.ensure()
    metrics = ServiceMetrics(restore_counts=state.counters)
    before = _samples(metrics)
    assert before[f'{RESTORES}{{outcome="restored"}}'] == 0
    assert all(before[f'{RESTORE_FALLBACKS}{{reason="{k}"}}'] == 0 for k in FALLBACK_KINDS)
    state.record({"outcome": "restored", "container": "a"})
    state.record({"outcome": "restored", "container": "b"})
    state.record({"outcome": "fallback", "kind": "no-snapshot", "container": "c"})
    state.record({"outcome": "pages-in", "container": "a"})        # not a restore
    after = _samples(metrics)
    assert after[f'{RESTORES}{{outcome="restored"}}'] == 2
    assert after[f'{RESTORES}{{outcome="fallback"}}'] == 1
    assert after[f'{RESTORE_FALLBACKS}{{reason="no-snapshot"}}'] == 1


def test_a_node_that_never_restored_shows_zeros(tmp_path: Path) -> None:
    metrics = ServiceMetrics(restore_counts=NodeState(tmp_path / "none").counters)
    samples = _samples(metrics)
    assert samples[f'{RESTORES}{{outcome="restored"}}'] == 0
    assert samples[f'{RESTORES}{{outcome="fallback"}}'] == 0
