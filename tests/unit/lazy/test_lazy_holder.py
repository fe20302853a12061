"""The FUSE descriptor holder, with a pipe for a FUSE connection: it keeps what it is given,
hands a copy back, and exits when told to or when the connection is gone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from coldstart.lazyfs import handover


def _start(root: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "coldstart.lazyfs.holder",
                             str(root / handover.HOLDER_SOCKET)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_it_keeps_a_copy_hands_it_back_and_lets_go_when_told(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    sock = tmp_path / handover.HOLDER_SOCKET
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert handover.fetch(tmp_path) is None               # nothing held yet
    r, w = os.pipe()
    handover.hold(w, tmp_path)                            # the running holder takes it
    os.close(w)                                           # ours is gone, the holder's stays
    back = handover.fetch(tmp_path)
    assert back is not None
    os.write(back, b"same pipe")
    os.close(back)
    assert os.read(r, 100) == b"same pipe"
    handover.release(tmp_path)
    assert proc.wait(10) == 0 and not sock.exists()
    assert os.read(r, 100) == b""                         # no writer left anywhere
    os.close(r)


def test_it_exits_when_the_connection_is_gone(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    r, w = os.pipe()
    handover.hold(w, tmp_path)
    os.close(w)
    os.close(r)                                           # the held write end now polls ERR
    assert proc.wait(10) == 0
    assert handover.fetch(tmp_path) is None
