"""A real S3 API server (moto's ``moto_server``) on loopback.

moto accepts any credentials; :data:`DUMMY_CREDENTIALS` are the ones its clients are given (put
them in a client's environment: no real account is ever reached, the endpoint is loopback).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from coldstart.errors import FailedPrecondition
from coldstart.stack.procs import daemon, free_port, tcp_open

MOTO_SERVER = str(Path(sys.executable).with_name("moto_server"))

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def start_s3(tmp: Path, *, timeout: float = 60.0) -> Iterator[str]:
    """Run ``moto_server`` on 127.0.0.1 (log in ``tmp``) until the block ends; yields its
    endpoint URL (``http://127.0.0.1:PORT``)."""
    if not Path(MOTO_SERVER).exists():
        raise FailedPrecondition(f"{MOTO_SERVER} is missing (pip install 'moto[server]')")
    port = free_port()
    env = {**os.environ, **DUMMY_CREDENTIALS}
    with daemon([MOTO_SERVER, "-H", "127.0.0.1", "-p", str(port)], log=tmp / "moto.log",
                ready=tcp_open(port), what="moto_server", env=env, timeout=timeout):
        yield f"http://127.0.0.1:{port}"
