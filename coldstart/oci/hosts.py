"""Where to send a registry's requests: containerd's ``certs.d/<host>/hosts.toml`` plus defaults.

A ``hosts.toml`` names a ``server`` (the upstream) and any number of ``[host."URL"]`` mirrors,
each with ``capabilities`` (``pull``, ``resolve``, ``push``), ``skip_verify``, ``ca``, ``client``,
``header`` and ``override_path``. Mirrors are tried in file order, then the server. Loopback hosts
and hosts named insecure are spoken to over plain HTTP.
"""

from __future__ import annotations

import ipaddress
import ssl
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coldstart.errors import InvalidArgument

__all__ = ["ALL_CAPABILITIES", "Endpoint", "HostsConfig", "is_loopback"]

ALL_CAPABILITIES = frozenset({"pull", "resolve", "push"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``name[:port]``) is this machine."""
    name = host
    if name.startswith("["):
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Endpoint:
    """One place that serves a registry's API: ``base`` ends in ``/v2`` (unless overridden)."""

    base: str
    capabilities: frozenset[str] = ALL_CAPABILITIES
    verify: bool | str | tuple[str, ...] = True
    client_cert: tuple[str, str] | str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    mirror_of: str | None = None   # the registry this mirror stands in for (sent as ?ns=)

    @property
    def host(self) -> str:
        return urlsplit(self.base).netloc

    def tls_key(self) -> tuple[Any, ...]:
        """What distinguishes the HTTP client (connection pool) this endpoint needs."""
        return (self.verify, self.client_cert)

    def ssl_verify(self) -> bool | ssl.SSLContext:
        """The ``verify`` argument for httpx: ``False``, ``True`` or a context with our CAs."""
        if self.verify is False:
            return False
        if self.verify is True and self.client_cert is None:
            return True
        ctx = ssl.create_default_context()
        cas = (self.verify,) if isinstance(self.verify, str) else (
            self.verify if isinstance(self.verify, tuple) else ())
        for ca in cas:
            ctx.load_verify_locations(cafile=ca)
        if isinstance(self.client_cert, tuple):
            ctx.load_cert_chain(self.client_cert[0], self.client_cert[1])
        elif isinstance(self.client_cert, str):
            ctx.load_cert_chain(self.client_cert)
        return ctx


def _url_for(raw: str, override_path: bool) -> str:
    parts = urlsplit(raw if "://" in raw else f"https://{raw}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidArgument(f"invalid registry host URL {raw!r} in hosts.toml")
    path = parts.path.rstrip("/")
    if not override_path and not path.endswith("/v2"):
        path = f"{path}/v2"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _verify_of(entry: Mapping[str, Any], where: Path) -> bool | str | tuple[str, ...]:
    if entry.get("skip_verify"):
        return False
    ca = entry.get("ca")
    if ca is None:
        return True
    cas = [ca] if isinstance(ca, str) else list(ca)
    resolved = tuple(str(c if Path(c).is_absolute() else where.parent / c) for c in cas)
    return resolved[0] if len(resolved) == 1 else resolved


def _client_of(entry: Mapping[str, Any], where: Path) -> tuple[str, str] | str | None:
    client = entry.get("client")
    if client is None:
        return None

    def rel(p: str) -> str:
        return str(p if Path(p).is_absolute() else where.parent / p)

    if isinstance(client, str):
        return rel(client)
    first = client[0] if client else None
    if isinstance(first, list) and len(first) == 2:
        return (rel(first[0]), rel(first[1]))
    if isinstance(first, str):
        return rel(first)
    raise InvalidArgument(f"{where}: unsupported 'client' value {client!r}")


def _capabilities(entry: Mapping[str, Any], where: Path) -> frozenset[str]:
    caps = entry.get("capabilities")
    if caps is None:
        return ALL_CAPABILITIES
    bad = set(caps) - ALL_CAPABILITIES
    if bad:
        raise InvalidArgument(f"{where}: unknown capabilities {sorted(bad)}")
    return frozenset(caps)


@dataclass(frozen=True)
class HostsConfig:
    """Registry endpoint resolution: a ``certs.d`` directory and a set of plain-HTTP hosts."""

    hosts_dir: Path | None = None
    insecure_hosts: frozenset[str] = frozenset()
    tls_verify: bool = True

    @classmethod
    def create(cls, hosts_dir: Path | None = None, insecure_hosts: Iterable[str] = (), *,
               tls_verify: bool = True) -> HostsConfig:
        return cls(hosts_dir=hosts_dir, insecure_hosts=frozenset(insecure_hosts),
                   tls_verify=tls_verify)

    def is_insecure(self, host: str) -> bool:
        """Whether ``host[:port]`` is named insecure: exactly, or by its host without a port."""
        if host in self.insecure_hosts:
            return True
        name, sep, port = host.rpartition(":")
        return bool(sep) and port.isdigit() and name in self.insecure_hosts

    def _default(self, host: str) -> Endpoint:
        scheme = "http" if (self.is_insecure(host) or is_loopback(host)) else "https"
        api = "registry-1.docker.io" if host == "docker.io" else host
        return Endpoint(base=f"{scheme}://{api}/v2", verify=self.tls_verify)

    def _file_for(self, host: str) -> Path | None:
        if self.hosts_dir is None:
            return None
        for name in (host, host.replace(":", "_"), "_default"):
            candidate = self.hosts_dir / name / "hosts.toml"
            if candidate.is_file():
                return candidate
        return None

    def endpoints(self, host: str, capability: str) -> list[Endpoint]:
        """Endpoints able to do ``capability`` for registry ``host``, in the order to try them."""
        path = self._file_for(host)
        if path is None:
            return [self._default(host)]
        try:
            doc = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read {path}: {exc}") from exc
        out: list[Endpoint] = []
        hosts = doc.get("host") or {}
        if not isinstance(hosts, dict):
            raise InvalidArgument(f"{path}: [host] must be a table of URLs")
        for raw, entry in hosts.items():
            if not isinstance(entry, dict):
                raise InvalidArgument(f"{path}: [host.{raw!r}] must be a table")
            ep = Endpoint(
                base=_url_for(raw, bool(entry.get("override_path"))),
                capabilities=_capabilities(entry, path),
                verify=_verify_of(entry, path) if self.tls_verify else False,
                client_cert=_client_of(entry, path),
                headers={str(k): str(v if isinstance(v, str) else v[0])
                         for k, v in (entry.get("header") or {}).items()},
                mirror_of=host,
            )
            if self._insecure(ep):
                ep = Endpoint(base=ep.base.replace("https://", "http://", 1),
                              capabilities=ep.capabilities, verify=False,
                              headers=ep.headers, mirror_of=host)
            out.append(ep)
        server = doc.get("server")
        if server is not None:
            top = {k: v for k, v in doc.items() if k != "host"}
            out.append(Endpoint(
                base=_url_for(str(server), bool(top.get("override_path"))),
                capabilities=_capabilities(top, path),
                verify=_verify_of(top, path) if self.tls_verify else False,
                client_cert=_client_of(top, path),
                headers={str(k): str(v if isinstance(v, str) else v[0])
                         for k, v in (top.get("header") or {}).items()},
            ))
        else:
            out.append(self._default(host))
        usable = [e for e in out if capability in e.capabilities]
        if not usable:
            raise InvalidArgument(f"{path}: no host has the {capability!r} capability")
        return usable

    def _insecure(self, ep: Endpoint) -> bool:
        return ep.base.startswith("https://") and self.is_insecure(ep.host)
