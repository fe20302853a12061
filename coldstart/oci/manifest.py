"""OCI and Docker v2 manifests, indexes and image configs: parse, select a platform, rewrite.

Parsing keeps unknown fields (``Manifest.raw``/``ImageConfig.raw``) so a converter that rewrites a
config or manifest changes only what it means to change.
"""

from __future__ import annotations

import hashlib
import json
import platform as _platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.oci.reference import validate_digest

__all__ = [
    "ALL_MANIFEST_TYPES",
    "DOCKER_CONFIG",
    "DOCKER_LAYER_FOREIGN_GZIP",
    "DOCKER_LAYER_GZIP",
    "DOCKER_MANIFEST",
    "DOCKER_MANIFEST_LIST",
    "INDEX_TYPES",
    "LAYER_TYPES",
    "MANIFEST_TYPES",
    "OCI_CONFIG",
    "OCI_INDEX",
    "OCI_LAYER_GZIP",
    "OCI_LAYER_TAR",
    "OCI_LAYER_ZSTD",
    "OCI_MANIFEST",
    "Descriptor",
    "ImageConfig",
    "Index",
    "Manifest",
    "Platform",
    "build_manifest",
    "canonical_json",
    "chain_id",
    "digest_of",
    "host_platform",
    "is_index",
    "json_object",
    "parse_any",
    "parse_index",
    "parse_manifest",
    "parse_platforms",
    "select_platform",
]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_FOREIGN_GZIP = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"

