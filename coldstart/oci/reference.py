"""Image references: ``[registry/]repository[:tag][@digest]``, normalised like containerd/docker.

>>> str(Reference.parse("ubuntu"))
'docker.io/library/ubuntu:latest'
>>> Reference.parse("127.0.0.1:5000/a/b@sha256:" + "0" * 64).tag is None
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from coldstart.errors import InvalidArgument

__all__ = ["DOCKER_HUB", "DOCKER_HUB_API", "Reference", "validate_digest"]

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}

# distribution/reference grammar, simplified to what registries accept in practice.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_RE = re.compile(r"^(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?$")


def validate_digest(digest: str) -> str:
    """Return ``digest`` if it is a well-formed ``sha256:``/``sha512:`` digest, else raise."""
    if not _DIGEST_RE.match(digest):
        raise InvalidArgument(f"invalid digest {digest!r} (want sha256:<64 hex>)")
    return digest


@dataclass(frozen=True)
class Reference:
    """A parsed image reference. ``tag`` and ``digest`` may both be set (``repo:tag@digest``)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, s: str) -> Reference:
        """Parse ``s``; a bare name gets ``docker.io`` (and ``library/``) and the tag ``latest``;
        ``docker://`` in front (skopeo's transport) is dropped."""
        text = s.strip()
        if not text or text != s or any(c.isspace() for c in text):
            raise InvalidArgument(f"invalid image reference {s!r}")
        text = text.removeprefix("docker://")       # skopeo's transport name
        if "://" in text:
            raise InvalidArgument(f"invalid image reference {s!r}: drop the URL scheme "
                                  "(REGISTRY/REPO:TAG, docker://REGISTRY/REPO:TAG or oci:DIR)")
        name, digest = text, None
        if "@" in text:
            name, digest = text.split("@", 1)
            validate_digest(digest)
        tag: str | None = None
        slash = name.rfind("/")
        colon = name.rfind(":")
        if colon > slash:
            name, tag = name[:colon], name[colon + 1 :]
            if not _TAG_RE.match(tag):
                raise InvalidArgument(f"invalid tag {tag!r} in image reference {s!r}")
        first, sep, rest = name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            registry, repository = first, rest
            if not _HOST_RE.match(registry):
                raise InvalidArgument(f"invalid registry host {registry!r} in {s!r}")
        else:
            registry, repository = DOCKER_HUB, name
        if registry in _HUB_ALIASES:
            registry = DOCKER_HUB
            if "/" not in repository:
                repository = f"library/{repository}"
        if not _REPOSITORY_RE.match(repository):
            raise InvalidArgument(
                f"invalid repository {repository!r} in image reference {s!r} "
                "(lowercase letters, digits, '.', '_', '-' and '/')"
            )
        if tag is None and digest is None:
            tag = "latest"
        return cls(registry=registry, repository=repository, tag=tag, digest=digest)

    @property
    def api_host(self) -> str:
        """The host to send HTTP requests to (Docker Hub's API lives on another name)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def name(self) -> str:
        """``registry/repository`` without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def reference(self) -> str:
        """What goes after ``/manifests/``: the digest when known, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> Reference:
        """The same image pinned to ``digest`` (the tag is kept for display)."""
        return replace(self, digest=validate_digest(digest))

    def with_tag(self, tag: str) -> Reference:
        """The same repository with ``tag`` and no digest."""
        if not _TAG_RE.match(tag):
            raise InvalidArgument(f"invalid tag {tag!r}")
        return replace(self, tag=tag, digest=None)

    def with_repository(self, repository: str) -> Reference:
        """Another repository on the same registry (tag and digest kept)."""
        if not _REPOSITORY_RE.match(repository):
            raise InvalidArgument(f"invalid repository {repository!r}")
        return replace(self, repository=repository)

    def __str__(self) -> str:
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out
