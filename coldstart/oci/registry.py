"""A thin, thread-safe client for the OCI distribution API (v2) over httpx.

This module is the one place that speaks HTTP to registries and maps registry statuses to
:mod:`coldstart.errors` (httpx's own errors through :mod:`coldstart.remote.errors`; retries,
backoff and deadlines through :mod:`coldstart.remote.retry`; uploads in :mod:`.uploads`):

- 404 → :class:`NotFound`; 401/403 → :class:`AuthError`; 416 → :class:`InvalidArgument`;
- 5xx, 429, connection errors → retried with exponential backoff and full jitter inside the
  call's deadline, then :class:`Unavailable`; an exhausted deadline → :class:`DeadlineExceeded`;
- a downloaded blob or manifest whose bytes do not match its digest → :class:`IntegrityError`.

Every public call takes ``timeout`` (seconds, covering all its retries); the client's default is
``RegistryConfig.timeout`` (30 s). One client may be shared by many threads (httpx's pool is
thread-safe; our token cache is locked).

>>> with RegistryClient() as client:                                  # doctest: +SKIP
...     resolved = client.resolve(Reference.parse("127.0.0.1:5000/app:v1"))
...     layer = resolved.manifest.layers[0]
...     head = client.read_blob_range(resolved.ref, layer.digest, 0, 512)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, NoReturn
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from coldstart.config import RegistryConfig
from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.oci.credentials import Credentials, DockerConfig, default_docker_config
from coldstart.oci.hosts import Endpoint, HostsConfig
from coldstart.oci.keychain import Keychain
from coldstart.oci.manifest import (
    ALL_MANIFEST_TYPES,
    OCI_INDEX,
    Descriptor,
    Index,
    Manifest,
    Platform,
    digest_of,
    is_index,
    parse_index,
    parse_manifest,
    select_platform,
)
from coldstart.oci.reference import Reference, validate_digest
from coldstart.remote.errors import BODY_ERRORS, RETRY_STATUS, is_tls_failure, map_http_error
from coldstart.remote.rangeconn import REDIRECT_STATUSES, Declined, RangeConnections
from coldstart.remote.retry import Again, Backoff, Deadline, only_again
from coldstart.remote.retry import retry as retry_call

__all__ = ["AuthError", "RegistryClient", "Resolved"]

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 4 << 20
_MAX_SMALL_BODY = 16 << 20   # manifests, tokens, error documents: never a blob
_CHUNK = 1 << 20
#: seconds an endpoint whose direct range read got no answer goes through the general client
_DIRECT_BACKOFF = 60.0
_USER_AGENT = "coldstart/0.1"
# the repository an auth scope names: "repository:NAME:pull,push" (the first, for a mount)
_SCOPE_REPO = re.compile(r"(?:^| )repository:([^: ]+):")
_REGISTRY = RegistryConfig()  # the defaults, written once in coldstart.config


class AuthError(FailedPrecondition):
    """The registry refused our credentials, or wants credentials we do not have."""

    grpc_code = "PERMISSION_DENIED"
    exit_code = 10
    errno = 13  # EACCES


@dataclass(frozen=True)
class Resolved:
    """An image reference resolved to one platform's manifest."""

    ref: Reference                  # pinned to the manifest's digest
    manifest: Manifest
    manifest_bytes: bytes
    media_type: str
    digest: str
    index: Index | None = None      # set when the reference named an index
    index_digest: str | None = None


@dataclass
class _Token:
    value: str
    expires: float


_CHALLENGE_RE = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def _scope_repository(scope: str) -> str | None:
    m = _SCOPE_REPO.search(scope)
    return m.group(1) if m else None


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
              for m in _CHALLENGE_RE.finditer(rest)}
    return scheme.lower(), params


def _registry_message(resp: httpx.Response) -> str:
    try:
        doc = resp.json()
        errs = doc.get("errors") or []
        if errs:
            return "; ".join(f"{e.get('code', '')}: {e.get('message', '')}".strip(": ")
                             for e in errs if isinstance(e, dict))
    except Exception:  # the body is only a hint for the message
        pass
    return resp.reason_phrase or ""


def _content_range_starts(resp: httpx.Response, offset: int) -> bool:
    m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == offset


_BodyFactory = Callable[[], bytes | Iterator[bytes]]