INDEX_TYPES = (OCI_INDEX, DOCKER_MANIFEST_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ALL_MANIFEST_TYPES: tuple[str, ...] = (*INDEX_TYPES, *MANIFEST_TYPES)
LAYER_TYPES = (OCI_LAYER_TAR, OCI_LAYER_GZIP, OCI_LAYER_ZSTD, DOCKER_LAYER_GZIP,
               DOCKER_LAYER_FOREIGN_GZIP)


def digest_of(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def chain_id(parent_chain: str, diff_id: str) -> str:
    """The OCI ChainID of a layer with ``diff_id`` over ``parent_chain`` ("" for a base
    layer): ``diff_id``, else ``sha256(parent_chain + " " + diff_id)``.

    >>> chain_id("", "sha256:a")
    'sha256:a'
    """
    if not parent_chain:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent_chain} {diff_id}".encode()).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Compact, key-sorted JSON: stable bytes (and so a stable digest) for what we write."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """``body`` as a JSON object; FormatError naming ``what`` otherwise."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise FormatError(f"{what} is not a JSON object")
    return obj


@dataclass(frozen=True)
class Platform:
    """``os/architecture[/variant]`` of an image, as in an index entry or a config."""

    os: str
    architecture: str
    variant: str | None = None
    os_version: str | None = None

    @classmethod
    def parse(cls, s: str) -> Platform:
        """A platform specifier as containerd's ``platforms.Parse`` reads it.

        ``os/arch[/variant]``, case-insensitive and normalised (``Linux/x86_64`` is
        ``linux/amd64``, ``linux/aarch64`` is ``linux/arm64``, ``linux/armhf`` and
        ``linux/arm`` are ``linux/arm/v7``, the variant containerd's matcher gives them); one
        word is an OS (this machine's architecture) or an architecture (``linux``). A comma
        list is several platforms: see :func:`parse_platforms`.
        """
        text = s.strip()
        if "," in text:
            raise InvalidArgument(f"platform {s!r} names several platforms; give one "
                                  "(os/arch[/variant])")
        parts = text.split("/")
        for part in parts:
            if not _SPECIFIER_RE.match(part):
                raise InvalidArgument(
                    f"invalid platform {s!r}: each part of os/arch[/variant] is letters, "
                    "digits, '_' and '-' (e.g. linux/amd64, linux/arm64/v8)")
        if len(parts) == 1:
            word = parts[0].lower()
            os_name = _normalise_os(word)
            if os_name in _KNOWN_OS:
                host = host_platform()
                return cls(os=os_name, architecture=host.architecture, variant=host.variant)
            arch, variant = _normalise_arch_variant(word, "")
            if arch in _KNOWN_ARCH:
                return cls(os="linux", architecture=arch, variant=variant or None)
            raise InvalidArgument(f"invalid platform {s!r}: unknown operating system or "
                                  "architecture (e.g. linux/amd64, linux/arm64)")
        if len(parts) == 2:
            arch, variant = _normalise_arch_variant(parts[1], "")
            return cls(os=_normalise_os(parts[0]), architecture=arch, variant=variant or None)
        if len(parts) == 3:
            arch, variant = _normalise_arch_variant(parts[1], parts[2])
            if arch == "arm64" and not variant:
                variant = "v8"
            return cls(os=_normalise_os(parts[0]), architecture=arch, variant=variant or None)
        raise InvalidArgument(f"invalid platform {s!r} (want os/arch[/variant], e.g. "
                              "linux/amd64)")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Platform:
        try:
            return cls(os=str(obj["os"]), architecture=_normalise_arch(str(obj["architecture"])),
                       variant=obj.get("variant") or None, os_version=obj.get("os.version"))
        except KeyError as exc:
            raise FormatError(f"platform lacks {exc.args[0]!r}") from exc

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            out["variant"] = self.variant
        if self.os_version:
            out["os.version"] = self.os_version
        return out

    def matches(self, want: Platform) -> bool:
        """Whether this (an image's) platform satisfies ``want`` (a missing variant matches)."""
        if self.os != want.os or self.architecture != want.architecture:
            return False
        if want.variant is None or self.variant is None:
            return True
        return _normalise_variant(self.variant) == _normalise_variant(want.variant)

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


_SPECIFIER_RE = re.compile(r"^[A-Za-z0-9_-]+$")
# containerd's platforms/database.go
_KNOWN_OS = frozenset((
    "aix", "android", "darwin", "dragonfly", "freebsd", "hurd", "illumos", "ios", "js", "linux",
    "nacl", "netbsd", "openbsd", "plan9", "solaris", "windows", "zos"))
_KNOWN_ARCH = frozenset((
    "386", "amd64", "amd64p32", "arm", "armbe", "arm64", "arm64be", "ppc64", "ppc64le",
    "loong64", "mips", "mipsle", "mips64", "mips64le", "mips64p32", "mips64p32le", "ppc",
    "riscv", "riscv64", "s390", "s390x", "sparc", "sparc64", "wasm"))


def _normalise_os(os_name: str) -> str:
    low = os_name.lower()
    return "darwin" if low == "macos" else low


def _normalise_arch_variant(arch: str, variant: str) -> tuple[str, str]:
    """containerd's ``normalizeArch``: lower case, common aliases to GOARCH names."""
    arch, variant = arch.lower(), variant.lower()
    if arch == "i386":
        return "386", ""
    if arch in ("x86_64", "x86-64", "amd64"):
        return "amd64", "" if variant == "v1" else variant
    if arch in ("aarch64", "arm64"):
        return "arm64", "" if variant in ("8", "v8") else variant
    if arch == "armhf":
        return "arm", "v7"
    if arch == "armel":
        return "arm", "v6"
    if arch == "arm":
        if variant in ("", "7"):
            return "arm", "v7"
        if variant in ("5", "6", "8"):
            return "arm", f"v{variant}"
    return arch, variant


def _normalise_arch(arch: str) -> str:
    return _normalise_arch_variant(arch, "")[0]


def _normalise_variant(variant: str) -> str:
    return "v8" if variant in ("8", "v8") else variant


def parse_platforms(specs: Iterable[str]) -> list[Platform]:
    """Platforms from repeatable options that also take comma lists
    (``--platform linux/amd64,linux/arm64``), duplicates dropped, order kept."""
    out: list[Platform] = []
    for spec in specs:
        for part in spec.split(","):
            if not part.strip():
                raise InvalidArgument(f"invalid platform list {spec!r}: an empty entry")
            p = Platform.parse(part)
            if p not in out:
                out.append(p)
    return out


def host_platform() -> Platform:
    """The platform of the machine we run on (``linux/amd64`` here)."""
    return Platform(os="linux", architecture=_normalise_arch(_platform.machine().lower()))


@dataclass(frozen=True)
class Descriptor:
    """A content descriptor: what to fetch, how big it is, what it is."""

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    platform: Platform | None = None
    urls: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Any) -> Descriptor:
        if not isinstance(obj, dict):
            raise FormatError("descriptor is not a JSON object")
        try:
            digest = str(obj["digest"])
            size = obj["size"]
        except KeyError as exc:
            raise FormatError(f"descriptor lacks {exc.args[0]!r}") from exc
        try:
            validate_digest(digest)
        except InvalidArgument as exc:
            raise FormatError(f"descriptor has {exc}") from exc
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(f"descriptor {digest} has invalid size {size!r}")
        ann = obj.get("annotations") or {}
        if not isinstance(ann, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ann.items()
        ):
            raise FormatError(f"descriptor {digest} has invalid annotations")
        plat = obj.get("platform")
        return cls(
            media_type=str(obj.get("mediaType", "")),
            digest=digest,
            size=size,
            annotations=dict(ann),
            platform=Platform.from_json(plat) if isinstance(plat, dict) else None,
            urls=tuple(str(u) for u in obj.get("urls") or ()),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest,
                               "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform is not None:
            out["platform"] = self.platform.to_json()
        if self.urls:
            out["urls"] = list(self.urls)
        return out

    def with_annotations(self, extra: Mapping[str, str]) -> Descriptor:
        return replace(self, annotations={**self.annotations, **extra})


def _serialise(raw: Mapping[str, Any], media_type: str, annotations: Mapping[str, str],
               **fields: Any) -> bytes:
    """A manifest or index as canonical JSON, keeping fields we do not model from ``raw``."""
    obj = dict(raw)
    obj["schemaVersion"] = 2
    obj["mediaType"] = media_type
    obj.update(fields)
    if annotations:
        obj["annotations"] = dict(annotations)
    else:
        obj.pop("annotations", None)
    return canonical_json(obj)


@dataclass(frozen=True)
class Manifest:
    """An image manifest (OCI or Docker v2 schema 2)."""

    media_type: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: Mapping[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Serialise, keeping any fields we do not model (``subject``, ``artifactType``...)."""
        return _serialise(self.raw, self.media_type, self.annotations,
                          config=self.config.to_json(),
                          layers=[d.to_json() for d in self.layers])


@dataclass(frozen=True)
class Index:
    """An image index (OCI) or manifest list (Docker)."""

    media_type: str
    manifests: tuple[Descriptor, ...]
    annotations: Mapping[str, str] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return _serialise(self.raw, self.media_type, self.annotations,
                          manifests=[d.to_json() for d in self.manifests])


def _sniff_type(obj: Mapping[str, Any], declared: str | None) -> str:
    media = obj.get("mediaType") or ""
    if declared and declared.split(";")[0].strip() in ALL_MANIFEST_TYPES:
        declared = declared.split(";")[0].strip()
    else:
        declared = None
    mt = str(media or declared or "")
    if not mt:
        # OCI allows leaving mediaType out; tell the two apart by their fields.
        mt = OCI_INDEX if "manifests" in obj else OCI_MANIFEST
    return mt


def is_index(media_type: str) -> bool:
    return media_type.split(";")[0].strip() in INDEX_TYPES


def parse_manifest(body: bytes, media_type: str | None = None) -> Manifest:
    """Parse an image manifest; raise :class:`FormatError` for anything else."""
    obj = json_object(body, "manifest")
    mt = _sniff_type(obj, media_type)
    if mt not in MANIFEST_TYPES:
        raise FormatError(f"not an image manifest (media type {mt!r})")
    if obj.get("schemaVersion") != 2:
        raise FormatError(f"unsupported manifest schemaVersion {obj.get('schemaVersion')!r}")
    if "config" not in obj or not isinstance(obj.get("layers", []), list):
        raise FormatError("manifest lacks config or layers")
    ann = obj.get("annotations") or {}
    return Manifest(
        media_type=mt,
        config=Descriptor.from_json(obj["config"]),
        layers=tuple(Descriptor.from_json(d) for d in obj.get("layers") or []),
        annotations=dict(ann) if isinstance(ann, dict) else {},
        raw=obj,
    )


def parse_index(body: bytes, media_type: str | None = None) -> Index:
    """Parse an image index or Docker manifest list."""
    obj = json_object(body, "index")
    mt = _sniff_type(obj, media_type)
    if mt not in INDEX_TYPES:
        raise FormatError(f"not an image index (media type {mt!r})")
    if not isinstance(obj.get("manifests"), list):
        raise FormatError("index lacks manifests")
    ann = obj.get("annotations") or {}
    return Index(
        media_type=mt,
        manifests=tuple(Descriptor.from_json(d) for d in obj["manifests"]),
        annotations=dict(ann) if isinstance(ann, dict) else {},
        raw=obj,
    )


def parse_any(body: bytes, media_type: str | None = None) -> Manifest | Index:
    """Parse a manifest or an index, whichever ``body`` is."""
    obj = json_object(body, "manifest")
    mt = _sniff_type(obj, media_type)
    if mt in INDEX_TYPES:
        return parse_index(body, mt)
    return parse_manifest(body, mt)


def select_platform(index: Index, want: Platform | None = None) -> Descriptor:
    """The index entry for ``want`` (default: this host); :class:`NotFound` if none matches."""
    target = want or host_platform()
    candidates = [d for d in index.manifests
                  if d.media_type in MANIFEST_TYPES or not d.media_type]
    for d in candidates:
        if d.platform is not None and d.platform.matches(target):
            return d
    available = ", ".join(str(d.platform) for d in candidates if d.platform) or "none"
    raise NotFound(f"no manifest for platform {target} in index (available: {available})")


@dataclass(frozen=True)
class ImageConfig:
    """An image config; only ``rootfs.diff_ids`` and the platform are modelled, the rest kept."""

    raw: Mapping[str, Any]

    @classmethod
    def parse(cls, body: bytes) -> ImageConfig:
        obj = json_object(body, "image config")
        rootfs = obj.get("rootfs")
        if not isinstance(rootfs, dict) or not isinstance(rootfs.get("diff_ids"), list):
            raise FormatError("image config lacks rootfs.diff_ids")
        return cls(raw=obj)

    @property
    def diff_ids(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.raw["rootfs"]["diff_ids"])

    @property
    def platform(self) -> Platform | None:
        if "os" in self.raw and "architecture" in self.raw:
            return Platform(os=str(self.raw["os"]),
                            architecture=_normalise_arch(str(self.raw["architecture"])),
                            variant=self.raw.get("variant"))
        return None

    def with_diff_ids(self, diff_ids: Iterable[str]) -> ImageConfig:
        """A copy whose ``rootfs.diff_ids`` are ``diff_ids`` (same count required)."""
        new = [validate_digest(d) for d in diff_ids]
        if len(new) != len(self.diff_ids):
            raise InvalidArgument(
                f"config has {len(self.diff_ids)} diff_ids, got {len(new)} replacements")
        obj = dict(self.raw)
        obj["rootfs"] = {**self.raw["rootfs"], "diff_ids": new}
        return ImageConfig(raw=obj)

    def to_bytes(self) -> bytes:
        return canonical_json(self.raw)


def build_manifest(config: Descriptor, layers: Sequence[Descriptor], *,
                   media_type: str = OCI_MANIFEST,
                   annotations: Mapping[str, str] | None = None) -> Manifest:
    """A fresh manifest from descriptors."""
    return Manifest(media_type=media_type, config=config, layers=tuple(layers),
                    annotations=dict(annotations or {}), raw={})
