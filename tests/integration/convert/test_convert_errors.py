"""Conversion errors are clear and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument, NotFound
from coldstart.oci.convert import convert_image
from coldstart.oci.layout import OciLayout


def test_a_missing_source_leaves_no_destination(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(NotFound, match="not an OCI image layout"):
        convert_image(f"oci:{tmp_path / 'missing'}:v1", f"oci:{dst}:v1")
    assert not dst.exists()


def test_an_unwritable_destination_is_an_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot create an OCI layout in /proc/"):
        OciLayout.create(Path("/proc/coldstart-test/layout"))
