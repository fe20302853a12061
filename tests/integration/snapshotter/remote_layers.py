"""Seekable layers pushed to the test registry, and the labels containerd would pass for them."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass

from coldstart.lazyfs import spec as ls
from coldstart.lazyfs.spec import LayerSpec
from tests.integration.lazy.lazy_helpers import convert, push_layer, realistic_bytes


@dataclass(frozen=True)
class PushedLayer:
    spec: LayerSpec
    diff_id: str
    files: dict[str, bytes]


def make_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        dirs: set[str] = set()
        for name in sorted(files):
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
                    tf.addfile(ti)
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(files[name]), 0o644, 1_700_000_000
            tf.addfile(ti, io.BytesIO(files[name]))
    return buf.getvalue()


def push_files(host: str, repo: str, files: dict[str, bytes],
               fmt: str = "zstd:chunked") -> PushedLayer:
    blob, result = convert(make_tar(files), fmt, chunk_size=64 << 10)
    spec = push_layer(host, repo, blob, result)
    return PushedLayer(spec=spec, diff_id=result.diff_id, files=files)


def sample_files(seed: int, n: int = 6) -> dict[str, bytes]:
    return {f"layer{seed}/f{i:02d}.bin": realistic_bytes(20_000 + 7_919 * i, seed * 100 + i)
            for i in range(n)}


def chain_id(parent_chain: str, diff_id: str) -> str:
    """OCI ChainID: the first layer's is its DiffID, then sha256(parent + " " + diff_id)."""
    if not parent_chain:
        return diff_id
    return "sha256:" + hashlib.sha256(f"{parent_chain} {diff_id}".encode()).hexdigest()


def remote_labels(spec: LayerSpec, chain: str) -> dict[str, str]:
    """What containerd passes for a layer annotated by a ``coldstart pull``-style client."""
    labels = {
        ls.TARGET_SNAPSHOT_REF: chain,
        ls.REMOTE_REFERENCE: spec.reference,
        ls.REMOTE_DIGEST: spec.digest,
        ls.REMOTE_SIZE: str(spec.size),
        ls.REMOTE_MEDIA_TYPE: spec.media_type,
        ls.REMOTE_MANIFEST_DIGEST: spec.manifest_digest,
    }
    extra = {k: v for k, v in spec.annotations.items() if not k.startswith(ls.SNAPSHOT_PREFIX)}
    labels.update({k: v for k, v in spec.annotations.items() if k.startswith(ls.SNAPSHOT_PREFIX)})
    if extra:
        labels[ls.REMOTE_ANNOTATIONS] = json.dumps(extra, sort_keys=True)
    return labels
