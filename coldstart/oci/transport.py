"""The registry request engine: endpoints in turn, authentication, redirects, retries, errors.

:meth:`Transport.request` sends one distribution-API request for a repository to each endpoint
of its registry in turn (containerd ``hosts.toml`` mirrors first, then the registry itself); a
mirror that lacks the content, fails or refuses us passes the request on. On each endpoint,
:meth:`Transport.attempts` retries transient failures (5xx, 429, connection errors) with
exponential backoff and full jitter inside the call's deadline; each attempt answers the
registry's 401 challenges (:class:`~coldstart.oci.auth.Authorizer`) and follows redirects, to
blob storage without the registry's credentials. The one mapping of registry answers to
:mod:`coldstart.errors` is here (httpx's own errors through :mod:`coldstart.remote.errors`):

- 404 → :class:`NotFound`; 401/403 → :class:`~coldstart.oci.auth.AuthError`;
  416 → :class:`InvalidArgument`; 400 ``DIGEST_INVALID`` → :class:`IntegrityError`;
- 5xx, 429, connection errors after the retries → :class:`Unavailable`; an exhausted
  deadline → :class:`DeadlineExceeded`; a TLS verification failure → :class:`Unavailable`
  at once, naming where to configure trust.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NoReturn
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.oci.auth import AuthError, Authorizer
from coldstart.oci.connections import Connections
from coldstart.oci.credentials import Credentials
from coldstart.oci.hosts import Endpoint, HostsConfig
from coldstart.oci.reference import Reference
from coldstart.remote.errors import RETRY_STATUS, is_tls_failure
from coldstart.remote.rangeconn import REDIRECT_STATUSES
from coldstart.remote.retry import Again, Backoff, Deadline, only_again
from coldstart.remote.retry import retry as retry_call

__all__ = ["BodyFactory", "Transport"]

MAX_SMALL_BODY = 16 << 20   # manifests, tokens, error documents: never a blob

#: a request body, made again for every attempt (an iterator is used up by one)
BodyFactory = Callable[[], bytes | Iterator[bytes]]


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


class Transport:
    """Requests to one client's registries; thread-safe.

    ``timeout``: the default deadline of a call (and of one socket wait, in ``conns``);
    ``blob_timeout``: that of a whole blob's transfer; ``retries``: how many times a failed
    attempt is retried inside the deadline, ``backoff`` between them (a ``Retry-After`` is
    honoured up to ``max_backoff``).
    """

    def __init__(self, hosts: HostsConfig, conns: Connections, auth: Authorizer, *,
                 timeout: float, blob_timeout: float, retries: int, backoff: Backoff,
                 max_backoff: float) -> None:
        self.hosts = hosts
        self.conns = conns
        self.auth = auth
        self.timeout = timeout
        self.blob_timeout = blob_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._lock = threading.Lock()
        self._endpoint_cache: dict[tuple[str, str], list[Endpoint]] = {}

    def endpoints(self, host: str, capability: str) -> list[Endpoint]:
        """The endpoints for ``capability`` (pull, resolve, push) on registry ``host``, in
        the order to try them."""
        # hosts.toml is read once per host: range reads on the FUSE path must not parse files
        key = (host, capability)
        with self._lock:
            cached = self._endpoint_cache.get(key)
        if cached is None:
            cached = self.hosts.endpoints(host, capability)
            with self._lock:
                self._endpoint_cache[key] = cached
        return cached

    def request(self, ref: Reference, method: str, path: str, *, capability: str,
                scope: str | None = None, headers: Mapping[str, str] | None = None,
                params: Sequence[tuple[str, str]] = (), body: BodyFactory | None = None,
                ok: Iterable[int] = (200,), timeout: float | None = None,
                stream: bool = False, retry: bool = True, what: str = "",
                endpoints: Sequence[Endpoint] | None = None,
                deadline: Deadline | None = None) -> httpx.Response:
        """Send to each endpoint in turn, retrying transient failures within one deadline."""
        what = what or f"{method} {ref.name}{path}"
        deadline = deadline or Deadline(timeout if timeout is not None else self.timeout, what)
        scope = scope or f"repository:{ref.repository}:pull"
        eps = list(endpoints) if endpoints is not None else \
            self.endpoints(ref.registry, capability)
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
                return self.attempts(ep, method, url, scope=scope, headers=headers or {},
                                     body=body, ok=ok_set, deadline=deadline, stream=stream,
                                     retry=retry, what=what)
            except (NotFound, Unavailable, AuthError) as exc:
                # a mirror that lacks the content, fails or refuses us: try the next host
                last = exc
                if isinstance(exc, DeadlineExceeded) or i == len(eps) - 1:
                    raise
        assert last is not None
        raise last

    def attempts(self, ep: Endpoint, method: str, url: str, *, scope: str,
                 headers: Mapping[str, str], body: BodyFactory | None, ok: frozenset[int],
                 deadline: Deadline, stream: bool, retry: bool, what: str) -> httpx.Response:
        """``method url`` on ``ep`` until an answer in ``ok`` (retried unless ``retry`` is
        False: then one attempt, whose timeout is :class:`Unavailable` while the deadline
        lasts, so that the caller may start over, e.g. a new upload session)."""
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
                          backoff=self.backoff, classify=only_again)

    def _send(self, ep: Endpoint, method: str, url: str, *, scope: str,
              headers: Mapping[str, str], body: BodyFactory | None, deadline: Deadline,
              stream: bool) -> httpx.Response:
        """One attempt, with authentication and redirects; the caller handles statuses."""
        auth, conns = self.auth, self.conns
        client = conns.client(ep)
        authed_once = False
        refused: list[Credentials] = []   # candidates the registry refused in this request
        while True:
            hdrs = {**ep.headers, **headers}
            sent = auth.header(ep, scope)
            if sent:
                hdrs["Authorization"] = sent
            req = client.build_request(method, url, headers=hdrs,
                                       content=body() if body else None,
                                       timeout=conns.timeouts(deadline))
            resp = client.send(req, stream=True)
            if resp.status_code == 401 and not authed_once:
                challenge = resp.headers.get("WWW-Authenticate", "")
                resp.close()
                if not challenge:
                    raise AuthError(f"{ep.host}: 401 Unauthorized without a challenge")
                authed_once = True
                try:
                    if auth.answer(ep, challenge, scope, deadline):
                        continue
                except AuthError:
                    # the token server refused these credentials; others may do
                    if auth.next_credentials(ep, scope, refused):
                        authed_once = False
                        continue
                    raise
                # Basic auth already known: retry if the credentials changed since this
                # request was built (the CRI proxy wrote rotated ones meanwhile), or with the
                # next candidate
                if sent is not None and auth.header(ep, scope) not in (None, sent):
                    continue
                if sent is not None and auth.next_credentials(ep, scope, refused):
                    continue
                creds = auth.credentials(ep, scope)
                if creds is not None:
                    raise AuthError(f"{ep.host}: credentials for {creds.username!r} refused")
                raise AuthError(f"{ep.host}: authentication required and no credentials "
                                f"found ({auth.where()})")
            if resp.status_code == 401 and sent is not None and \
                    auth.next_credentials(ep, scope, refused):
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
                sent = auth.header(ep, scope)
                if sent:
                    hdrs["Authorization"] = sent
            elif urlsplit(target).scheme == "https":
                # blob storage (S3, a CDN) must not see the registry's credentials, and is
                # verified like any TLS host unless this registry's hosts.toml says skip_verify
                client = conns.client(ep if ep.verify is False or
                                      ep.base.startswith("https://") else None)
            url = target
            req = client.build_request(method, url, headers=hdrs,
                                       timeout=conns.timeouts(deadline))
            resp = client.send(req, stream=True)
        if not stream:
            try:
                chunks = []
                total = 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > MAX_SMALL_BODY:
                        raise Unavailable(f"{ep.host}: answer to {method} {url} is larger "
                                          f"than {MAX_SMALL_BODY} bytes")
                    if deadline.remaining() <= 0:
                        raise httpx.ReadTimeout("deadline", request=req)
                # what Response.read() itself does; reading chunk by chunk lets the deadline
                # cut off a server that dribbles bytes (httpx's timeouts are per read)
                resp._content = b"".join(chunks)
            finally:
                resp.close()
        return resp

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
            raise self.auth.refused(ep, scope, code, detail)
        if code == 416:
            raise InvalidArgument(detail)
        if code >= 500 or code in RETRY_STATUS:
            raise Unavailable(detail)
        if code == 400 and "DIGEST_INVALID" in msg:
            raise IntegrityError(detail)
        raise InvalidArgument(detail)
