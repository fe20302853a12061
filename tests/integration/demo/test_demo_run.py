"""The built-in demo runs end to end against a real registry and reports honest figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.benchmark.demo import run_demo
from coldstart.cli import main

pytestmark = pytest.mark.integration


def test_demo_converts_and_lazy_startup_fetches_a_fraction(tmp_path: Path) -> None:
    lines: list[str] = []
    results = run_demo(lines.append, workdir=tmp_path, scale=0.1)
    for fmt in ("zstd:chunked", "estargz"):
        r = results[fmt]
        assert isinstance(r, dict)
        # the start-up reads a fraction of the files: it must fetch less than the whole image,
        # and more than nothing (the TOCs and the files it reads)
        assert 0 < r["startup_fetched_bytes"] < r["size_after"]
    assert any("converted to zstd:chunked" in line for line in lines)
    # step 8 ran the image in containerd, lazily and in full (this suite runs as root)
    ctd = results["containerd"]
    assert isinstance(ctd, dict)
    lazy = results["zstd:chunked"]
    assert isinstance(lazy, dict)
    assert 0 < ctd["lazy_fetched_bytes"] < lazy["size_after"]


def test_demo_cli_help_explains() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
