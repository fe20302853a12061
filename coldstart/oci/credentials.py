"""Registry credentials from Docker's ``config.json`` (``auths`` entries and credential helpers)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldstart.errors import InvalidArgument, Unavailable

__all__ = ["Credentials", "DockerConfig", "default_docker_config"]

_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io",
             "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    """A username and a secret; ``username == "<token>"`` means ``secret`` is an identity token."""

    username: str
    secret: str

    @property
    def is_identity_token(self) -> bool:
        return self.username == "<token>"

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(username={self.username!r}, secret=***)"


def default_docker_config() -> Path:
    """``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def _host_of(key: str) -> str:
    k = key
    for prefix in ("https://", "http://"):
        if k.startswith(prefix):
            k = k[len(prefix):]
    return k.split("/", 1)[0]


class DockerConfig:
    """Credentials for registry hosts, read once from a Docker ``config.json``."""

    def __init__(self, path: Path | None = None, *,
                 static: Mapping[str, Credentials] | None = None,
                 helper_timeout: float = 10.0) -> None:
        self.path = path
        self._static = dict(static or {})
        self._helper_timeout = helper_timeout
        self._doc: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._cache: dict[str, Credentials | None] = {}
        if path is not None and path.exists():
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"cannot read docker config {path}: {exc}") from exc
            if not isinstance(doc, dict):
                raise InvalidArgument(f"docker config {path} is not a JSON object")
            self._doc = doc

    def _auth_entry(self, host: str) -> Mapping[str, Any] | None:
        auths = self._doc.get("auths") or {}
        keys = _HUB_KEYS if host in ("docker.io", "registry-1.docker.io") else (host,)
        for key, entry in auths.items():
            if _host_of(key) in keys or key in keys:
                return entry if isinstance(entry, dict) else None
        return None

    def _helper_for(self, host: str) -> str | None:
        helpers = self._doc.get("credHelpers") or {}
        for key, name in helpers.items():
            if _host_of(key) == host:
                return str(name)
        store = self._doc.get("credsStore")
        return str(store) if store else None

    def lookup(self, host: str) -> Credentials | None:
        """Credentials for registry ``host`` (``name[:port]``), or ``None``; cached per host."""
        if host in self._static:
            return self._static[host]
        with self._lock:
            if host in self._cache:
                return self._cache[host]
        found = self._lookup(host)
        with self._lock:
            self._cache[host] = found
        return found

    def _lookup(self, host: str) -> Credentials | None:
        entry = self._auth_entry(host)
        if entry:
            if entry.get("identitytoken"):
                return Credentials("<token>", str(entry["identitytoken"]))
            if entry.get("auth"):
                try:
                    decoded = base64.b64decode(str(entry["auth"]), validate=True).decode()
                except (binascii.Error, UnicodeDecodeError) as exc:
                    raise InvalidArgument(
                        f"docker config {self.path}: bad base64 'auth' for {host}") from exc
                user, sep, secret = decoded.partition(":")
                if not sep:
                    raise InvalidArgument(
                        f"docker config {self.path}: 'auth' for {host} is not user:password")
                return Credentials(user, secret)
            if entry.get("username") is not None:
                return Credentials(str(entry["username"]), str(entry.get("password", "")))
        helper = self._helper_for(host)
        if helper:
            return self._from_helper(helper, host)
        return None

    def _from_helper(self, helper: str, host: str) -> Credentials | None:
        argv = [f"docker-credential-{helper}", "get"]
        server = "https://index.docker.io/v1/" if host in ("docker.io",
                                                           "registry-1.docker.io") else host
        try:
            proc = subprocess.run(argv, input=server.encode(), capture_output=True,
                                  timeout=self._helper_timeout, check=False)
        except FileNotFoundError:
            return None
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"credential helper {argv[0]} did not answer for {host}") from exc
        if proc.returncode != 0:
            return None  # "credentials not found" is an exit status, not an error for us
        try:
            doc = json.loads(proc.stdout)
            return Credentials(str(doc["Username"]), str(doc["Secret"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise Unavailable(f"credential helper {argv[0]} answered garbage") from exc
