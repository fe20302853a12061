"""Sinks: where state changes go. Any combination; each gets every change, in order.

* :class:`RedisSink` (``redis://``, ``rediss://``, ``valkey://``) — one
  ``FCALL coldstart_v2_update`` per change: epoch check, state, the pool routers pick from,
  heartbeat and ``PUBLISH`` in one atomic call; plus a heartbeat (``FCALL
  coldstart_v2_heartbeat``) that keeps the target's TTL alive. The functions are loaded into the
  store only when it lacks them (once per store, not once per sink).
* :class:`WebhookSink` (``http://``, ``https://``) — POST the JSON document, retried with backoff.
* :class:`KubernetesSink` (``k8s://``) — a pod condition for ``readinessGates``
  (``PATCH pods/<name>/status``), patched only when the condition changes; the service-account
  token file is read again for each request (projected tokens rotate).

:func:`make_sink` builds one from a ``--sink`` URL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import random
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from coldstart.config import ProbeTimingConfig
from coldstart.errors import InvalidArgument, Unavailable
from coldstart.probe.router import (
    LIBRARY,
    LIBRARY_NAME,
    channel,
    function,
    keys,
    loaded_by_another,
    missing_library,
)
from coldstart.probe.states import State, Status

__all__ = ["KubernetesSink", "RedisSink", "Sink", "WebhookSink", "make_sink"]

_T = ProbeTimingConfig()  # the defaults, written once in coldstart.config

log = logging.getLogger("coldstart.probe")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Sink(Protocol):
    """Receives every state change of one target. ``publish`` raises Unavailable on failure."""

    name: str

    async def start(self) -> None: ...

    async def publish(self, status: Status) -> None: ...

    async def heartbeat(self) -> None: ...

    async def close(self) -> None: ...


class RedisSink:
    """Routing state in Valkey/Redis through the functions of :mod:`coldstart.probe.router`.

    ``ttl`` (s): a target whose heartbeat is older than this is never picked.

    >>> sink = RedisSink("redis://127.0.0.1:6379/0", service="llama", target="10.0.0.5:8000")
    """

    def __init__(
        self, url: str, service: str, target: str, *, ttl: float = _T.ttl,
        timeout: float = _T.redis_timeout, capacity: int = 0,
    ) -> None:
        import redis.asyncio

        if url.startswith("valkey://"):
            url = "redis://" + url[len("valkey://"):]
        self.name = url.split("@")[-1]
        try:
            self.client = redis.asyncio.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                decode_responses=True,
            )
        except ValueError as exc:
            raise InvalidArgument(f"bad Redis URL {url!r}: {exc}") from exc
        if ttl <= 0 or capacity < 0:
            raise InvalidArgument("heartbeat TTL must be positive and capacity not negative")
        self.service, self.target = service, target
        self.keys, self.channel = keys(service), channel(service)
        self.ttl_ms = max(1, int(ttl * 1000))
        self.capacity = capacity
        self.last: Status | None = None
        self.superseded = False

    async def _fcall(self, name: str, *args: object) -> Any:
        import redis

        fn = function(name)
        for attempt in (0, 1):
            try:
                return await self.client.fcall(fn, len(self.keys), *self.keys, *args)
            except redis.ResponseError as exc:
                if attempt == 0 and missing_library(exc):
                    await self._load()  # a fresh store, or one that lost its functions
                    continue
                raise Unavailable(f"{fn} on {self.name}: {exc}") from exc
            except (redis.RedisError, OSError) as exc:
                raise Unavailable(f"{fn} on {self.name}: {exc}") from exc
        raise AssertionError("unreachable")

    async def _load(self) -> None:
        import redis

        try:
            await self.client.function_load(LIBRARY)
        except redis.ResponseError as exc:
            if not loaded_by_another(exc):  # a replica, an ACL without FUNCTION, …
                raise Unavailable(
                    f"cannot load the coldstart functions into {self.name}: {exc}"
                ) from exc
        except (redis.RedisError, OSError) as exc:
            raise Unavailable(
                f"cannot load the coldstart functions into {self.name}: {exc}"
            ) from exc
        else:
            log.info("%s: loaded the coldstart functions (%s)", self.name, LIBRARY_NAME)

    async def start(self) -> None:
        try:
            await self._fcall("list", "0", 1)
        except Unavailable as exc:
            log.warning("redis sink not reachable yet (will retry): %s", exc)

    async def publish(self, status: Status) -> None:
        doc = json.dumps(status.to_json(self.target, self.service), separators=(",", ":"))
        applied = await self._fcall(
            "update", self.target, status.epoch, status.state.value, doc,
            self.ttl_ms, self.channel, self.capacity,
        )
        resent = self.last is not None and status.epoch <= self.last.epoch
        if self.last is None or status.epoch >= self.last.epoch:
            self.last = status  # never back to an older state (a resend racing a newer one)
        if int(applied) == 0 and not resent and not self.superseded:
            # refused, and not a resend of what this sink already wrote: another writer's
            self.superseded = True
            log.warning("%s: a writer with a newer epoch owns %s; update %s dropped",
                        self.name, self.target, status.epoch)

    async def heartbeat(self) -> None:
        if self.last is None:
            return
        answer = int(await self._fcall(
            "heartbeat", self.target, self.last.epoch, self.ttl_ms
        ))
        if answer == -1:
            # the store forgot us (restart without persistence): write the state again
            await self.publish(self.last)

    async def close(self) -> None:
        await self.client.aclose()


async def _backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> None:
    delay = min(cap, base * 2**attempt)
    await asyncio.sleep(delay * (0.5 + random.random() / 2))


class WebhookSink:
    """POST each change as JSON to ``url``; 5xx and network errors are retried with backoff.

    >>> sink = WebhookSink("http://router.internal/targets", service="llama", target="pod-a")
    """

    def __init__(
        self, url: str, service: str, target: str, *, timeout: float = _T.http_timeout,
        retries: int = _T.sink_retries,
    ) -> None:
        import httpx

        self.name = url
        self.url, self.service, self.target, self.retries = url, service, target, retries
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout))

    async def start(self) -> None:
        return None

    async def publish(self, status: Status) -> None:
        import httpx

        doc = status.to_json(self.target, self.service)
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await _backoff(attempt - 1)
            try:
                response = await self.client.post(self.url, json=doc)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code < 300:
                return
            last = f"HTTP {response.status_code}"
            if response.status_code < 500 and response.status_code != 429:
                break  # the receiver refuses this document; sending it again will not help
        raise Unavailable(f"webhook {self.url}: {last}")

    async def heartbeat(self) -> None:
        return None

    async def close(self) -> None:
        await self.client.aclose()


class KubernetesSink:
    """A pod condition (``readinessGates``): status True only while READY.

    ``api`` defaults to the in-cluster API server with the service account's token file and CA.
    ``token_file`` is read again before every request, since a projected service-account token
    rotates (hourly) and the old one stops working; a PATCH goes out only when the condition
    changes, so the read costs nothing that matters. A 401 is retried once, with the file read
    afresh. ``token`` is a fixed token instead.

    >>> sink = KubernetesSink("default", "llama-0", api="http://127.0.0.1:8001")
    """

    def __init__(
        self, namespace: str, pod: str, *, api: str | None = None,
        condition: str = "coldstart.dev/ready", token: str | None = None,
        token_file: str | None = None, ca: str | None = None, timeout: float = _T.http_timeout,
        retries: int = _T.sink_retries,
    ) -> None:
        import httpx

        if not namespace or not pod:
            raise InvalidArgument(
                "kubernetes sink needs a namespace and pod name (k8s://NAMESPACE/POD or "
                "POD_NAMESPACE/POD_NAME in the environment)"
            )
        if api is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise InvalidArgument("not in a cluster: give the API server as ?api=URL")
            api = f"https://{host}:{port}"
            if ca is None and (SA_DIR / "ca.crt").exists():
                ca = str(SA_DIR / "ca.crt")
            if token is None and token_file is None and (SA_DIR / "token").exists():
                token_file = str(SA_DIR / "token")
        self.name = f"k8s {namespace}/{pod}"
        self.url = f"{api.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}/status"
        self.condition, self.retries = condition, retries
        self.token_file = token_file
        self._token = token
        if token_file is not None:
            try:
                self._token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise InvalidArgument(
                    f"cannot read the token file {token_file}: {exc.strerror or exc}; give a "
                    "readable file (token_file=PATH)"
                ) from exc
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout), verify=ca if ca else True,
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        self._sent: tuple[str, str] | None = None

    def _headers(self) -> dict[str, str]:
        """Authorization with the token as it is now: the file is read again each time."""
        if self.token_file is not None:
            try:
                fresh = Path(self.token_file).read_text().strip()
            except OSError as exc:  # mid-rotation or gone: the last token may still work
                log.warning("%s: cannot read the token file %s (%s); sending the last token",
                            self.name, self.token_file, exc.strerror or exc)
            else:
                if fresh:
                    self._token = fresh
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    async def start(self) -> None:
        return None

    async def publish(self, status: Status) -> None:
        import httpx

        value = "True" if status.state is State.READY else "False"
        if self._sent == (value, status.state.value):
            return  # progress-only change: the condition is the same
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {"conditions": [{
            "type": self.condition, "status": value, "reason": status.state.value.title(),
            "message": status.detail[:1000], "lastProbeTime": now, "lastTransitionTime": now,
        }]}}
        last, hint = "", ""
        attempt, reauth = 0, self.token_file is not None
        while True:
            try:
                response = await self.client.patch(
                    self.url, content=json.dumps(body), headers=self._headers(),
                )
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                code = response.status_code
                if code < 300:
                    self._sent = (value, status.state.value)
                    return
                last = f"HTTP {code}: {' '.join(response.text[:200].split())}"
                if code == 401 and reauth:
                    reauth = False  # the token rotated under us: once more, read afresh
                    continue
                if code < 500 and code not in (409, 429):
                    hint = {
                        401: "; the API server refused the service-account token",
                        403: "; the service account may not patch pods/status (RBAC)",
                    }.get(code, "")
                    break  # sending the same document again will not help
            if attempt >= self.retries:
                break
            await _backoff(attempt)
            attempt += 1
        raise Unavailable(f"PATCH {self.url}: {last}{hint}")

    async def heartbeat(self) -> None:
        return None

    async def close(self) -> None:
        await self.client.aclose()


def make_sink(
    url: str, service: str, target: str, *, ttl: float = _T.ttl, capacity: int = 0,
) -> Sink:
    """Build the sink a ``--sink`` URL names.

    >>> make_sink("valkey://127.0.0.1:6379/0", "llama", "10.0.0.5:8000").name
    '127.0.0.1:6379/0'
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ("redis", "rediss", "valkey", "valkeys", "unix"):
        if parts.scheme == "valkeys":
            url = "rediss://" + url[len("valkeys://"):]
        return RedisSink(url, service, target, ttl=ttl, capacity=capacity)
    if parts.scheme in ("http", "https"):
        return WebhookSink(url, service, target)
    if parts.scheme in ("k8s", "kubernetes"):
        query = dict(urllib.parse.parse_qsl(parts.query))
        path = [p for p in (parts.netloc + parts.path).split("/") if p]
        namespace = path[0] if len(path) == 2 else os.environ.get("POD_NAMESPACE", "")
        if not namespace and (SA_DIR / "namespace").exists():
            namespace = (SA_DIR / "namespace").read_text().strip()
        pod = path[1] if len(path) == 2 else os.environ.get("POD_NAME", "")
        return KubernetesSink(
            namespace, pod, api=query.get("api"), token_file=query.get("token_file"),
            ca=query.get("ca"), condition=query.get("condition", "coldstart.dev/ready"),
        )
    raise InvalidArgument(
        f"unknown sink {url!r}: use redis://, valkey://, http(s):// (webhook) or "
        "k8s://NAMESPACE/POD"
    )
