"""Fixtures of the probe's integration tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from coldstart.probe.router import Router


@pytest.fixture
def router(redis_server: str) -> Iterator[Router]:
    """A router on the session's redis-server, for a service of its own (keys deleted after)."""
    r = Router.connect(redis_server, f"svc-{uuid.uuid4().hex[:8]}")
    yield r
    r.client.delete(*r.keys)
    r.client.close()