class RegistryClient:
    """Client for OCI registries: manifests, blobs (ranges too), uploads, mounts.

    ``insecure_hosts`` are spoken to over plain HTTP (loopback always is; a host without a port
    means every port of it); ``tls_verify=False`` trusts any certificate; ``hosts_dir`` is a
    containerd ``certs.d`` directory (mirrors, TLS); ``docker_config`` the Docker ``config.json``
    with credentials (default ``~/.docker/config.json``); ``credentials`` overrides per host.
    ``keychain``: credentials kubelet handed over in CRI ``PullImage``, by repository, looked up
    before the docker config and read again on every lookup (a rotated token is used as soon as
    the CRI proxy wrote it).
    ``timeout`` is the default deadline of every call, ``retries`` how many times a failed
    attempt is retried inside it.
    """

    def __init__(self, *, insecure_hosts: Iterable[str] = (), docker_config: Path | None = None,
                 hosts_dir: Path | None = None, tls_verify: bool = True,
                 timeout: float = _REGISTRY.timeout,
                 retries: int = _REGISTRY.retries,
                 backoff: float = 0.2, max_backoff: float = 5.0,
                 credentials: Mapping[str, Credentials | tuple[str, str]] | None = None,
                 max_connections: int = 64, blob_timeout: float = 3600.0,
                 user_agent: str = _USER_AGENT, keychain: Keychain | None = None) -> None:
        if timeout <= 0 or retries < 0:
            raise InvalidArgument("timeout must be > 0 and retries >= 0")
        self.timeout = timeout
        self.blob_timeout = blob_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._backoff = Backoff(backoff, max_backoff)
        self.hosts = HostsConfig.create(hosts_dir, insecure_hosts, tls_verify=tls_verify)
        static = {h: c if isinstance(c, Credentials) else Credentials(*c)
                  for h, c in (credentials or {}).items()}
        self.creds = DockerConfig(docker_config or default_docker_config(), static=static)
        self.keychain = keychain
        self._limits = httpx.Limits(max_connections=max_connections,
                                    max_keepalive_connections=max_connections)
        self._user_agent = user_agent
        self._lock = threading.Lock()
        self._clients: dict[tuple[Any, ...], httpx.Client] = {}
        self._tokens: dict[tuple[str, str], _Token] = {}
        # (host, repository) -> (first choice when it was refused, the candidate used instead)
        self._chosen: dict[tuple[str, str | None], tuple[Credentials, Credentials]] = {}
        self._schemes: dict[str, tuple[str, dict[str, str]]] = {}
        self._endpoint_cache: dict[tuple[str, str], list[Endpoint]] = {}
        # range reads of blobs: straight into a buffer (see coldstart.remote.rangeconn)
        self._ranges = RangeConnections(max_idle=max_connections, user_agent=user_agent)
        self._tls_contexts: dict[tuple[Any, ...], ssl.SSLContext | None] = {}
        # (endpoint, repository) whose range reads go direct, with the Authorization they go
        # with: set once the general client read a range there with no credentials or a
        # bearer token (Basic credentials, which the CRI keychain rotates, stay with it)
        self._direct_ok: dict[tuple[str, str], str] = {}
        self._direct_off: dict[str, float] = {}     # endpoint -> monotonic time to retry
        self._multi_off: set[str] = set()   # endpoints that do not answer multi-range requests
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close every pooled connection."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self._closed = True
        for c in clients:
            c.close()
        self._ranges.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _client(self, ep: Endpoint | None) -> httpx.Client:
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

    # -- the request engine ----------------------------------------------------------------

    def _timeouts(self, deadline: Deadline) -> httpx.Timeout:
        left = max(deadline.check(), 0.001)
        return httpx.Timeout(min(left, self.timeout), connect=min(left, 10.0),
                             pool=min(left, self.timeout))

    def _auth_header(self, ep: Endpoint, scope: str) -> str | None:
        host = ep.host
        with self._lock:
            scheme = self._schemes.get(host)
            if scheme is None:
                return None
            if scheme[0] == "bearer":
                tok = self._tokens.get((host, scope))
                if tok is not None and tok.expires > time.monotonic():
                    return f"Bearer {tok.value}"
                return None
        if scheme[0] == "basic":
            # built per request from a fresh lookup: rotated keychain credentials apply at once
            creds = self._creds_for(ep, scope)
            if creds is not None:
                raw = f"{creds.username}:{creds.secret}".encode()
                return "Basic " + base64.b64encode(raw).decode()
        return None

    def _creds_for(self, ep: Endpoint, scope: str = "") -> Credentials | None:
        """Credentials for ``ep``: per host (the endpoint's own, then for a mirror the host it
        mirrors), the CRI keychain's for the scope's repository first, then the docker config's;
        or the candidate that worked after the registry refused the first one.
        The keychain is read each time; kubelet may have handed over new ones since."""
        repository = _scope_repository(scope)
        with self._lock:
            chosen = self._chosen.get((ep.host, repository))
        if chosen is not None:
            cands = self._candidates(ep, repository)
            # still valid while the first choice is what it was (a new PullImage resets it)
            if cands and cands[0] == chosen[0] and chosen[1] in cands:
                return chosen[1]
            with self._lock:
                self._chosen.pop((ep.host, repository), None)
            return cands[0] if cands else None
        for host in (ep.host, ep.mirror_of) if ep.mirror_of else (ep.host,):
            if self.keychain is not None:
                found = self.keychain.get(host, repository)
                if found is not None:
                    return found
            found = self.creds.lookup(host)
            if found is not None:
                return found
        return None

    def _candidates(self, ep: Endpoint, repository: str | None) -> list[Credentials]:
        """Every credential that may do for ``ep``, in :meth:`_creds_for`'s order."""
        out: list[Credentials] = []
        for host in (ep.host, ep.mirror_of) if ep.mirror_of else (ep.host,):
            if self.keychain is not None:
                out.extend(self.keychain.candidates(host, repository))
            found = self.creds.lookup(host)
            if found is not None:
                out.append(found)
        return list(dict.fromkeys(out))

    def _next_creds(self, ep: Endpoint, scope: str, refused: list[Credentials]) -> bool:
        """The registry refused what :meth:`_creds_for` gives: switch to the next candidate
        not yet refused in this request; False if none is left."""
        current = self._creds_for(ep, scope)
        if current is None or len(refused) >= 8:
            return False
        refused.append(current)
        repository = _scope_repository(scope)
        cands = self._candidates(ep, repository)
        with self._lock:
            self._tokens.pop((ep.host, scope), None)
            for c in cands:
                if c not in refused:
                    self._chosen[(ep.host, repository)] = (cands[0], c)
                    return True
            # all refused: start from the first choice again (and name it in the error)
            self._chosen.pop((ep.host, repository), None)
        return False

    def _where_creds(self) -> str:
        """Where credentials were looked for, for an error message."""
        where = f"docker config {self.creds.path}"
        return where + (f" or CRI keychain {self.keychain.directory}"
                        if self.keychain is not None else "")

    def _authenticate(self, ep: Endpoint, challenge: str, scope: str,
                      deadline: Deadline) -> bool:
        """Answer a 401 challenge; return whether a retry with new credentials makes sense."""
        scheme, params = _parse_challenge(challenge)
        host = ep.host
        creds = self._creds_for(ep, scope)
        if scheme == "basic":
            with self._lock:
                known = self._schemes.get(host)
                self._schemes[host] = ("basic", params)
            return creds is not None and known is None
        if scheme != "bearer" or "realm" not in params:
            raise AuthError(f"{host}: unsupported authentication challenge {challenge!r}")
        with self._lock:
            # the token was refused (expired early, or its credentials were revoked): never
            # send it again, whatever the token server answers now
            self._tokens.pop((host, scope), None)
        token = self._fetch_token(ep, params, scope, creds, deadline)
        with self._lock:
            self._schemes[host] = ("bearer", params)
            self._tokens[(host, scope)] = token
        return True

    def _fetch_token(self, ep: Endpoint, params: Mapping[str, str], scope: str,
                     creds: Credentials | None, deadline: Deadline) -> _Token:
        realm = params["realm"]
        if urlsplit(realm).scheme not in ("http", "https"):
            raise AuthError(f"{ep.host}: bad token realm {realm!r}")
        query: list[tuple[str, str]] = []
        if params.get("service"):
            query.append(("service", params["service"]))
        query.extend(("scope", s) for s in scope.split(" ") if s)
        headers: dict[str, str] = {}
        method = "GET"
        content: bytes | None = None
        if creds is not None and creds.is_identity_token:
            # OAuth2 refresh-token flow (what `docker login` stores as identitytoken)
            method = "POST"
            form = {"grant_type": "refresh_token", "refresh_token": creds.secret,
                    "service": params.get("service", ""), "scope": scope,
                    "client_id": "coldstart"}
            content = urlencode(form).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            url = realm
        else:
            if creds is not None:
                raw = f"{creds.username}:{creds.secret}".encode()
                headers["Authorization"] = "Basic " + base64.b64encode(raw).decode()
            url = realm + ("&" if "?" in realm else "?") + urlencode(query)
        client = self._client(ep)

        def once(_: float) -> httpx.Response:
            try:
                resp = client.request(method, url, headers=headers, content=content,
                                      timeout=self._timeouts(deadline))
            except httpx.TransportError as exc:
                raise map_http_error(exc, f"token server {realm}") from exc
            if resp.status_code in RETRY_STATUS:
                raise Unavailable(f"token server {realm} answered {resp.status_code}")
            return resp

        resp = retry_call(once, what=f"token server {realm}", deadline=deadline,
                     retries=self.retries, backoff=self._backoff)
        if resp.status_code in (401, 403):
            who = f"as {creds.username!r}" if creds else "anonymously (no credentials found)"
            raise AuthError(f"{ep.host}: token server refused {scope!r} {who}")
        if resp.status_code != 200:
            raise Unavailable(f"token server {realm} answered {resp.status_code}")
        try:
            doc = resp.json()
            value = str(doc.get("token") or doc.get("access_token") or "")
            ttl = float(doc.get("expires_in") or 60)
        except (ValueError, AttributeError) as exc:
            raise Unavailable(f"token server {realm} answered something that is not JSON") \
                from exc
        if not value:
            raise AuthError(f"token server {realm} gave no token for {scope!r}")
        # renew a little early so a token does not expire mid-request
        return _Token(value=value, expires=time.monotonic() + max(ttl - 10.0, ttl / 2))

    def _send(self, ep: Endpoint, method: str, url: str, *, scope: str,
              headers: Mapping[str, str], body: _BodyFactory | None, deadline: Deadline,
              stream: bool) -> httpx.Response:
        """One attempt, with authentication and redirects; the caller handles statuses."""
        client = self._client(ep)
        authed_once = False
        refused: list[Credentials] = []   # candidates the registry refused in this request
        while True:
            hdrs = {**ep.headers, **headers}
            auth = self._auth_header(ep, scope)
            if auth:
                hdrs["Authorization"] = auth
            req = client.build_request(method, url, headers=hdrs,
                                       content=body() if body else None,
                                       timeout=self._timeouts(deadline))
            resp = client.send(req, stream=True)
            if resp.status_code == 401 and not authed_once:
                challenge = resp.headers.get("WWW-Authenticate", "")
                resp.close()
                if not challenge:
                    raise AuthError(f"{ep.host}: 401 Unauthorized without a challenge")
                authed_once = True
                try:
                    if self._authenticate(ep, challenge, scope, deadline):
                        continue
                except AuthError:
                    # the token server refused these credentials; others may do
                    if self._next_creds(ep, scope, refused):
                        authed_once = False
                        continue
                    raise
                # Basic auth already known: retry if the credentials changed since this
                # request was built (the CRI proxy wrote rotated ones meanwhile), or with the
                # next candidate
                if auth is not None and self._auth_header(ep, scope) not in (None, auth):
                    continue
                if auth is not None and self._next_creds(ep, scope, refused):
                    continue
                creds = self._creds_for(ep, scope)
                if creds is not None:
                    raise AuthError(f"{ep.host}: credentials for {creds.username!r} refused")
                raise AuthError(f"{ep.host}: authentication required and no credentials "
                                f"found ({self._where_creds()})")
            if resp.status_code == 401 and auth is not None and \
                    self._next_creds(ep, scope, refused):
                # refused after authenticating: e.g. a password changed on the registry that
                # kubelet has handed over so far only with another image of this registry
                resp.close()
                authed_once = False
                continue
            break
        hops = 0
        while resp.status_code in REDIRECT_STATUSES and method in ("GET", "HEAD"):
            location = resp.headers.get("Location")
            resp.close()
            if not location or hops >= 5:
                raise Unavailable(f"{ep.host}: too many or empty redirects for {url}")
            hops += 1
            target = urljoin(url, location)
            hdrs = dict(headers)
            if urlsplit(target).netloc == urlsplit(url).netloc:
                auth = self._auth_header(ep, scope)
                if auth:
                    hdrs["Authorization"] = auth
            elif urlsplit(target).scheme == "https":
                # blob storage (S3, a CDN) must not see the registry's credentials, and is
                # verified like any TLS host unless this registry's hosts.toml says skip_verify
                client = self._client(ep if ep.verify is False or
                                      ep.base.startswith("https://") else None)
            url = target
            req = client.build_request(method, url, headers=hdrs,
                                       timeout=self._timeouts(deadline))
            resp = client.send(req, stream=True)
        if not stream:
            try:
                chunks = []
                total = 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > _MAX_SMALL_BODY:
                        raise Unavailable(f"{ep.host}: answer to {method} {url} is larger "
                                          f"than {_MAX_SMALL_BODY} bytes")
                    if deadline.remaining() <= 0:
                        raise httpx.ReadTimeout("deadline", request=req)
                # what Response.read() itself does; reading chunk by chunk lets the deadline
                # cut off a server that dribbles bytes (httpx's timeouts are per read)
                resp._content = b"".join(chunks)
            finally:
                resp.close()
        return resp

    def _request(self, ref: Reference, method: str, path: str, *, capability: str,
                 scope: str | None = None, headers: Mapping[str, str] | None = None,
                 params: Sequence[tuple[str, str]] = (), body: _BodyFactory | None = None,
                 ok: Iterable[int] = (200,), timeout: float | None = None,
                 stream: bool = False, retry: bool = True, what: str = "",
                 endpoints: Sequence[Endpoint] | None = None,
                 deadline: Deadline | None = None) -> httpx.Response:
        """Send to each endpoint in turn, retrying transient failures within one deadline."""
        what = what or f"{method} {ref.name}{path}"
        deadline = deadline or Deadline(timeout if timeout is not None else self.timeout, what)
        scope = scope or f"repository:{ref.repository}:pull"
        eps = list(endpoints) if endpoints is not None else \
            self._endpoints_for(ref.registry, capability)
        ok_set = frozenset(ok)
        last: ColdstartError | None = None
        for i, ep in enumerate(eps):
            query = list(params)
            if ep.mirror_of:
                query.append(("ns", ep.mirror_of))
            url = f"{ep.base}/{ref.repository}{path}"
            if query:
                url += "?" + urlencode(query)
            try:
                return self._attempts(ep, method, url, scope=scope, headers=headers or {},
                                      body=body, ok=ok_set, deadline=deadline, stream=stream,
                                      retry=retry, what=what)
            except (NotFound, Unavailable, AuthError) as exc:
                # a mirror that lacks the content, fails or refuses us: try the next host
                last = exc
                if isinstance(exc, DeadlineExceeded) or i == len(eps) - 1:
                    raise
        assert last is not None
        raise last

    def _attempts(self, ep: Endpoint, method: str, url: str, *, scope: str,
                  headers: Mapping[str, str], body: _BodyFactory | None, ok: frozenset[int],
                  deadline: Deadline, stream: bool, retry: bool, what: str) -> httpx.Response:
        tries = 0

        def once(_: float) -> httpx.Response:
            nonlocal tries
            tries += 1
            last = not retry or tries > self.retries
            try:
                resp = self._send(ep, method, url, scope=scope, headers=headers, body=body,
                                  deadline=deadline, stream=stream)
            except httpx.TimeoutException as exc:
                late = DeadlineExceeded(f"{what}: {ep.host} did not answer within "
                                        f"{deadline.seconds:g} s")
                if deadline.remaining() <= 0.01 or (retry and last):
                    raise late from exc
                if not retry:
                    # one attempt timed out, the call's deadline has not: the caller may
                    # start over (a new upload session)
                    raise Unavailable(f"{what}: {ep.host} timed out: {exc}") from exc
                raise Again(late, out_of_time=self._gave_up(what, ep, deadline, exc)) from exc
            except httpx.TransportError as exc:
                if is_tls_failure(exc):
                    # retrying cannot fix a certificate; say where to configure trust
                    raise Unavailable(
                        f"{what}: TLS verification of {ep.host} failed ({exc}); give its CA "
                        "with 'ca' in certs.d/<host>/hosts.toml (or skip_verify)") from exc
                lost = Unavailable(f"{what}: cannot reach {ep.host}: {exc}")
                if last:
                    raise lost from exc
                raise Again(lost, out_of_time=self._gave_up(what, ep, deadline, exc)) from exc
            if resp.status_code in ok:
                return resp
            if resp.status_code in RETRY_STATUS and not last:
                resp.close()
                retry_after = resp.headers.get("Retry-After", "")
                raise Again(Unavailable(f"{what}: {ep.host} answered {resp.status_code}"),
                            retry_after=min(float(retry_after), self.max_backoff)
                            if retry_after.isdigit() else 0.0)
            self._raise_for(resp, what, ep, scope)

        return retry_call(once, what=what, deadline=deadline, retries=self.retries,
                     backoff=self._backoff, classify=only_again)

    @staticmethod
    def _gave_up(what: str, ep: Endpoint, deadline: Deadline,
                 cause: BaseException) -> DeadlineExceeded:
        err = DeadlineExceeded(f"{what}: gave up on {ep.host} within {deadline.seconds:g} s "
                               f"({cause})")
        err.__cause__ = cause
        return err

    def _raise_for(self, resp: httpx.Response, what: str, ep: Endpoint,
                   scope: str = "") -> NoReturn:
        with contextlib.suppress(httpx.HTTPError):
            resp.read()
        resp.close()
        code = resp.status_code
        msg = _registry_message(resp)
        detail = f"{what}: {ep.host} answered {code}" + (f" ({msg})" if msg else "")
        if code == 404:
            raise NotFound(detail)
        if code in (401, 403):
            creds = self._creds_for(ep, scope)
            who = (f"as {creds.username!r}" if creds is not None
                   else f"anonymously (no credentials for {ep.host} in {self._where_creds()})")
            verb = "refused" if code == 401 else "denied access"
            raise AuthError(f"{detail}: {verb} {who}")
        if code == 416:
            raise InvalidArgument(detail)
        if code >= 500 or code in RETRY_STATUS:
            raise Unavailable(detail)
        if code == 400 and "DIGEST_INVALID" in msg:
            raise IntegrityError(detail)
        raise InvalidArgument(detail)

    # -- manifests -------------------------------------------------------------------------

    def get_manifest(self, ref: Reference, accept: Sequence[str] = ALL_MANIFEST_TYPES, *,
                     timeout: float | None = None) -> tuple[bytes, str, str]:
        """Fetch a manifest or index: ``(body, media_type, digest)``; verified when pinned."""
        capability = "pull" if ref.digest else "resolve"
        resp = self._request(ref, "GET", f"/manifests/{ref.reference}", capability=capability,
                             headers={"Accept": ", ".join(accept)}, timeout=timeout,
                             what=f"get manifest {ref}")
        body = resp.content
        if len(body) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"manifest {ref} is larger than {MAX_MANIFEST_BYTES} bytes")
        digest = digest_of(body)
        if ref.digest and ref.digest != digest and not ref.digest.startswith("sha512:"):
            raise IntegrityError(f"manifest {ref}: registry sent {digest}")
        header = resp.headers.get("Docker-Content-Digest")
        if not ref.digest and header and header.startswith("sha256:") and header != digest:
            raise IntegrityError(f"manifest {ref}: body is {digest}, registry says {header}")
        media = resp.headers.get("Content-Type", "").split(";")[0].strip()
        return body, media, ref.digest or digest

    def head_manifest(self, ref: Reference, accept: Sequence[str] = ALL_MANIFEST_TYPES, *,
                      timeout: float | None = None) -> Descriptor:
        """HEAD a manifest: its descriptor (media type, digest, size) without the body."""
        resp = self._request(ref, "HEAD", f"/manifests/{ref.reference}",
                             capability="pull" if ref.digest else "resolve",
                             headers={"Accept": ", ".join(accept)}, timeout=timeout,
                             what=f"head manifest {ref}")
        digest = resp.headers.get("Docker-Content-Digest") or ref.digest
        if not digest:
            body, media, digest = self.get_manifest(ref, accept, timeout=timeout)
            return Descriptor(media_type=media, digest=digest, size=len(body))
        return Descriptor(media_type=resp.headers.get("Content-Type", "").split(";")[0],
                          digest=validate_digest(digest),
                          size=int(resp.headers.get("Content-Length", "0")))

    def resolve(self, ref: Reference, platform: Platform | None = None, *,
                timeout: float | None = None) -> Resolved:
        """Resolve ``ref`` to one image manifest (choosing ``platform`` from an index)."""
        body, media, digest = self.get_manifest(ref, timeout=timeout)
        index: Index | None = None
        index_digest: str | None = None
        if is_index(media) or (not media and b'"manifests"' in body):
            index, index_digest = parse_index(body, media or None), digest
            desc = select_platform(index, platform)
            pinned = ref.with_digest(desc.digest)
            body, media, digest = self.get_manifest(pinned, timeout=timeout)
        manifest = parse_manifest(body, media or None)
        return Resolved(ref=ref.with_digest(digest), manifest=manifest, manifest_bytes=body,
                        media_type=manifest.media_type, digest=digest, index=index,
                        index_digest=index_digest)

    def push_manifest(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> str:
        """PUT a manifest or index under ``ref``'s tag (or digest); return its digest."""
        return self._put_manifest(ref, body, media_type, timeout=timeout)[0]

    def push_artifact(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> tuple[str, bool]:
        """PUT a manifest that names a ``subject``: its digest, and whether the registry took
        the subject (OCI 1.1: the ``OCI-Subject`` header; else the caller keeps the fallback
        tag up to date, see :mod:`coldstart.oci.referrers`)."""
        return self._put_manifest(ref, body, media_type, timeout=timeout)

    def _put_manifest(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> tuple[str, bool]:
        digest = digest_of(body)
        target = ref.tag if ref.tag and not ref.digest else digest
        if ref.digest and ref.digest != digest:
            raise InvalidArgument(f"push_manifest: body is {digest}, reference says {ref.digest}")
        resp = self._request(ref, "PUT", f"/manifests/{target}", capability="push",
                             scope=f"repository:{ref.repository}:pull,push",
                             headers={"Content-Type": media_type}, body=lambda: body,
                             ok=(200, 201, 202), timeout=timeout,
                             what=f"push manifest {ref}")
        echoed = resp.headers.get("Docker-Content-Digest")
        if echoed and echoed != digest:
            raise IntegrityError(f"push manifest {ref}: registry stored {echoed}, sent {digest}")
        return digest, "OCI-Subject" in resp.headers

    def get_referrers(self, ref: Reference, subject: str, artifact_type: str = "", *,
                      timeout: float | None = None) -> bytes:
        """The referrers API (OCI distribution 1.1): the index of manifests whose ``subject``
        is ``subject``. NotFound where the registry has no such API (the caller then reads the
        fallback tag, ``sha256-<hex>``)."""
        validate_digest(subject)
        params = [("artifactType", artifact_type)] if artifact_type else []
        resp = self._request(ref, "GET", f"/referrers/{subject}", capability="pull",
                             params=params, headers={"Accept": OCI_INDEX}, timeout=timeout,
                             what=f"referrers of {subject[:19]} in {ref.name}")
        if not resp.headers.get("Content-Type", "").startswith(OCI_INDEX):
            # a registry (or a proxy in front of it) that answers an unknown route with a page
            raise NotFound(f"{ref.name}: the registry has no referrers API")
        if len(resp.content) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"referrers of {subject} are over {MAX_MANIFEST_BYTES} bytes")
        return resp.content

    # -- blobs: reading --------------------------------------------------------------------

    def blob_exists(self, ref: Reference, digest: str, *, timeout: float | None = None) -> bool:
        """Whether the repository holds blob ``digest``."""
        try:
            self.blob_size(ref, digest, timeout=timeout)
        except NotFound:
            return False
        return True

    def blob_size(self, ref: Reference, digest: str, *, timeout: float | None = None) -> int:
        """The size of blob ``digest`` (HEAD)."""
        validate_digest(digest)
        resp = self._request(ref, "HEAD", f"/blobs/{digest}", capability="pull",
                             timeout=timeout, what=f"head blob {digest[:19]} in {ref.name}")
        length = resp.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Unavailable(f"head blob {digest}: no Content-Length from registry")
        return int(length)

    def get_blob(self, ref: Reference, digest: str, *, max_size: int = 64 << 20,
                 timeout: float | None = None) -> bytes:
        """A whole (small) blob in memory, verified against ``digest``: configs, TOCs."""
        buf = io.BytesIO()
        self.download_blob(ref, digest, buf, max_size=max_size, timeout=timeout)
        return buf.getvalue()

    def download_blob(self, ref: Reference, digest: str, dst: IO[bytes], *,
                      size: int | None = None, max_size: int | None = None,
                      timeout: float | None = None,
                      progress: Callable[[int], None] | None = None) -> int:
        """Stream blob ``digest`` into ``dst``, verifying it; resume with ranges after errors.

        Returns the byte count. ``dst`` holds unverified bytes if this raises: write into a
        temporary file and move it into place after success.
        """
        validate_digest(digest)
        algo = digest.split(":", 1)[0]
        hasher = hashlib.new(algo)
        what = f"get blob {digest[:19]} from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else self.blob_timeout, what)
        written = 0

        def once(_: float) -> None:
            nonlocal written
            headers = {"Range": f"bytes={written}-"} if written else {}
            resp = self._request(ref, "GET", f"/blobs/{digest}", capability="pull",
                                 headers=headers, ok=(200, 206), stream=True, what=what,
                                 deadline=deadline)
            skip = written if (written and resp.status_code == 200) else 0
            if resp.status_code == 206 and not _content_range_starts(resp, written):
                resp.close()
                raise Unavailable(f"{what}: resumed at {written}, registry answered "
                                  f"Content-Range {resp.headers.get('Content-Range')!r}")
            try:
                for chunk in resp.iter_bytes():
                    if skip:
                        if len(chunk) <= skip:
                            skip -= len(chunk)
                            continue
                        chunk, skip = chunk[skip:], 0
                    written += len(chunk)
                    if (max_size is not None and written > max_size) or \
                            (size is not None and written > size):
                        raise IntegrityError(f"{what}: larger than expected "
                                             f"({max_size if size is None else size} bytes)")
                    hasher.update(chunk)
                    dst.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
                    if deadline.remaining() <= 0:
                        raise DeadlineExceeded(f"{what}: not done within {deadline.seconds:g} s")
            except BODY_ERRORS as exc:
                # the body broke off: resume where it stopped
                raise Again(map_http_error(exc, f"{what}: connection lost")) from exc
            finally:
                resp.close()

        retry_call(once, what=what, deadline=deadline, retries=self.retries, backoff=self._backoff,
              classify=only_again)
        got = f"{algo}:{hasher.hexdigest()}"
        if got != digest:
            raise IntegrityError(f"{what}: content is {got}")
        if size is not None and written != size:
            raise IntegrityError(f"{what}: {written} bytes, descriptor says {size}")
        return written

    def read_blob_range(self, ref: Reference, digest: str, offset: int, length: int, *,
                        timeout: float | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of a blob via an HTTP range request.

        Shorter only if the blob ends first. A registry that ignores ``Range`` and sends the whole
        blob (200) still yields exactly the requested bytes (the rest is not kept in memory).
        """
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad range offset={offset} length={length}")
        if length == 0:
            return b""
        what = f"read {digest[:19]}[{offset}:+{length}] from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else self.timeout, what)

        direct = True
        eps = self._endpoints_for(ref.registry, "pull")

        def once(_: float) -> bytes:
            nonlocal direct
            if direct:
                try:
                    got = self._direct_range(eps[0], ref, digest, offset, length, deadline,
                                             what)
                except DeadlineExceeded:
                    raise
                except Unavailable as exc:      # the body broke off: another try
                    raise Again(exc) from exc
                if got is not None:
                    return bytes(got)
                # declined (auth, an error status, a whole-blob answer): this call's tries go
                # through the general client, which says what is wrong
                direct = False
            resp = self._request(ref, "GET", f"/blobs/{digest}", capability="pull",
                                 headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                                 ok=(200, 206), stream=True, what=what, deadline=deadline)
            try:
                body = self._range_body(resp, offset, length, deadline, what)
                used = resp.request.headers.get("Authorization", "")
                if (resp.status_code == 206 and str(resp.url).startswith(eps[0].base + "/")
                        and (not used or used.startswith("Bearer "))):
                    with self._lock:
                        self._direct_ok[(eps[0].base, ref.repository)] = used
                return body
            except BODY_ERRORS as exc:
                raise Again(map_http_error(exc, f"{what}: connection lost")) from exc
            finally:
                resp.close()

        return retry_call(once, what=what, deadline=deadline, retries=self.retries,
                     backoff=self._backoff, classify=only_again)

    def read_blob_ranges(self, ref: Reference, digest: str,
                         ranges: Sequence[tuple[int, int]], *,
                         timeout: float | None = None) -> tuple[list[bytes], int]:
        """Several ranges ``(offset, length)`` of a blob, each exactly as asked (shorter only
        where the blob ends first), and the number of requests it took: one multi-range
        request where the registry answers those (distribution does; stargz-snapshotter asks
        them too), else one range request each (:meth:`read_blob_range`). A registry that
        answers a multi-range request with the whole blob (an object store behind a redirect:
        S3 does) or with parts that do not hold the ranges is not asked one again.

        Ranges must be non-empty, in increasing order and apart.
        """
        ranges = list(ranges)
        what = f"read {digest[:19]}[{len(ranges)} ranges] from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else self.timeout, what)
        if len(ranges) > 1:
            eps = self._endpoints_for(ref.registry, "pull")
            try:
                got = self._direct_ranges(eps[0], ref, digest, ranges, deadline, what)
            except DeadlineExceeded:
                raise
            except Unavailable as exc:      # the body broke off: range by range, with retries
                log.debug("%s: %s; one range at a time", what, exc)
                got = None
            if got is not None:
                return [bytes(b) for b in got], 1
        out = [self.read_blob_range(ref, digest, off, n, timeout=deadline.remaining())
               for off, n in ranges]
        return out, len(ranges)

    def reads_many(self, ref: Reference) -> bool:
        """Whether :meth:`read_blob_ranges` would ask ``ref``'s registry several ranges in
        one request now: its range reads go direct (see :meth:`_direct_range`) and it has not
        declined a multi-range request. Otherwise that call costs a request per range, one
        after another: a caller then rather joins close ranges into one itself."""
        ep = self._endpoints_for(ref.registry, "pull")[0]
        with self._lock:
            return ep.base not in self._multi_off and self._goes_direct(ep, ref)

    def _goes_direct(self, ep: Endpoint, ref: Reference) -> bool:
        """(With the lock held.) Whether range reads of ``ref`` from ``ep`` go direct now."""
        return (not self._closed and (ep.base, ref.repository) in self._direct_ok
                and time.monotonic() >= self._direct_off.get(ep.base, 0.0))

    def _direct_target(self, ep: Endpoint, ref: Reference, digest: str
                       ) -> tuple[str, dict[str, str]] | None:
        """URL and headers of a direct range read of ``digest`` from the registry's first
        endpoint ``ep`` (with the credentials already known for the repository); None where
        range reads do not go direct (yet)."""
        with self._lock:    # before the credential look-up: most repositories decline here
            if not self._goes_direct(ep, ref):
                return None
        auth = self._auth_header(ep, f"repository:{ref.repository}:pull") or ""
        with self._lock:
            if self._direct_ok.get((ep.base, ref.repository)) != auth:
                return None
        url = f"{ep.base}/{ref.repository}/blobs/{digest}"
        if ep.mirror_of:
            url += "?" + urlencode([("ns", ep.mirror_of)])
        headers = dict(ep.headers)
        if auth:
            headers["Authorization"] = auth
        return url, headers

    def _direct_ranges(self, ep: Endpoint, ref: Reference, digest: str,
                       ranges: list[tuple[int, int]], deadline: Deadline,
                       what: str) -> list[bytes | bytearray] | None:
        """The ranges in one multi-range request over :class:`RangeConnections`; None when
        range reads do not go direct or the registry declines (then not asked again)."""
        with self._lock:
            if ep.base in self._multi_off:
                return None
        target = self._direct_target(ep, ref, digest)
        if target is None:
            return None
        url, headers = target
        got = self._ranges.get_ranges(url, ranges, headers=headers, deadline=deadline.end,
                                      what=what, tls=lambda u: self._tls_context(ep, u),
                                      stall=self.timeout)
        if isinstance(got, Declined):
            if got.status in (200, 206):
                # the whole blob (an object store behind it), or parts that are not the
                # ranges asked: this endpoint is not asked several ranges at once again
                log.info("%s: the registry does not answer multi-range requests (%s): one "
                         "range per request from now on", what, got.reason)
                with self._lock:
                    self._multi_off.add(ep.base)
            else:
                self._direct_declined(ep, ref, what, got)
            return None
        return got

    def _direct_range(self, ep: Endpoint, ref: Reference, digest: str, offset: int,
                      length: int, deadline: Deadline, what: str) -> bytes | bytearray | None:
        """The range from the registry's first endpoint ``ep`` over
        :class:`RangeConnections` (with the credentials already known for the repository);
        None when it declines."""
        target = self._direct_target(ep, ref, digest)
        if target is None:
            return None
        url, headers = target
        # a stall is cut off after ``timeout`` as on the general path (httpx's read
        # timeout), so that the call's retries get the rest of its deadline
        got = self._ranges.get(url, offset, length, headers=headers,
                               deadline=deadline.end, what=what,
                               tls=lambda u: self._tls_context(ep, u), stall=self.timeout)
        if isinstance(got, Declined):
            self._direct_declined(ep, ref, what, got)
            return None
        return got

    def _direct_declined(self, ep: Endpoint, ref: Reference, what: str,
                         got: Declined) -> None:
        log.debug("%s: direct range read declined (%s); through the general client",
                  what, got.reason)
        with self._lock:
            if got.status in (200, 401, 403):
                # the registry ignores Range, or wants other credentials: the general
                # client serves the repository until one of its range reads succeeds
                self._direct_ok.pop((ep.base, ref.repository), None)
            elif got.status == 0:
                # no answer at all (connect or TLS failure) where the general client gets
                # one: the endpoint goes through it for a while
                self._direct_off[ep.base] = time.monotonic() + _DIRECT_BACKOFF

    def _tls_context(self, ep: Endpoint, url: str) -> ssl.SSLContext | None:
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

    @staticmethod
    def _range_body(resp: httpx.Response, offset: int, length: int, deadline: Deadline,
                    what: str) -> bytes:
        skip = 0
        # a 206 body is read to its end so the connection goes back to the pool
        skip_whole = resp.status_code != 206
        if resp.status_code == 206:
            if not _content_range_starts(resp, offset):
                raise Unavailable(
                    f"{what}: bad Content-Range {resp.headers.get('Content-Range')!r}")
        else:
            skip = offset
        out = bytearray()
        for chunk in resp.iter_bytes():
            if skip:
                if len(chunk) <= skip:
                    skip -= len(chunk)
                    continue
                chunk, skip = chunk[skip:], 0
            out += chunk[: length - len(out)]
            if len(out) >= length and skip_whole:
                # the rest of a whole-blob answer is not wanted: drop the connection
                break
            if deadline.remaining() <= 0:
                raise DeadlineExceeded(f"{what}: not done within {deadline.seconds:g} s")
        return bytes(out)

    # -- blobs: writing --------------------------------------------------------------------

    def _endpoints_for(self, host: str, capability: str) -> list[Endpoint]:
        # hosts.toml is read once per host: range reads on the FUSE path must not parse files
        key = (host, capability)
        with self._lock:
            cached = self._endpoint_cache.get(key)
        if cached is None:
            cached = self.hosts.endpoints(host, capability)
            with self._lock:
                self._endpoint_cache[key] = cached
        return cached

    def push_blob(self, ref: Reference, data: bytes | Path | BinaryIO, digest: str | None = None,
                  *, chunk_size: int | None = None, timeout: float | None = None) -> str:
        """Upload a blob (bytes, a file path or a seekable file); return its digest.

        Skips the upload if the blob exists. ``chunk_size`` switches to a chunked upload
        (``POST``, ``PATCH``…, ``PUT ?digest=``); otherwise one monolithic ``PUT``. A failed
        attempt restarts the whole upload session, within the call's deadline.
        """
        from coldstart.oci import uploads

        return uploads.push_blob(self, ref, data, digest, chunk_size=chunk_size, timeout=timeout)

    def mount_blob(self, ref: Reference, digest: str, from_repository: str, *,
                   timeout: float | None = None) -> bool:
        """Cross-repository mount of ``digest`` from ``from_repository`` (same registry).

        Returns ``True`` if mounted, ``False`` if the registry declined (then upload instead).
        """
        from coldstart.oci import uploads

        return uploads.mount_blob(self, ref, digest, from_repository, timeout=timeout)

    def delete_manifest(self, ref: Reference, *, timeout: float | None = None) -> None:
        """Delete a manifest by digest (registries refuse deletes by tag)."""
        if not ref.digest:
            raise InvalidArgument("delete_manifest needs a reference pinned to a digest")
        self._request(ref, "DELETE", f"/manifests/{ref.digest}", capability="push",
                      scope=f"repository:{ref.repository}:pull,push,delete",
                      ok=(200, 202), timeout=timeout, what=f"delete manifest {ref}")
