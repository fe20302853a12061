"""Where images come from and go to: a registry repository or an OCI layout, behind one shape.

The converter (and anything else that copies images) talks to :class:`ImageStore` only, so
``registry → layout``, ``layout → registry`` and the other two pairs are the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

from coldstart.errors import ColdstartError
from coldstart.oci.layout import OciLayout, parse_layout_spec
from coldstart.oci.manifest import Descriptor, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient

__all__ = ["ImageStore", "LayoutStore", "RegistryStore", "open_store"]


class ImageStore(Protocol):
    """The operations an image copy needs from either end."""

    def describe(self) -> str: ...

    def get_root(self) -> tuple[bytes, str, str]:
        """The named manifest or index: ``(body, media_type, digest)``."""
        ...

    def get_manifest(self, digest: str) -> tuple[bytes, str]:
        """A child manifest by digest: ``(body, media_type)``, verified."""
        ...

    def get_blob(self, digest: str) -> bytes:
        """A small blob (a config), verified."""
        ...

    def download_blob(self, desc: Descriptor, dst: IO[bytes],
                      progress: Callable[[int], None] | None = None) -> int:
        """Stream a blob into ``dst``, verified; return its size; ``progress(n)`` as bytes
        arrive."""
        ...

    def has_blob(self, digest: str) -> bool: ...

    def put_blob_file(self, path: Path, desc: Descriptor) -> None:
        """Store a verified file as blob ``desc`` (the file may be consumed)."""
        ...

    def put_blob_bytes(self, data: bytes, media_type: str) -> Descriptor: ...

    def try_mount(self, digest: str, source: ImageStore) -> bool:
        """Make ``digest`` present without copying it, if ``source`` allows that."""
        ...

    def put_manifest(self, body: bytes, media_type: str, *, root: bool) -> str:
        """Store a manifest; ``root`` ones get the store's tag. Return the digest."""
        ...


class RegistryStore:
    """A repository in a registry, named by a reference (its tag is where a copy lands)."""

    def __init__(self, client: RegistryClient, ref: Reference) -> None:
        self.client = client
        self.ref = ref

    def describe(self) -> str:
        return str(self.ref)

    def get_root(self) -> tuple[bytes, str, str]:
        return self.client.get_manifest(self.ref)

    def get_manifest(self, digest: str) -> tuple[bytes, str]:
        body, media, _ = self.client.get_manifest(self.ref.with_digest(digest))
        return body, media

    def get_blob(self, digest: str) -> bytes:
        return self.client.get_blob(self.ref, digest)

    def download_blob(self, desc: Descriptor, dst: IO[bytes],
                      progress: Callable[[int], None] | None = None) -> int:
        return self.client.download_blob(self.ref, desc.digest, dst, size=desc.size,
                                         progress=progress)

    def has_blob(self, digest: str) -> bool:
        return self.client.blob_exists(self.ref, digest)

    def put_blob_file(self, path: Path, desc: Descriptor) -> None:
        self.client.push_blob(self.ref, path, desc.digest, chunk_size=64 << 20)

    def put_blob_bytes(self, data: bytes, media_type: str) -> Descriptor:
        digest = self.client.push_blob(self.ref, data)
        return Descriptor(media_type=media_type, digest=digest, size=len(data))

    def try_mount(self, digest: str, source: ImageStore) -> bool:
        if not isinstance(source, RegistryStore) or source.ref.registry != self.ref.registry \
                or source.ref.repository == self.ref.repository:
            return False
        try:
            return self.client.mount_blob(self.ref, digest, source.ref.repository)
        except ColdstartError:
            return False  # a refused mount only costs an upload

    def put_manifest(self, body: bytes, media_type: str, *, root: bool) -> str:
        if root and self.ref.tag:
            target = Reference(self.ref.registry, self.ref.repository, self.ref.tag, None)
        else:
            target = Reference(self.ref.registry, self.ref.repository, None, digest_of(body))
        return self.client.push_manifest(target, body, media_type)


class LayoutStore:
    """An OCI image-layout directory and an optional tag (``oci:DIR[:tag]``)."""

    def __init__(self, layout: OciLayout, tag: str | None) -> None:
        self.layout = layout
        self.tag = tag

    def describe(self) -> str:
        return f"oci:{self.layout.root}" + (f":{self.tag}" if self.tag else "")

    def get_root(self) -> tuple[bytes, str, str]:
        desc = self.layout.resolve(self.tag)
        return self.layout.read_blob(desc.digest), desc.media_type, desc.digest

    def get_manifest(self, digest: str) -> tuple[bytes, str]:
        body = self.layout.read_blob(digest)
        return body, ""

    def get_blob(self, digest: str) -> bytes:
        return self.layout.read_blob(digest)

    def download_blob(self, desc: Descriptor, dst: IO[bytes],
                      progress: Callable[[int], None] | None = None) -> int:
        n = self.layout.copy_blob_to(desc.digest, dst)
        if progress is not None:
            progress(n)
        return n

    def has_blob(self, digest: str) -> bool:
        return self.layout.has_blob(digest)

    def put_blob_file(self, path: Path, desc: Descriptor) -> None:
        self.layout.ingest_file(path, desc.digest)

    def put_blob_bytes(self, data: bytes, media_type: str) -> Descriptor:
        return self.layout.put_blob(data, media_type)

    def try_mount(self, digest: str, source: ImageStore) -> bool:
        return False

    def put_manifest(self, body: bytes, media_type: str, *, root: bool) -> str:
        desc = self.layout.put_blob(body, media_type)
        if root:
            self.layout.add_manifest(desc, self.tag)
        return desc.digest


def open_store(spec: str, client: RegistryClient, *, create: bool = False) -> ImageStore:
    """``oci:DIR[:tag]`` → a layout store; anything else → a registry reference."""
    if spec.startswith("oci:"):
        directory, tag = parse_layout_spec(spec)
        layout = OciLayout.create(directory) if create else OciLayout(directory)
        return LayoutStore(layout, tag)
    return RegistryStore(client, Reference.parse(spec))
