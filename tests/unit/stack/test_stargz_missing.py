"""stargz_missing() names what the stargz peer lacks on this machine (no Go needed)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from coldstart.errors import FailedPrecondition
from coldstart.stack import stargz


def test_names_go_when_go_is_not_on_path(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))      # an empty directory: no tool at all
    why = stargz.stargz_missing()
    assert why is not None
    assert "`go`" in why and "golang-go" in why


def test_build_refuses_without_go(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FailedPrecondition, match="`go`"):
        stargz.build_stargz_daemon(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_names_the_go_sources_when_they_are_missing(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    fake_go = tmp_path / "go"
    fake_go.write_text("#!/bin/sh\nexit 0\n")
    fake_go.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(stargz, "GO_SOURCES", tmp_path / "no-gocode")
    why = stargz.stargz_missing()
    assert why is not None
    assert "no Go sources" in why and "golang-github-containerd-" in why


def test_names_ctr_remote_when_only_it_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    go = shutil.which("go")
    if go is None or stargz._build_missing() is not None:
        pytest.skip("needs go and the Go sources to get past the first checks")
    (tmp_path / "go").symlink_to(go)
    monkeypatch.setenv("PATH", str(tmp_path))
    why = stargz.stargz_missing()
    assert why is not None and "ctr-remote" in why


def test_none_or_a_reason_on_this_machine() -> None:
    why = stargz.stargz_missing()
    if why is None:
        assert os.geteuid() == 0 and Path("/dev/fuse").exists()
    else:
        assert why.strip() and "\n" not in why
