"""convert_image and `coldstart convert` between OCI layouts and a real registry."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

from coldstart.errors import IntegrityError, InvalidArgument, NotFound
from coldstart.format.layer import is_seekable, open_layer
from coldstart.oci.convert import ConvertSummary, convert_image
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import (
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    ImageConfig,
    canonical_json,
    digest_of,
    parse_index,
    parse_manifest,
)
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.remote import open_blob
from tests.fixtures.registry import Registry
from tests.integration.oci.oci_testimages import (
    BuiltImage,
    TarBuilder,
    base_layer,
    build_image,
    push_image,
    push_index,
    upper_layer,
    write_layout,
)

pytestmark = pytest.mark.integration

FORMATS = [("zstd:chunked", OCI_LAYER_ZSTD), ("estargz", OCI_LAYER_GZIP)]
_ADDED = {"stargz.index.json", ".prefetch.landmark", ".no.prefetch.landmark"}


def _untar(blob: bytes) -> bytes:
    if blob[:2] == b"\x1f\x8b":
        return gzip.decompress(blob)
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob),
                                                      read_across_frames=True).read()


def _entries(tar_bytes: bytes) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tf:
        for m in tf.getmembers():
            name = m.name.removeprefix("./").rstrip("/")
            if name in _ADDED:
                continue
            data = tf.extractfile(m).read() if m.isreg() else b""  # type: ignore[union-attr]
            xattrs = {k: v for k, v in m.pax_headers.items() if k.startswith("SCHILY.xattr.")}
            out[name] = (m.type, m.mode, m.uid, m.gid, m.linkname.removeprefix("./"),
                         hashlib.sha256(data).hexdigest(), xattrs, m.devmajor, m.devminor)
    return out


def _image() -> BuiltImage:
    return build_image([base_layer(busybox=False, big=150_000), upper_layer()])


def _check_converted(layout: OciLayout, tag: str, source: BuiltImage, media_type: str) -> None:
    manifest = parse_manifest(layout.read_blob(layout.resolve(tag).digest))
    config = ImageConfig.parse(layout.read_blob(manifest.config.digest))
    assert len(manifest.layers) == len(source.layers)
    for desc, diff_id, original in zip(manifest.layers, config.diff_ids, source.layers,
                                       strict=True):
        assert desc.media_type == media_type
        assert is_seekable(desc.annotations, desc.media_type)
        blob = layout.read_blob(desc.digest)
        assert len(blob) == desc.size
        tar = _untar(blob)
        # the config's diff_id is the new layer's uncompressed digest
        assert digest_of(tar) == diff_id
        assert _entries(tar) == _entries(original)
        # the TOC verifies against the manifest annotation, and files read back through it
        from coldstart.format.readat import BytesReadAt
        layer = open_layer(BytesReadAt(blob), annotations=desc.annotations)
        for name, info in _entries(original).items():
            if info[0] == tarfile.REGTYPE:
                data = layer.read_file(name)
                assert hashlib.sha256(data).hexdigest() == info[5], name


@pytest.mark.parametrize(("fmt", "media_type"), FORMATS)
def test_layout_to_layout(tmp_path: Path, fmt: str, media_type: str) -> None:
    image = _image()
    write_layout(tmp_path / "src", image, "v1")
    seen: list[tuple[int, int]] = []
    summary = convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'dst'}:v1-conv",
                            format=fmt, chunk_size=64 * 1024,
                            on_layer=lambda layer, done, total: seen.append((done, total)))
    assert isinstance(summary, ConvertSummary)
    assert sorted(seen) == [(1, 2), (2, 2)]
    assert summary.layers_converted == 2 and summary.layers_kept == 0
    assert summary.size_before == sum(len(b) for b in image.blobs)
    assert summary.size_after == sum(x.size_after for x in summary.images[0].layers) > 0
    assert summary.images[0].platform == "linux/amd64"
    dst = OciLayout(tmp_path / "dst")
    assert dst.resolve("v1-conv").digest == summary.digest
    _check_converted(dst, "v1-conv", image, media_type)
    json.dumps(summary.to_json())

    # converting the converted image again keeps every layer: same bytes, same digest
    again = convert_image(f"oci:{tmp_path / 'dst'}:v1-conv", f"oci:{tmp_path / 'dst'}:again",
                          format=fmt)
    assert again.layers_kept == 2 and again.layers_converted == 0
    assert again.digest == summary.digest


def test_registry_index_to_registry(registry: Registry, tmp_path: Path) -> None:
    amd, arm = _image(), build_image([upper_layer()], arch="arm64")
    with RegistryClient(timeout=30) as client:
        src = Reference.parse(f"{registry.host}/convert/multi:v1")
        push_index(client, src, [("amd64", amd), ("arm64", arm)])
        dst_text = f"{registry.host}/convert/multi-zstd:v1"
        summary = convert_image(str(src), dst_text, format="zstd-chunked", client=client,
                                chunk_size=64 * 1024)
        assert summary.media_type == OCI_INDEX
        # arm's only layer equals amd's second layer: converted once, used twice
        assert summary.layers_converted == 2
        assert {img.platform for img in summary.images} == {"linux/amd64", "linux/arm64"}
        body, media, digest = client.get_manifest(Reference.parse(dst_text))
        assert media == OCI_INDEX and digest == summary.digest
        index = parse_index(body)
        assert sorted(str(d.platform) for d in index.manifests) == ["linux/amd64",
                                                                   "linux/arm64"]
        for desc in index.manifests:
            r = client.resolve(Reference.parse(dst_text), desc.platform)
            assert all(x.media_type == OCI_LAYER_ZSTD for x in r.manifest.layers)
            top = r.manifest.layers[-1]   # upper_layer() in both platforms
            blob = open_blob(client, r.ref, top.digest, top.size)
            opened = open_layer(blob, annotations=top.annotations)
            assert opened.read_file("data/new.txt") == b"new in layer 2\n" * 100

        # skopeo (containers/image) accepts the converted index and every blob in it
        out = subprocess.run(["skopeo", "--insecure-policy", "copy", "--all",
                              "--src-tls-verify=false", f"docker://{dst_text}",
                              f"oci:{tmp_path / 'skopeo'}:v1"],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert OciLayout(tmp_path / "skopeo").resolve("v1").digest == summary.digest

        # only one platform, into a layout
        one = convert_image(str(src), f"oci:{tmp_path / 'arm'}:arm", client=client,
                            platforms=["linux/arm64"])
        assert [img.platform for img in one.images] == ["linux/arm64"]
        assert "not selected" in one.skipped[0]
        assert parse_index(OciLayout(tmp_path / "arm").read_blob(one.digest)).manifests[0] \
            .platform is not None


def test_same_registry_mounts_kept_layers(registry: Registry) -> None:
    image = _image()
    with RegistryClient(timeout=30) as client:
        src = Reference.parse(f"{registry.host}/convert/mount-src:v1")
        push_image(client, src, image)
        first = convert_image(str(src), f"{registry.host}/convert/mount-mid:v1",
                              client=client)
        before = registry.access_log.read_text().count("mount=")
        # every layer is seekable now: a copy to a third repository mounts them, uploads none
        again = convert_image(f"{registry.host}/convert/mount-mid:v1",
                              f"{registry.host}/convert/mount-dst:v1", client=client)
        assert again.layers_kept == 2 and again.digest == first.digest
        log = registry.access_log.read_text()
        assert log.count("mount=") - before >= 2
        assert "PATCH /v2/convert/mount-dst/blobs/uploads" not in log


def test_layout_to_registry_and_cli(registry: Registry, tmp_path: Path) -> None:
    image = _image()
    write_layout(tmp_path / "src", image, "v1")
    prefetch = tmp_path / "prefetch.txt"
    prefetch.write_text("# start-up files\n/etc/hostname\ndata/new.txt\n")
    dst = f"{registry.host}/convert/cli:v1-estargz"
    out = subprocess.run(
        [sys.executable, "-m", "coldstart.cli", "convert", f"oci:{tmp_path / 'src'}:v1", dst,
         "--format", "estargz", "--chunk-size", "64K", "--prefetch-list", str(prefetch),
         "--json", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr
    assert "[2/2]" in out.stderr and "2 layer(s) converted to estargz" in out.stderr
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert out.stdout.strip() == f"{dst}@{doc['digest']}"
    with RegistryClient() as client:
        r = client.resolve(Reference.parse(dst))
        top = r.manifest.layers[1]
        blob = open_blob(client, r.ref, top.digest, top.size)
        layer = open_layer(blob, annotations=top.annotations)
        assert layer.read_file("etc/hostname") == b"converted\n"
    with tarfile.open(fileobj=io.BytesIO(_untar(client_blob(registry, r.ref, top.digest))),
                      mode="r:") as tf:
        names = [m.name.removeprefix("./") for m in tf.getmembers()]
    # prefetch files first, then the landmark
    assert names.index("etc/hostname") < names.index(".prefetch.landmark") \
        < names.index("keep/old/c")


def client_blob(registry: Registry, ref: Reference, digest: str) -> bytes:
    with RegistryClient() as client:
        return client.get_blob(ref, digest)


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    cases = [
        ([f"oci:{tmp_path / 'none'}:v1", f"oci:{tmp_path / 'out'}"], 3, "oci-layout"),
        (["Bad Ref", f"oci:{tmp_path / 'out'}"], 2, "invalid image reference"),
        ([f"oci:{tmp_path}", "x", "--chunk-size", "lots"], 2, "--chunk-size"),
    ]
    for args, code, text in cases:
        out = subprocess.run([sys.executable, "-m", "coldstart.cli", "convert", *args],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == code, out.stderr
        assert text in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
    help_text = subprocess.run([sys.executable, "-m", "coldstart.cli", "convert", "--help"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    for option in ("--format", "--chunk-size", "--prefetch-list", "--platform", "--insecure"):
        assert option in help_text


def test_wrong_diff_id_is_refused_and_nothing_tagged(tmp_path: Path) -> None:
    good = _image()
    config = json.loads(good.config)
    config["rootfs"]["diff_ids"][1] = digest_of(b"not the layer")
    bad_config = canonical_json(config)
    manifest = json.loads(good.manifest)
    manifest["config"]["digest"] = digest_of(bad_config)
    manifest["config"]["size"] = len(bad_config)
    bad = BuiltImage(good.layers, good.blobs, bad_config, canonical_json(manifest))
    write_layout(tmp_path / "src", bad, "v1")
    with pytest.raises(IntegrityError, match="uncompressed content"):
        convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'dst'}:v1")
    assert OciLayout(tmp_path / "dst").index().manifests == ()


def test_bad_inputs(tmp_path: Path) -> None:
    image = build_image([TarBuilder().file("a", b"a").bytes()])
    write_layout(tmp_path / "src", image, "v1")
    with pytest.raises(InvalidArgument, match="unknown layer format"):
        convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'o'}", format="lz4")
    with pytest.raises(NotFound):
        convert_image(f"oci:{tmp_path / 'src'}:v9", f"oci:{tmp_path / 'o'}")
    # a corrupt blob in the source is caught by its digest before anything is written
    layout = OciLayout(tmp_path / "src")
    layout.blob_path(image.descriptors()[0].digest).write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(IntegrityError):
        convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'o2'}:v1")
    assert OciLayout(tmp_path / "o2").index().manifests == ()


def test_plain_tar_and_zstd_sources(tmp_path: Path) -> None:
    """Uncompressed and (non-seekable) zstd source layers convert too; diff_ids still checked."""
    tars = [TarBuilder().file("plain.txt", b"plain\n" * 1000).bytes(),
            TarBuilder().dir("z").file("z/zstd.txt", b"zstd\n" * 1000).bytes()]
    blobs = [tars[0], zstandard.ZstdCompressor().compress(tars[1])]
    types = ["application/vnd.oci.image.layer.v1.tar", OCI_LAYER_ZSTD]
    config = canonical_json({"architecture": "amd64", "os": "linux",
                             "rootfs": {"type": "layers",
                                        "diff_ids": [digest_of(t) for t in tars]}})
    layout = OciLayout.create(tmp_path / "src")
    for b in [*blobs, config]:
        layout.put_blob(b, "x")
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest_of(config), "size": len(config)},
        "layers": [{"mediaType": t, "digest": digest_of(b), "size": len(b)}
                   for t, b in zip(types, blobs, strict=True)]})
    layout.add_manifest(layout.put_blob(manifest, "application/vnd.oci.image.manifest.v1+json"),
                        "v1")
    summary = convert_image(f"oci:{tmp_path / 'src'}:v1", f"oci:{tmp_path / 'dst'}:v1",
                            format="estargz")
    assert summary.layers_converted == 2
    dst = OciLayout(tmp_path / "dst")
    out = parse_manifest(dst.read_blob(summary.digest))
    for desc, original in zip(out.layers, tars, strict=True):
        assert desc.media_type == OCI_LAYER_GZIP
        assert _entries(_untar(dst.read_blob(desc.digest))) == _entries(original)
