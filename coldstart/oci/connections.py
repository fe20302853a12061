"""The registry client's connections: pooled httpx clients, TLS contexts, raw range connections.

One httpx client per TLS setting (plain HTTP, an endpoint's own CA or ``skip_verify``, default
verification for redirect targets), because building an SSL context costs ~0.5 s of CPU; the
same contexts, built once per setting, for the raw range connections
(:class:`coldstart.remote.rangeconn.RangeConnections`) that blob range reads go over. Every
socket wait of an attempt is cut off after ``timeout`` seconds and never outlasts the call's
deadline (:meth:`Connections.timeouts`). :meth:`Connections.close` closes them all; a closed
instance hands out no more clients.
"""

from __future__ import annotations

import ssl
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx

from coldstart.errors import FailedPrecondition
from coldstart.oci.hosts import Endpoint
from coldstart.remote.rangeconn import RangeConnections
from coldstart.remote.retry import Deadline

__all__ = ["Connections"]


class Connections:
    """The pools one :class:`~coldstart.oci.registry.RegistryClient` speaks through.

    ``timeout``: the longest one socket wait (connect, read, a free connection) may take;
    ``max_connections``: per pool; ``user_agent``: sent with every request.
    """

    def __init__(self, *, timeout: float, max_connections: int, user_agent: str) -> None:
        self.timeout = timeout
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
        self._user_agent = user_agent
        self._lock = threading.Lock()
        self._clients: dict[tuple[Any, ...], httpx.Client] = {}
        self._tls_contexts: dict[tuple[Any, ...], ssl.SSLContext | None] = {}
        # range reads of blobs: straight into a buffer (see coldstart.remote.rangeconn)
        self.ranges = RangeConnections(max_idle=max_connections, user_agent=user_agent)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every pooled connection."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self._closed = True
        for c in clients:
            c.close()
        self.ranges.close()

    def client(self, ep: Endpoint | None) -> httpx.Client:
        """The pool for ``ep`` (``None``: default TLS verification, for redirect targets)."""
        plain = ep is not None and ep.base.startswith("http://")
        # building an SSL context costs ~0.5 s of CPU: plain-HTTP endpoints do without one
        key: tuple[Any, ...] = ("http",) if plain else (
            ep.tls_key() if ep is not None else (True, None))
        with self._lock:
            if self._closed:
                raise FailedPrecondition("registry client is closed")
            client = self._clients.get(key)
            if client is None:
                verify: bool | ssl.SSLContext = False if plain else (
                    ep.ssl_verify() if ep is not None else True)
                client = httpx.Client(
                    verify=verify,
                    limits=self._limits, follow_redirects=False, trust_env=False,
                    # byte ranges and digests are of the stored bytes: no transfer encoding
                    headers={"User-Agent": self._user_agent, "Accept-Encoding": "identity"})
                self._clients[key] = client
            return client

    def timeouts(self, deadline: Deadline) -> httpx.Timeout:
        """httpx's per-wait timeouts for one attempt: ``timeout``, none past ``deadline``."""
        left = max(deadline.check(), 0.001)
        return httpx.Timeout(min(left, self.timeout), connect=min(left, 10.0),
                             pool=min(left, self.timeout))

    def tls_context(self, ep: Endpoint, url: str) -> ssl.SSLContext | None:
        """The TLS context for ``url``: the endpoint's own settings on its host, else None
        (default verification); built once per setting (a context costs ~0.5 s of CPU)."""
        if urlsplit(url).netloc != ep.host:
            return None
        key = ep.tls_key()
        with self._lock:
            if key in self._tls_contexts:
                return self._tls_contexts[key]
        verify = ep.ssl_verify()
        ctx: ssl.SSLContext | None
        if verify is True:
            ctx = None
        elif verify is False:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx = verify
        with self._lock:
            return self._tls_contexts.setdefault(key, ctx)
