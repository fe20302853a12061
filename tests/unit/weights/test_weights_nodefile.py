"""The loader's node path without a node: when it does not apply, and what a fork leaves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coldstart.lazyfs import filewire
from coldstart.weights import nodefile


def test_it_does_not_apply_without_a_socket_or_a_token(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"x" * 100)
    monkeypatch.setenv(filewire.SOCKET_ENV, "")
    assert nodefile.node_source(f) is None                  # turned off
    monkeypatch.setenv(filewire.SOCKET_ENV, str(tmp_path / "files.sock"))
    assert nodefile.node_source(f) is None                  # a local file: no token
    monkeypatch.delenv(filewire.SOCKET_ENV)
    assert filewire.socket_path() in (None, filewire.DEFAULT_SOCKET)


def test_a_forked_child_shares_no_connection_lock_or_staging_with_its_parent() -> None:
    nodefile._pool("/nonexistent/files.sock")
    parent_staging = nodefile._staging()
    assert nodefile._POOLS
    pid = os.fork()
    if pid == 0:        # the child: exit status says what it found
        ok = (not nodefile._POOLS and nodefile._POOLS_LOCK.acquire(blocking=False)
              and nodefile._staging() is not parent_staging)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    nodefile._POOLS.pop("/nonexistent/files.sock", None)
