"""OCI layout directories: create, write verified blobs, tag, resolve."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.errors import IntegrityError, InvalidArgument, NotFound
from coldstart.oci.layout import REF_NAME, OciLayout, parse_layout_spec
from coldstart.oci.manifest import OCI_MANIFEST, digest_of


def test_parse_spec() -> None:
    assert parse_layout_spec("oci:/tmp/x") == (Path("/tmp/x"), None)
    assert parse_layout_spec("oci:/tmp/x:v1") == (Path("/tmp/x"), "v1")
    assert parse_layout_spec("oci:rel/dir:latest") == (Path("rel/dir"), "latest")
    assert parse_layout_spec("oci:/a:b/c") == (Path("/a:b/c"), None)
    with pytest.raises(InvalidArgument):
        parse_layout_spec("oci:")


def test_create_put_tag_resolve(tmp_path: Path) -> None:
    layout = OciLayout.create(tmp_path / "img")
    assert (tmp_path / "img" / "oci-layout").is_file()
    desc = layout.put_blob(b"manifest-1", OCI_MANIFEST)
    assert layout.read_blob(desc.digest) == b"manifest-1"
    layout.add_manifest(desc, "v1")
    d2 = layout.put_blob(b"manifest-2", OCI_MANIFEST)
    layout.add_manifest(d2, "v2")
    layout.add_manifest(d2, "v1")   # retag: replaces the v1 entry
    assert layout.resolve("v1").digest == d2.digest
    assert layout.resolve("v2").annotations[REF_NAME] == "v2"
    assert len(OciLayout(tmp_path / "img").index().manifests) == 2
    with pytest.raises(InvalidArgument, match="name one"):
        layout.resolve(None)
    with pytest.raises(NotFound):
        layout.resolve("v3")


def test_integrity(tmp_path: Path) -> None:
    layout = OciLayout.create(tmp_path)
    desc = layout.put_blob(b"hello", "x")
    layout.blob_path(desc.digest).write_bytes(b"HELLO")
    with pytest.raises(IntegrityError):
        layout.read_blob(desc.digest)
    f = tmp_path / "in"
    f.write_bytes(b"data")
    with pytest.raises(IntegrityError):
        layout.ingest_file(f, digest_of(b"other"))
    assert f.exists()  # nothing lost on a refused ingest
    assert layout.ingest_file(f, digest_of(b"data")) == digest_of(b"data")
    assert not f.exists() and layout.read_blob(digest_of(b"data")) == b"data"


def test_not_a_layout(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        OciLayout(tmp_path)
