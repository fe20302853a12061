"""`coldstart bench --help` offers the modes a user chooses between; our own A/B variants
(ablations) are accepted by --mode but not listed (docs/bench.md and bench/ scripts name them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coldstart.benchmark.node import MODES
from coldstart.benchmark.runner import parse_modes
from coldstart.errors import InvalidArgument

ABLATIONS = ("coldstart+profile-nowarm", "coldstart+profile-grid", "coldstart+profile-xattrs")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", "bench", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


def test_the_ablations_are_marked() -> None:
    assert {n for n, m in MODES.items() if m.ablation} == set(ABLATIONS)


def test_help_lists_every_user_mode_and_no_ablation() -> None:
    r = _bench("--help")
    assert r.returncode == 0, r.stderr
    # the help text is written by hand: it must name every mode a user chooses between
    for name, mode in MODES.items():
        if not mode.ablation:
            assert name in r.stdout, name
    for name in ABLATIONS:
        assert name not in r.stdout, name
    assert "profile-nowarm" not in r.stdout and "-xattrs" not in r.stdout
    assert "-grid" not in r.stdout


@pytest.mark.parametrize("name", ABLATIONS)
def test_the_ablations_are_still_accepted(name: str) -> None:
    assert parse_modes(f"coldstart+profile,{name}") == ["coldstart+profile", name]
    # through the CLI: --mode passes, and the next check (where to run) is what stops it
    r = _bench("oci:/nonexistent", "--mode", f"overlayfs,coldstart+profile,{name}")
    assert r.returncode == 2, r.stderr
    assert "say where to run" in r.stderr and "unknown mode" not in r.stderr


def test_an_unknown_mode_names_only_the_user_modes() -> None:
    with pytest.raises(InvalidArgument, match="unknown mode 'warp'") as info:
        parse_modes("overlayfs,warp")
    for name in ABLATIONS:
        assert name not in str(info.value)
    r = _bench("oci:/nonexistent", "--mode", "warp", "--embedded")
    assert r.returncode == 2 and "unknown mode 'warp'" in r.stderr, r.stderr
