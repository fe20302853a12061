"""containerd unpacks a (non-lazy) image into our snapshots and runs a container on them."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import uuid
from pathlib import Path

import pytest

from tests.fixtures.containerd import Containerd, SnapshotterDaemon
from tests.integration.snapshotter.snapclient import SnapClient

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

BUSYBOX = Path("/bin/busybox")
LAYER = "application/vnd.oci.image.layer.v1.tar"


def _tar(entries: list[tuple[str, bytes | None, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, mode in entries:
            ti = tarfile.TarInfo(name)
            ti.mode, ti.mtime = mode, 1_700_000_000
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def oci_archive(name: str) -> bytes:
    """An OCI image archive of two layers: busybox, then /etc/hello."""
    layers = [
        _tar([("bin", None, 0o755), ("bin/busybox", BUSYBOX.read_bytes(), 0o755)]),
        _tar([("etc", None, 0o755), ("etc/hello", b"hello from layer 2\n", 0o644)]),
    ]
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/busybox", "cat", "/etc/hello"]},
        "rootfs": {"type": "layers", "diff_ids": [_digest(x) for x in layers]},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _digest(config), "size": len(config)},
        "layers": [{"mediaType": LAYER, "digest": _digest(x), "size": len(x)} for x in layers],
    }).encode()
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": _digest(manifest), "size": len(manifest),
                       "annotations": {"io.containerd.image.name": name}}],
    }).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        files = {"oci-layout": b'{"imageLayoutVersion":"1.0.0"}', "index.json": index}
        for blob in (*layers, config, manifest):
            files[f"blobs/sha256/{_digest(blob)[7:]}"] = blob
        for path, data in files.items():
            ti = tarfile.TarInfo(path)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return out.getvalue()


def test_ctr_runs_a_container_on_our_snapshots(containerd: Containerd,
                                               coldstart_snapshotter: SnapshotterDaemon,
                                               tmp_path: Path) -> None:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    name = f"coldstart.test/busybox:{ns}"
    archive = tmp_path / "image.tar"
    archive.write_bytes(oci_archive(name))
    containerd.ctr("images", "import", "--snapshotter", "coldstart", str(archive),
                   namespace=ns)
    run = containerd.ctr("run", "--rm", "--snapshotter", "coldstart", name, "c1",
                         namespace=ns, timeout=120)
    assert run.stdout == "hello from layer 2\n"
    plugins = containerd.ctr("plugins", "ls").stdout
    assert any(line.split()[:2] == ["io.containerd.snapshotter.v1", "coldstart"]
               and line.split()[-1] == "ok" for line in plugins.splitlines())

    # the unpacked layers are ours: two committed snapshots in our backend with the files
    ours = SnapClient(coldstart_snapshotter.socket, "", None)
    committed = [i for i in ours.list("kind==committed") if i.name.startswith(f"{ns}/")]
    ours.close()
    assert len(committed) == 2
