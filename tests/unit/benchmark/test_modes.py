"""Which bench modes may run together (checked before anything is built or started)."""

from __future__ import annotations

import pytest

from coldstart.benchmark.runner import check_modes, parse_modes
from coldstart.errors import InvalidArgument


def test_the_grid_ablation_needs_the_profiled_mode_in_the_same_run() -> None:
    check_modes(parse_modes("coldstart+profile,coldstart+profile-grid"), {})
    check_modes(parse_modes("coldstart+profile-grid,coldstart+fill"), {})   # same recording
    check_modes(parse_modes("overlayfs,coldstart+profile"), {})
    with pytest.raises(InvalidArgument, match="bench both in one run"):
        check_modes(parse_modes("overlayfs,coldstart+profile-grid"), {})
    with pytest.raises(InvalidArgument, match="without --image"):
        check_modes(parse_modes("coldstart+profile,coldstart+profile-grid"),
                    {"coldstart+profile": "registry.example/app:opt"})
