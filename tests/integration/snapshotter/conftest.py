"""Fixtures of the snapshotter integration tests."""

from __future__ import annotations

import pytest

from coldstart.errors import ColdstartError
from coldstart.lazyfs.client import FuseServerClient
from tests.fixtures.containerd import SnapshotterDaemon


@pytest.fixture
def fuse_server_up(coldstart_snapshotter: SnapshotterDaemon) -> FuseServerClient:
    """The FUSE server the session daemon spawned, answering; a clear failure otherwise."""
    client = FuseServerClient(str(coldstart_snapshotter.base / "f.sock"), 10.0)
    try:
        client.ping()
    except ColdstartError as exc:
        log = coldstart_snapshotter.root / "fuse-server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        pytest.fail(f"the FUSE server does not answer: {exc}\n{tail}")
    return client
