"""Registry credentials kubelet hands over in CRI ``PullImage``, kept on the node for the FUSE
server (stargz-snapshotter's "CRI keychain").

kubelet sends a pull's credentials (from an ``imagePullSecret`` or a credential provider) only
to the image service; the FUSE server fetches the layers later, by itself. So the CRI proxy
(:mod:`coldstart.cri`) writes each ``PullImage``'s credentials here, keyed by the image's
repository, and the FUSE server's registry client reads them when it authenticates. Every new
``PullImage`` writes them again, so a rotated token reaches the FUSE server on the next pull, and
they survive restarts of either process. The directory is root-only (0700, files 0600).

Lookup order for ``(host, repository)``: the repository's own entry, else the newest entry of
the same host (another repository of the same registry, e.g. a token for the whole registry);
:meth:`Keychain.candidates` lists them all in that order, for a client whose first choice the
registry refused.

>>> kc = Keychain(Path("/var/lib/coldstart/cri-credentials"))      # doctest: +SKIP
>>> kc.put("registry.example/app:v1", Credentials("ci", "s3cret"))  # doctest: +SKIP
>>> kc.get("registry.example", "app")                               # doctest: +SKIP
Credentials(username='ci', secret=***)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from coldstart.errors import FailedPrecondition
from coldstart.files import atomic_write, private_dir
from coldstart.oci.credentials import Credentials
from coldstart.oci.reference import DOCKER_HUB, DOCKER_HUB_API, Reference

__all__ = ["Keychain"]

# Docker Hub is "docker.io" in a reference but "registry-1.docker.io" on the wire
_HUB_HOSTS = frozenset({DOCKER_HUB, DOCKER_HUB_API, "index.docker.io"})


def _host_key(host: str) -> str:
    return DOCKER_HUB if host in _HUB_HOSTS else host


class Keychain:
    """Credentials by image repository in ``directory`` (one JSON file per repository)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        # path -> ((inode, mtime, size), parsed entry): files are replaced by rename on update
        self._cache: dict[Path, tuple[tuple[int, int, int], dict[str, object] | None]] = {}
        self._listing: tuple[tuple[int, int], list[str]] | None = None

    @staticmethod
    def _host_prefix(host: str) -> str:
        return hashlib.sha256(host.encode()).hexdigest()[:16]

    def _file(self, host: str, repository: str) -> Path:
        # named <host hash>-<repository hash>: a lookup for a host reads only that host's
        # files (the client looks up on every Basic-auth request)
        key = hashlib.sha256(f"{host}/{repository}".encode()).hexdigest()[:24]
        return self.directory / f"{self._host_prefix(host)}-{key}.json"

    def put(self, image: str, creds: Credentials) -> None:
        """Keep ``creds`` for ``image``'s repository (replacing what was there), root-only."""
        ref = Reference.parse(image)
        doc = {"host": ref.registry, "repository": ref.repository, "image": image,
               "username": creds.username, "secret": creds.secret, "updated": time.time()}
        try:
            private_dir(self.directory, "registry credentials directory")
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"cannot keep registry credentials in {self.directory}: "
                                     f"{exc}") from exc
        try:
            atomic_write(self._file(ref.registry, ref.repository), json.dumps(doc).encode(),
                         mode=0o600)
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"cannot keep registry credentials in {self.directory}: "
                                     f"{exc}") from exc

    def get(self, host: str, repository: str | None = None) -> Credentials | None:
        """The credentials for ``host/repository``, else the newest for ``host``, else None."""
        host = _host_key(host)
        if repository:
            doc = self._read(self._file(host, repository))
            if doc is not None:
                return Credentials(str(doc["username"]), str(doc["secret"]))
        found = self._of_host(host)
        return found[0] if found else None

    def candidates(self, host: str, repository: str | None = None) -> list[Credentials]:
        """Everything kept for ``host``, the order to try it in: the repository's own entry,
        then the host's others, newest first (each distinct pair once).

        The others matter when a password changed on the registry and kubelet has so far
        handed over the new one only with another image's pull."""
        host = _host_key(host)
        out: list[Credentials] = []
        if repository:
            doc = self._read(self._file(host, repository))
            if doc is not None:
                out.append(Credentials(str(doc["username"]), str(doc["secret"])))
        out.extend(self._of_host(host))
        return list(dict.fromkeys(out))

    def _of_host(self, host: str) -> list[Credentials]:
        """The host's entries, newest first (the listing is read again only when the
        directory changed: an entry is written by rename)."""
        prefix = self._host_prefix(host) + "-"
        try:
            st = os.stat(self.directory)
            stamp = (st.st_ino, st.st_mtime_ns)
            if self._listing is None or self._listing[0] != stamp:
                self._listing = (stamp, os.listdir(self.directory))
        except OSError:
            return []
        files = [self.directory / name for name in self._listing[1]
                 if name.startswith(prefix) and name.endswith(".json")]
        docs: list[tuple[float, Credentials]] = []
        for path in files:
            doc = self._read(path)
            if doc is not None and doc["host"] == host:
                updated = doc.get("updated", 0)
                docs.append((float(updated) if isinstance(updated, (int, float)) else 0.0,
                             Credentials(str(doc["username"]), str(doc["secret"]))))
        docs.sort(key=lambda d: d[0], reverse=True)
        return [c for _, c in docs]

    def _read(self, path: Path) -> dict[str, object] | None:
        """The entry in ``path``; parsed again only when the file changed (the registry client
        asks on every Basic-auth request: a range fetch then costs one ``stat``)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = None
        doc: dict[str, object] | None = raw if isinstance(raw, dict) and all(
            isinstance(raw.get(k), str) for k in ("host", "username", "secret")) and \
            isinstance(raw.get("updated", 0), (int, float)) else None
        # (None: half-written by hand, or not ours: as if absent)
        self._cache[path] = (stamp, doc)
        return doc
