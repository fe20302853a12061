"""Start-up profiles: per layer, the files a start-up read, in first-access order.

A profile is what ``coldstart optimize`` records and ``coldstart convert --profile`` applies: each
layer's files are written first, in access order, followed by the prefetch landmark, so a node
fetches the start-up's set in a few large requests as soon as the layer is mounted.

The JSON form (``schema`` :data:`SCHEMA`)::

    {"schema": "coldstart.dev/profile/v1", "image": "…", "ready": "exit", "seconds": 2.1,
     "layers": [{"index": 0, "diff_id": "sha256:…", "digest": "sha256:…",
                 "files": [{"path": "usr/bin/python3.11", "t": 0.01, "ranges": [[0, 4096]]}]}]}

``index`` is the layer's position in the manifest, ``diff_id`` the source image's uncompressed
layer digest (how a layer is matched first), ``digest`` the blob that was recorded, ``t`` seconds
since the layer was mounted, ``ranges`` ``[offset, length]`` pairs of what was read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldstart.errors import InvalidArgument
from coldstart.prefetch.recorder import FileAccess

__all__ = ["SCHEMA", "LayerProfile", "Profile", "file_overlap", "load_profile", "profile_paths"]

SCHEMA = "coldstart.dev/profile/v1"


@dataclass(frozen=True)
class LayerProfile:
    index: int
    diff_id: str = ""
    digest: str = ""
    files: tuple[FileAccess, ...] = ()

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "diff_id": self.diff_id, "digest": self.digest,
                "files": [f.as_dict() for f in self.files]}


@dataclass(frozen=True)
class Profile:
    image: str
    layers: tuple[LayerProfile, ...]
    ready: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def files(self) -> int:
        return sum(len(x.files) for x in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "image": self.image, "ready": self.ready,
                "seconds": round(self.seconds, 3), **self.extra,
                "layers": [x.to_json() for x in self.layers]}

    def dumps(self) -> str:
        """The JSON text: one line per file, so that a diff of two profiles reads well."""
        doc = self.to_json()
        lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in doc.items()
                         if k != "layers"]
        lines.append(' "layers": [')
        for i, x in enumerate(self.layers):
            lines.append(f'  {{"index": {x.index}, "diff_id": {json.dumps(x.diff_id)}, '
                         f'"digest": {json.dumps(x.digest)}, "files": [')
            lines += [f"   {json.dumps(f.as_dict())}{',' if j < len(x.files) - 1 else ''}"
                      for j, f in enumerate(x.files)]
            lines.append(f"  ]}}{',' if i < len(self.layers) - 1 else ''}")
        lines += [" ]", "}"]
        return "\n".join(lines) + "\n"

    def for_layer(self, index: int, diff_id: str, layer_count: int) -> LayerProfile | None:
        """The profile of the image's layer ``index`` (of ``layer_count``) with ``diff_id``:
        the profile layer with that diff_id, else the one at that index when the profile has
        as many layers; ``None`` when no profile layer matches."""
        for x in self.layers:
            if diff_id and x.diff_id == diff_id:
                return x
        if len(self.layers) == layer_count:
            for x in self.layers:
                if x.index == index:
                    return x
        return None

    @classmethod
    def parse(cls, text: str | bytes, *, source: str = "profile") -> Profile:
        """Parse and check a profile; InvalidArgument (one line, naming ``source``) if bad."""
        if not text or not str(text if isinstance(text, str) else text.decode(
                "utf-8", "replace")).strip():
            raise InvalidArgument(f"{source}: the profile is empty")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(f"{source}: not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(f"{source}: a profile is a JSON object")
        if data.get("schema") != SCHEMA:
            raise InvalidArgument(f"{source}: schema {data.get('schema')!r} is not {SCHEMA!r}")
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list):
            raise InvalidArgument(f"{source}: 'layers' must be a list")
        layers = []
        seen: set[int] = set()
        for n, raw in enumerate(raw_layers):
            where = f"{source}: layers[{n}]"
            if not isinstance(raw, dict):
                raise InvalidArgument(f"{where} is not an object")
            index = raw.get("index")
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise InvalidArgument(f"{where}: 'index' must be an integer >= 0")
            if index in seen:
                raise InvalidArgument(f"{where}: layer index {index} appears twice")
            seen.add(index)
            files = raw.get("files", [])
            if not isinstance(files, list):
                raise InvalidArgument(f"{where}: 'files' must be a list")
            layers.append(LayerProfile(index=index, diff_id=_str(raw, "diff_id", where),
                                       digest=_str(raw, "digest", where),
                                       files=tuple(_file(f, f"{where}.files[{i}]")
                                                   for i, f in enumerate(files))))
        seconds = data.get("seconds", 0.0)
        extra = {k: v for k, v in data.items()
                 if k not in ("schema", "image", "ready", "seconds", "layers")}
        return cls(image=str(data.get("image", "")), ready=str(data.get("ready", "")),
                   seconds=float(seconds) if isinstance(seconds, int | float) else 0.0,
                   layers=tuple(sorted(layers, key=lambda x: x.index)), extra=extra)


def _str(raw: dict[str, Any], key: str, where: str) -> str:
    v = raw.get(key, "")
    if not isinstance(v, str):
        raise InvalidArgument(f"{where}: {key!r} must be a string")
    return v


def _file(raw: object, where: str) -> FileAccess:
    path: object
    if isinstance(raw, str):        # a bare path: no timing or ranges known
        path, t, ranges = raw, 0.0, []
    elif isinstance(raw, dict):
        path = raw.get("path")
        t = raw.get("t", 0.0)
        ranges = raw.get("ranges", [])
        if not isinstance(t, int | float) or isinstance(t, bool):
            raise InvalidArgument(f"{where}: 't' must be a number")
        if not isinstance(ranges, list) or not all(
                isinstance(r, list) and len(r) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r)
                for r in ranges):
            raise InvalidArgument(f"{where}: 'ranges' must be [offset, length] pairs")
    else:
        raise InvalidArgument(f"{where}: a file is a path or an object")
    if not isinstance(path, str) or not path.strip("/") or "\0" in path:
        raise InvalidArgument(f"{where}: bad path {path!r}")
    parts = path.strip("/").split("/")
    if ".." in parts:
        raise InvalidArgument(f"{where}: path {path!r} escapes the layer")
    return FileAccess("/".join(p for p in parts if p not in ("", ".")), float(t),
                      [(int(a), int(a) + int(n)) for a, n in ranges])


def load_profile(path: Path | str) -> Profile:
    """Read a profile file; InvalidArgument (one line) if it is missing, empty or corrupt."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read profile {path}: {exc.strerror or exc}") from None
    return Profile.parse(text, source=str(path))


def file_overlap(a: Iterable[str], b: Iterable[str]) -> float:
    """Files two recordings share: shared / either (1.0 for two empty sets).

    >>> file_overlap(["a", "b", "c"], ["b", "c", "d"])
    0.5
    """
    sa, sb = set(a), set(b)
    union = sa | sb
    return len(sa & sb) / len(union) if union else 1.0


def profile_paths(profile: Profile) -> Sequence[str]:
    """Every ``layer-index:path`` of a profile (for comparing two recordings)."""
    return [f"{x.index}:{p}" for x in profile.layers for p in x.paths]
