"""The stargz peer for ``coldstart bench``: built from Debian's Go sources, run beside a real
containerd as proxy snapshotter ``stargz``; a small gzip image converted to eStargz (plain and
optimized) with ``ctr-remote`` is lazily pulled and run, and nothing is left behind."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from coldstart.errors import FailedPrecondition
from coldstart.oci.manifest import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack import stargz
from coldstart.stack.containerd import temp_containerd
from coldstart.stack.images import Entry, busybox_entries, layer_tar
from coldstart.stack.registry import Registry
from tests.fixtures.procs import processes_naming

pytestmark = [pytest.mark.integration, pytest.mark.e2e,
              pytest.mark.skipif(stargz.stargz_missing() is not None,
                                 reason=f"stargz peer: {stargz.stargz_missing()}")]

HELLO = b"hello from an eStargz layer\n"


def push_gzip_image(host: str, name: str) -> str:
    """Push a two-layer gzip image (busybox; /etc/hello.txt) and return its reference."""
    ref = f"{host}/{name}:gzip"
    reference = Reference.parse(ref)
    tars = [layer_tar(busybox_entries()),
            layer_tar([Entry("etc", "dir", mode=0o755), Entry("etc/hello.txt", data=HELLO)])]
    layers = []
    with RegistryClient() as client:
        for tar in tars:
            blob = gzip.compress(tar, compresslevel=6, mtime=0)
            client.push_blob(reference, blob, digest_of(blob))
            layers.append({"mediaType": OCI_LAYER_GZIP, "digest": digest_of(blob),
                           "size": len(blob)})
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
                             "rootfs": {"type": "layers",
                                        "diff_ids": [digest_of(t) for t in tars]}}).encode()
        cdigest = client.push_blob(reference, config)
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": cdigest, "size": len(config)},
                    "layers": layers}
        client.push_manifest(reference, json.dumps(manifest).encode(), OCI_MANIFEST)
    return ref


def mounts_under(path: Path) -> list[str]:
    """Mount points (with their fs type) at or below ``path``."""
    prefix = os.path.realpath(path)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = left.split()[4]
            if point == prefix or point.startswith(prefix + "/"):
                out.append(f"{point} ({right.split()[0]})")
    return out


@pytest.mark.timeout(1200)
def test_estargz_image_runs_on_the_stargz_peer(registry: Registry, tmp_path: Path) -> None:
    binary = stargz.build_stargz_daemon()
    assert stargz.build_stargz_daemon() == binary      # cached: the same binary, not rebuilt

    src = push_gzip_image(registry.host, "peer/busybox")
    esgz, optimized = src.replace(":gzip", ":esgz"), src.replace(":gzip", ":esgz-opt")
    stargz.make_estargz_images(src, esgz, optimized, ["/bin/cat", "/etc/hello.txt"],
                               tmp_path / "work", env=["LANG=C"])
    with RegistryClient() as client:                     # both pushed, as eStargz
        for ref in (esgz, optimized):
            manifest = json.loads(client.get_manifest(Reference.parse(ref))[0])
            if "manifests" in manifest:                 # an index: its (only) manifest
                pinned = f"{ref.rpartition(':')[0]}@{manifest['manifests'][0]['digest']}"
                manifest = json.loads(client.get_manifest(Reference.parse(pinned))[0])
            assert all("containerd.io/snapshot/stargz/toc.digest" in layer["annotations"]
                       for layer in manifest["layers"])

    base = tmp_path / "sgz"
    with stargz.start_stargz(base, binary=binary) as sgz, \
            temp_containerd(proxies={"stargz": sgz.socket}) as ctd:
        ctd_dir = str(Path(ctd.address).parent)
        for n, ref in enumerate((esgz, optimized)):
            stargz.rpull(ctd.address, ref)
            # lazily pulled: its layers are FUSE mounts of the peer, not unpacked files
            assert any("(fuse" in m for m in mounts_under(sgz.root)), mounts_under(sgz.root)
            out = ctd.ctr("run", "--rm", "--snapshotter", "stargz", ref, f"sgz-{n}",
                          "cat", "/etc/hello.txt")
            assert out.stdout.encode() == HELLO
        assert sgz.cpu_seconds() > 0
        proc = sgz.proc
    assert proc.poll() is not None
    assert mounts_under(base) == []
    assert processes_naming(str(base), ctd_dir) == []
    assert not Path(ctd_dir).exists()


def test_failed_build_reports_go_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "src" / "main.go"
    broken.parent.mkdir()
    broken.write_text("package main\n\nfunc main() { undefinedThing() }\n")
    monkeypatch.setattr(stargz, "MAIN_GO", broken)
    with pytest.raises(FailedPrecondition, match="undefinedThing"):
        stargz.build_stargz_daemon(tmp_path / "cache", timeout=300)
    assert not list((tmp_path / "cache").glob("stargz-peer-*"))
