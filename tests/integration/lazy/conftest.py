"""Fixtures shared by the lazy-mount tests: a fault-injecting proxy in front of the session's
registry, and one FUSE server per test module that reads through it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import Server, fuse_server
from tests.integration.lazy.lazy_proxy import Proxy, proxy_for


@pytest.fixture(scope="module")
def proxy(registry: Registry) -> Iterator[Proxy]:
    with proxy_for(registry.url) as p:
        yield p


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           proxy: Proxy) -> Iterator[Server]:
    """``(process, control client, its temp dir)``: short deadlines, so fault tests end soon."""
    tmp = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with fuse_server(tmp, registry_host=proxy.host, read_deadline=3.0,
                     request_timeout=2.0) as (proc, client, _root):
        yield proc, client, tmp
