"""OCI image-layout directories (``oci:DIR[:tag]``): ``oci-layout``, ``index.json``, ``blobs/``.

What skopeo, BuildKit and podman read and write. Blobs are written to a temporary file in the
same directory, verified, then renamed into place, so a crash never leaves a blob whose name lies
about its content.

>>> layout = OciLayout.create(Path("/tmp/img"))                       # doctest: +SKIP
>>> desc = layout.put_blob(b"{}", "application/vnd.oci.image.config.v1+json")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from coldstart.errors import FormatError, IntegrityError, InvalidArgument, NotFound
from coldstart.oci.manifest import (
    ALL_MANIFEST_TYPES,
    OCI_INDEX,
    Descriptor,
    Index,
    canonical_json,
    digest_of,
    parse_index,
)
from coldstart.oci.reference import validate_digest

__all__ = ["REF_NAME", "OciLayout", "parse_layout_spec"]

REF_NAME = "org.opencontainers.image.ref.name"
_LAYOUT_FILE = '{"imageLayoutVersion":"1.0.0"}'
_TAG_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.:-]*$")


def parse_layout_spec(spec: str) -> tuple[Path, str | None]:
    """Split ``oci:DIR[:tag]`` (the ``oci:`` prefix optional) into the directory and the tag."""
    body = spec[4:] if spec.startswith("oci:") else spec
    if not body:
        raise InvalidArgument(f"invalid OCI layout reference {spec!r} (want oci:DIR[:tag])")
    directory, sep, tag = body.rpartition(":")
    if sep and directory and "/" not in tag and _TAG_RE.match(tag):
        return Path(directory), tag
    return Path(body), None


class OciLayout:
    """An OCI image-layout directory. Safe for concurrent blob writes from several threads."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        marker = self.root / "oci-layout"
        if not marker.is_file():
            raise NotFound(f"{self.root} is not an OCI image layout (no oci-layout file)")
        try:
            version = json.loads(marker.read_text()).get("imageLayoutVersion")
        except (OSError, ValueError, AttributeError) as exc:
            raise FormatError(f"{marker}: not valid JSON") from exc
        if version != "1.0.0":
            raise FormatError(f"{marker}: unsupported imageLayoutVersion {version!r}")

    @classmethod
    def create(cls, root: Path) -> OciLayout:
        """Open ``root``, making an empty layout first if it does not exist."""
        root = Path(root)
        if not (root / "oci-layout").exists():
            if root.exists() and not root.is_dir():
                raise InvalidArgument(f"{root} exists and is not a directory")
            try:
                (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
                (root / "oci-layout").write_text(_LAYOUT_FILE)
                if not (root / "index.json").exists():
                    _atomic_write(root / "index.json",
                                  canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX,
                                                  "manifests": []}))
            except OSError as exc:
                raise InvalidArgument(
                    f"cannot create an OCI layout in {root}: {exc.strerror or exc}") from exc
        return cls(root)

    # -- blobs -----------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """Where blob ``digest`` lives (whether or not it exists)."""
        algo, _, hexpart = validate_digest(digest).partition(":")
        return self.root / "blobs" / algo / hexpart

    def has_blob(self, digest: str) -> bool:
        """Whether blob ``digest`` is stored here."""
        return self.blob_path(digest).is_file()

    def blob_size(self, digest: str) -> int:
        """The size of blob ``digest``; :class:`NotFound` if absent."""
        try:
            return self.blob_path(digest).stat().st_size
        except FileNotFoundError as exc:
            raise NotFound(f"blob {digest} not in {self.root}") from exc

    def read_blob(self, digest: str, *, max_size: int = 64 << 20) -> bytes:
        """A whole small blob, verified against its digest."""
        path = self.blob_path(digest)
        try:
            if path.stat().st_size > max_size:
                raise InvalidArgument(f"blob {digest} is larger than {max_size} bytes")
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"blob {digest} not in {self.root}") from exc
        if digest_of(data) != digest:
            raise IntegrityError(f"{path}: content does not match its name")
        return data

    def copy_blob_to(self, digest: str, dst: IO[bytes]) -> int:
        """Stream a blob into ``dst``, verifying it; return its size."""
        path = self.blob_path(digest)
        h = hashlib.new(digest.split(":", 1)[0])
        n = 0
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
                    n += len(chunk)
        except FileNotFoundError as exc:
            raise NotFound(f"blob {digest} not in {self.root}") from exc
        if f"{digest.split(':', 1)[0]}:{h.hexdigest()}" != digest:
            raise IntegrityError(f"{path}: content does not match its name")
        return n

    def put_blob(self, data: bytes, media_type: str) -> Descriptor:
        """Store ``data``; return its descriptor."""
        digest = digest_of(data)
        path = self.blob_path(digest)
        if not path.exists():
            _atomic_write(path, data)
        return Descriptor(media_type=media_type, digest=digest, size=len(data))

    def ingest_file(self, src: Path, digest: str | None = None) -> str:
        """Move (rename, or copy across filesystems) a file into the blob store; verify it."""
        h = hashlib.sha256()
        with open(src, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        got = f"sha256:{h.hexdigest()}"
        if digest is not None and got != digest:
            raise IntegrityError(f"{src}: content is {got}, expected {digest}")
        path = self.blob_path(got)
        if path.exists():
            src.unlink()
            return got
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(src, path)
        except OSError:
            tmp = _temp_beside(path)
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
            src.unlink()
        return got

    # -- index -----------------------------------------------------------------------------

    def index(self) -> Index:
        """The layout's ``index.json``."""
        try:
            body = (self.root / "index.json").read_bytes()
        except FileNotFoundError as exc:
            raise FormatError(f"{self.root} has no index.json") from exc
        return parse_index(body, OCI_INDEX)

    def resolve(self, tag: str | None) -> Descriptor:
        """The index entry named ``tag`` (or the only entry when ``tag`` is ``None``)."""
        entries = [d for d in self.index().manifests if d.media_type in ALL_MANIFEST_TYPES]
        if tag is None:
            if len(entries) == 1:
                return entries[0]
            names = sorted(d.annotations.get(REF_NAME, "?") for d in entries)
            raise InvalidArgument(
                f"{self.root} holds {len(entries)} images {names}; name one as oci:DIR:TAG")
        for d in entries:
            if d.annotations.get(REF_NAME) == tag:
                return d
        raise NotFound(f"no image tagged {tag!r} in {self.root}")

    def add_manifest(self, desc: Descriptor, tag: str | None) -> None:
        """Record ``desc`` in ``index.json`` (replacing any entry with the same tag)."""
        with self._lock:
            index = self.index()
            entry = desc.with_annotations({REF_NAME: tag}) if tag else desc
            kept = [d for d in index.manifests
                    if not (tag and d.annotations.get(REF_NAME) == tag)
                    and not (not tag and d.digest == desc.digest)]
            raw = dict(index.raw)
            raw["manifests"] = [d.to_json() for d in [*kept, entry]]
            raw.setdefault("mediaType", OCI_INDEX)
            raw["schemaVersion"] = 2
            _atomic_write(self.root / "index.json", canonical_json(raw))


def _temp_beside(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    os.close(fd)
    return Path(name)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = _temp_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def iter_layout_blobs(layout: OciLayout) -> Iterator[Path]:
    """Every blob file in the layout (for garbage checks in tests and tools)."""
    yield from (p for p in (layout.root / "blobs").rglob("*") if p.is_file())
