"""Interop with stargz-snapshotter's converter (Debian's ctr-remote) and containerd's unpacker.

A real containerd (own root, state, socket; stopped by PID) holds the content store that
ctr-remote works on. Checked both ways:

* layers that ctr-remote converts (eStargz, zstd:chunked) open with coldstart.format, TOC
  digest verified, and every file's bytes and metadata equal the original tar's;
* layers that coldstart writes are read by ctr-remote (same TOC digest) and unpacked by
  containerd (which checks the diff_id against the image config).
"""

from __future__ import annotations

import gzip
import io
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldstart.format import FileReadAt, convert_layer, open_layer
from coldstart.format.layer import ESTARGZ_TOC_DIGEST
from tests.fixtures.procs import daemon, unix_open
from tests.integration.format.oci_archive import exported_layers, oci_archive, sha
from tests.unit.format.layers import assert_same_as_tar, every_kind_tar

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _tools_present() -> None:
    # a missing tool is an install problem to fix, not a reason to pass quietly
    missing = [t for t in ("containerd", "ctr-remote") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (scripts/install.sh installs them)")

_DISABLED = ('"io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs", '
             '"io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", '
             '"io.containerd.snapshotter.v1.zfs", "io.containerd.internal.v1.tracing", '
             '"io.containerd.tracing.processor.v1.otlp"')


@dataclass
class Ctr:
    base: Path
    address: str
    namespace: str = "fmt"

    def run(self, tool: str, *args: str, stdin: bytes | None = None) -> str:
        argv = [tool, "--address", self.address, "--namespace", self.namespace, *args]
        res = subprocess.run(argv, input=stdin, capture_output=True, timeout=120, check=False)
        if res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {res.returncode}: "
                                 f"{res.stderr.decode(errors='replace')}")
        return res.stdout.decode(errors="replace")

    def import_image(self, archive: bytes, *, unpack: bool) -> None:
        path = self.base / f"in-{sha(archive)[7:19]}.tar"
        path.write_bytes(archive)
        self.run("ctr", "images", "import", *([] if unpack else ["--no-unpack"]), str(path))

    def store_layer(self, blob: bytes, media_type: str, diff_id: str) -> str:
        """Put ``blob`` in the content store, held by an image (bare ``ctr content ingest``
        content is unreferenced once ctr's lease ends, and containerd's GC may drop it)."""
        digest = sha(blob)
        archive = oci_archive(f"example.com/fmt/blob-{digest[7:19]}:v1",
                              [(blob, media_type, {})], [diff_id])
        self.import_image(archive, unpack=False)
        return digest


@pytest.fixture(scope="module")
def ctr() -> Iterator[Ctr]:
    # Short path: unix socket names must stay under 108 bytes.
    base = Path(tempfile.mkdtemp(prefix="cfmt", dir="/tmp"))
    config = base / "config.toml"
    config.write_text(
        f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
        f"disabled_plugins = [{_DISABLED}]\n"
        f'[grpc]\n  address = "{base}/c.sock"\n[ttrpc]\n  address = "{base}/c.sock.ttrpc"\n'
        '[debug]\n  address = ""\n[metrics]\n  address = ""\n')
    try:
        with daemon(["containerd", "--config", str(config)], log=base / "containerd.log",
                    ready=unix_open(base / "c.sock"), what="containerd"):
            yield Ctr(base, str(base / "c.sock"))
    finally:
        subprocess.run(["umount", "-R", "-l", str(base / "root")], capture_output=True,
                       check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def source() -> bytes:
    return every_kind_tar(portable=True)


@pytest.mark.parametrize("flag,media", [("--estargz", "tar+gzip"), ("--zstdchunked", "tar+zstd")])
def test_ctr_remote_layers_read_back(ctr: Ctr, source: bytes, flag: str, media: str) -> None:
    name = f"example.com/fmt/{flag.strip('-')}"
    archive = oci_archive(f"{name}:orig", [(gzip.compress(source),
                          "application/vnd.oci.image.layer.v1.tar+gzip", {})], [sha(source)])
    ctr.import_image(archive, unpack=False)
    ctr.run("ctr-remote", "images", "convert", flag, "--oci", f"{name}:orig", f"{name}:conv")
    out = ctr.base / f"out-{flag.strip('-')}.tar"
    ctr.run("ctr", "images", "export", str(out), f"{name}:conv")
    [(desc, blob)] = exported_layers(out, ctr.base / f"x-{flag.strip('-')}")
    assert desc["mediaType"].endswith(media)
    assert ESTARGZ_TOC_DIGEST in desc["annotations"]
    with FileReadAt(blob) as ra:
        layer = open_layer(ra, annotations=desc["annotations"])
        assert layer.verified
        assert layer.format == ("estargz" if flag == "--estargz" else "zstd:chunked")
        assert layer.toc_digest == desc["annotations"][ESTARGZ_TOC_DIGEST]
        assert_same_as_tar(layer, source)


@pytest.mark.parametrize("fmt,legacy,zstd_flag", [("estargz", False, False),
                                                   ("zstd:chunked", True, True)])
def test_ctr_remote_reads_our_toc(ctr: Ctr, source: bytes, fmt: str, legacy: bool,
                                  zstd_flag: bool) -> None:
    out = io.BytesIO()
    res = convert_layer(io.BytesIO(source), out, format=fmt, chunk_size=64 << 10,
                        legacy_footer=legacy)
    digest = ctr.store_layer(out.getvalue(), res.media_type, res.diff_id)
    got = ctr.run("ctr-remote", "images", "get-toc-digest",
                  *(["--zstdchunked"] if zstd_flag else []), digest).strip()
    assert got == res.annotations[ESTARGZ_TOC_DIGEST]


@pytest.mark.parametrize("fmt,legacy", [("estargz", False), ("zstd:chunked", False),
                                        ("zstd:chunked", True)])
def test_containerd_unpacks_our_layers(ctr: Ctr, source: bytes, fmt: str, legacy: bool) -> None:
    out = io.BytesIO()
    res = convert_layer(io.BytesIO(source), out, format=fmt, chunk_size=64 << 10,
                        prefetch=["etc/hostname"], legacy_footer=legacy)
    name = f"example.com/fmt/ours-{fmt.replace(':', '-')}-{int(legacy)}:v1"
    archive = oci_archive(name, [(out.getvalue(), res.media_type, res.annotations)],
                          [res.diff_id])
    # Unpacking makes containerd decompress the blob and check it against the config's diff_id.
    ctr.import_image(archive, unpack=True)
    listing = ctr.run("ctr", "images", "check")
    assert name in listing


def test_containerd_unpack_check_is_real(ctr: Ctr, source: bytes) -> None:
    """The unpack test above can fail: a wrong diff_id makes containerd refuse the layer."""
    out = io.BytesIO()
    res = convert_layer(io.BytesIO(source), out, format="zstd:chunked")
    archive = oci_archive("example.com/fmt/wrong:v1",
                          [(out.getvalue(), res.media_type, res.annotations)], [sha(b"other")])
    with pytest.raises(AssertionError, match="exited"):
        ctr.import_image(archive, unpack=True)
