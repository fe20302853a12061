"""`coldstart convert` takes the names people type (docker://REF, zstd:chunked, platform lists
as containerd parses them), prints -o json, and reports progress by bytes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from coldstart.oci.convert import convert_image
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import parse_index
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.fixtures.registry import Registry
from tests.integration.oci.oci_testimages import (
    base_layer,
    build_image,
    push_index,
    upper_layer,
    write_layout,
)

pytestmark = pytest.mark.integration


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=240, check=False)


def test_convert_reads_the_names_people_type(registry: Registry, tmp_path: Path) -> None:
    images = [(arch, build_image([base_layer(busybox=False, big=20_000 + i), upper_layer()],
                                 arch=arch))
              for i, arch in enumerate(("amd64", "arm64", "s390x"))]
    src = f"{registry.host}/conventions/app:v1"
    with RegistryClient() as client:
        push_index(client, Reference.parse(src), images)
    out = _cli("convert", f"docker://{src}", f"oci:{tmp_path / 'out'}:v1",
               "--format", "zstd:chunked", "--platform", "Linux/AMD64,linux/aarch64",
               "-o", "json", "-q")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["format"] == "zstd:chunked"
    assert sorted(img["platform"] for img in doc["images"]) == ["linux/amd64", "linux/arm64"]
    assert any("s390x" in s for s in doc["skipped"])
    layout = OciLayout(tmp_path / "out")
    index = parse_index(layout.read_blob(layout.resolve("v1").digest))
    assert sorted(str(d.platform) for d in index.manifests) == ["linux/amd64", "linux/arm64"]

    both = _cli("convert", src, f"oci:{tmp_path / 'x'}", "--platform", "linux/amd64",
                "--all-platforms")
    assert both.returncode == 2 and "not both" in both.stderr


class _Counting:
    """A ByteProgress that counts (the CLI's draws a bar)."""

    def __init__(self) -> None:
        self.expected = 0
        self.phases: Counter[str] = Counter()
        self._lock = threading.Lock()

    def expect(self, n: int) -> None:
        with self._lock:
            self.expected += n

    def advance(self, phase: str, n: int) -> None:
        with self._lock:
            self.phases[phase] += n


def test_convert_reports_every_byte_of_every_phase(tmp_path: Path) -> None:
    image = build_image([base_layer(busybox=False, big=400_000), upper_layer()])
    write_layout(tmp_path / "src", image, "v1")
    progress = _Counting()
    convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'dst'}:v1", progress=progress,
                  chunk_size=64 << 10)
    total = sum(len(b) for b in image.blobs)
    assert progress.expected == total
    assert progress.phases == {"download": total, "convert": total}
    # converting it again keeps the (now seekable) layers: still every byte, once
    again = _Counting()
    convert_image(f"oci:{tmp_path / 'dst'}:v1", f"oci:{tmp_path / 'dst2'}:v1", progress=again)
    assert again.phases["download"] == again.expected == again.phases["convert"] > 0
