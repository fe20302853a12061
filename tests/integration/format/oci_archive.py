"""Tiny OCI image archives (for ``ctr images import``) and their export's layer descriptors."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_archive(name: str, layers: list[tuple[bytes, str, dict[str, str]]],
                diff_ids: list[str]) -> bytes:
    """An OCI image layout tar holding one image called ``name``."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": mt, "digest": sha(b), "size": len(b),
                    **({"annotations": ann} if ann else {})} for b, mt, ann in layers],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
        "size": len(manifest), "annotations": {"io.containerd.image.name": name}}]}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        def put(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        put("index.json", index)
        for blob in (config, manifest, *(b for b, _, _ in layers)):
            put("blobs/sha256/" + sha(blob)[7:], blob)
    return out.getvalue()


def exported_layers(archive: Path, dest: Path) -> list[tuple[dict[str, Any], Path]]:
    """Unpack an exported OCI archive; return (descriptor, blob path) for each layer."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")
    index = json.loads((dest / "index.json").read_text())
    digest = index["manifests"][0]["digest"]
    manifest = json.loads((dest / "blobs/sha256" / digest[7:]).read_text())
    return [(d, dest / "blobs/sha256" / d["digest"][7:]) for d in manifest["layers"]]
