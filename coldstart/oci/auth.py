"""Registry authentication: 401 challenges, bearer tokens, which credentials to send.

A registry names its scheme in a ``WWW-Authenticate`` challenge. For ``Basic`` the
``Authorization`` header is built per request from a fresh credential lookup; for ``Bearer`` a
token is fetched from the challenge's realm (with the credentials, or the OAuth2 refresh-token
flow for an identity token) and kept per ``(host, scope)`` until shortly before it expires.

Credentials are looked up per host (the endpoint's own, then for a mirror the registry it
mirrors): the CRI keychain's for the scope's repository first (read again on every lookup:
kubelet may have handed over rotated ones since), then the docker config's. When the registry
refuses them, the next candidate not yet refused in that request is tried, and remembered while
the first choice stays what it was. A refusal with none left is an :class:`AuthError` that names
who we tried to be and where credentials were looked for.
"""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

import httpx

from coldstart.errors import FailedPrecondition, Unavailable
from coldstart.oci.connections import Connections
from coldstart.oci.credentials import Credentials, DockerConfig
from coldstart.oci.hosts import Endpoint
from coldstart.oci.keychain import Keychain
from coldstart.remote.errors import RETRY_STATUS, map_http_error
from coldstart.remote.retry import Backoff, Deadline, retry

__all__ = ["AuthError", "Authorizer"]

# the repository an auth scope names: "repository:NAME:pull,push" (the first, for a mount)
_SCOPE_REPO = re.compile(r"(?:^| )repository:([^: ]+):")
_CHALLENGE_RE = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


class AuthError(FailedPrecondition):
    """The registry refused our credentials, or wants credentials we do not have."""

    grpc_code = "PERMISSION_DENIED"
    exit_code = 10
    errno = 13  # EACCES


@dataclass
class _Token:
    value: str
    expires: float


def _scope_repository(scope: str) -> str | None:
    m = _SCOPE_REPO.search(scope)
    return m.group(1) if m else None


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
              for m in _CHALLENGE_RE.finditer(rest)}
    return scheme.lower(), params


class Authorizer:
    """What to send a registry endpoint, and how to answer its challenges; thread-safe.

    ``creds``: the docker config; ``keychain``: the CRI proxy's credentials, if any; token
    requests go through ``conns`` with ``retries`` and ``backoff`` within the request's
    deadline.
    """

    def __init__(self, conns: Connections, creds: DockerConfig, keychain: Keychain | None, *,
                 retries: int, backoff: Backoff) -> None:
        self.creds = creds
        self.keychain = keychain
        self._conns = conns
        self._retries = retries
        self._backoff = backoff
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str], _Token] = {}
        # (host, repository) -> (first choice when it was refused, the candidate used instead)
        self._chosen: dict[tuple[str, str | None], tuple[Credentials, Credentials]] = {}
        self._schemes: dict[str, tuple[str, dict[str, str]]] = {}

    def header(self, ep: Endpoint, scope: str) -> str | None:
        """The ``Authorization`` header for a request to ``ep`` in ``scope``; None before a
        challenge, or when the token expired (the registry then challenges again)."""
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
            creds = self.credentials(ep, scope)
            if creds is not None:
                raw = f"{creds.username}:{creds.secret}".encode()
                return "Basic " + base64.b64encode(raw).decode()
        return None

    def credentials(self, ep: Endpoint, scope: str = "") -> Credentials | None:
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
        """Every credential that may do for ``ep``, in :meth:`credentials`' order."""
        out: list[Credentials] = []
        for host in (ep.host, ep.mirror_of) if ep.mirror_of else (ep.host,):
            if self.keychain is not None:
                out.extend(self.keychain.candidates(host, repository))
            found = self.creds.lookup(host)
            if found is not None:
                out.append(found)
        return list(dict.fromkeys(out))

    def next_credentials(self, ep: Endpoint, scope: str, refused: list[Credentials]) -> bool:
        """The registry refused what :meth:`credentials` gives: switch to the next candidate
        not yet refused in this request; False if none is left."""
        current = self.credentials(ep, scope)
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

    def where(self) -> str:
        """Where credentials were looked for, for an error message."""
        where = f"docker config {self.creds.path}"
        return where + (f" or CRI keychain {self.keychain.directory}"
                        if self.keychain is not None else "")

    def refused(self, ep: Endpoint, scope: str, code: int, detail: str) -> AuthError:
        """The error for a 401 (refused) or 403 (denied) the registry answered in the end."""
        creds = self.credentials(ep, scope)
        who = (f"as {creds.username!r}" if creds is not None
               else f"anonymously (no credentials for {ep.host} in {self.where()})")
        verb = "refused" if code == 401 else "denied access"
        return AuthError(f"{detail}: {verb} {who}")

    def answer(self, ep: Endpoint, challenge: str, scope: str, deadline: Deadline) -> bool:
        """Answer a 401 challenge; return whether a retry with new credentials makes sense."""
        scheme, params = _parse_challenge(challenge)
        host = ep.host
        creds = self.credentials(ep, scope)
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
        client = self._conns.client(ep)

        def once(_: float) -> httpx.Response:
            try:
                resp = client.request(method, url, headers=headers, content=content,
                                      timeout=self._conns.timeouts(deadline))
            except httpx.TransportError as exc:
                raise map_http_error(exc, f"token server {realm}") from exc
            if resp.status_code in RETRY_STATUS:
                raise Unavailable(f"token server {realm} answered {resp.status_code}")
            return resp

        resp = retry(once, what=f"token server {realm}", deadline=deadline,
                     retries=self._retries, backoff=self._backoff)
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
